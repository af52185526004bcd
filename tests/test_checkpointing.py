"""Run checkpoints (train state + data state + meta) and the metric files a resume truncates."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.train import checkpointing
from jaxrl_agents.train import metrics as metrics_lib


def _state(value: float):
  return {"params": {"w": jnp.full((3, 2), value), "b": jnp.arange(2.0) + value},
          "opt": (jnp.int32(int(value)), {"mu": jnp.ones(4) * value})}


def _assert_tree_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_save_restore_round_trip_and_keep_last_k(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), {"next_index": 4 * step}, {"step": step, "seed": 7})
  assert ckpt.steps() == [2, 3]  # keeps the last two
  step, state, data_state, meta = ckpt.restore_latest(_state(0))
  assert step == 3 and data_state == {"next_index": 12} and meta == {"step": 3, "seed": 7}
  _assert_tree_equal(state, _state(3))
  ckpt.close()


def test_empty_workdir_restores_nothing(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  assert ckpt.restore_latest(_state(0)) is None
  ckpt.close()
  with pytest.raises(FileNotFoundError, match="no checkpoint in .*checkpoints"):
    checkpointing.latest_policy_params(str(tmp_path))


def _corrupt(step_dir: str) -> None:
  """Truncates every array file of the state item, as a crash mid-write might."""
  hit = 0
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      if name.startswith(("_", ".")) or name.endswith(".json"):
        continue
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(3)
      hit += 1
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for name in files:
      if name in ("_METADATA", "_sharding", "manifest.ocdbt") or name.endswith(".json"):
        with open(os.path.join(root, name), "w") as f:
          f.write("{not json")
        hit += 1
  assert hit, f"nothing to corrupt under {step_dir}"


def test_corrupt_latest_falls_back_to_previous_and_is_set_aside(tmp_path, caplog):
  ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(step), {"next_index": step}, {"step": step})
  _corrupt(os.path.join(ckpt.directory, "2"))
  with caplog.at_level("WARNING"):
    step, state, data_state, _ = ckpt.restore_latest(_state(0))
  assert step == 1 and data_state == {"next_index": 1}
  _assert_tree_equal(state, _state(1))
  assert "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
  # The broken step is kept for inspection but no longer counts, so step 2 can be saved again.
  assert os.path.isdir(os.path.join(ckpt.directory, "2.unreadable"))
  assert ckpt.steps() == [1]
  ckpt.save(2, _state(20), {"next_index": 2}, {"step": 2})
  step, state, _, _ = ckpt.restore_latest(_state(0))
  assert step == 2
  _assert_tree_equal(state, _state(20))
  ckpt.close()


def test_latest_policy_params_needs_no_target(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  layers = [{"k": jnp.ones((2,)) * i} for i in range(3)]
  ckpt.save(5, {"params": {"embed": jnp.eye(2), "layers": layers}, "updates": jnp.int32(5)},
            {"next_index": 0}, {"step": 5, "model": "tiny"})
  ckpt.close()
  params, meta, step = checkpointing.latest_policy_params(str(tmp_path))
  assert step == 5 and meta["model"] == "tiny"
  assert isinstance(params["layers"], list) and len(params["layers"]) == 3
  np.testing.assert_array_equal(params["layers"][2]["k"], [2.0, 2.0])
  np.testing.assert_array_equal(params["embed"], np.eye(2))


def test_metric_writer_truncates_records_after_the_resumed_step(tmp_path):
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  for step in range(1, 6):
    writer.write_scalars(step, {"reward_mean": step / 10})
    writer.write_samples(step, [{"prompt": "p", "completion": str(step)}])
  writer.close()
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  writer.truncate_after(3)
  writer.write_scalars(4, {"reward_mean": 0.44})
  writer.close()
  records = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert records[-1]["reward_mean"] == 0.44
  samples = metrics_lib.read_jsonl(os.path.join(tmp_path, "samples.jsonl"))
  assert [s["step"] for s in samples] == [1, 2, 3]


def test_truncation_drops_a_line_cut_short_by_a_kill(tmp_path):
  writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False)
  writer.write_scalars(1, {"reward_mean": 0.1})
  writer.write_scalars(2, {"reward_mean": 0.2})
  writer.close()
  with open(writer.metrics_path, "a") as f:
    f.write('{"step": 3, "kind": "tr')
  writer.truncate_after(2)
  assert [r["step"] for r in metrics_lib.read_jsonl(writer.metrics_path)] == [1, 2]
