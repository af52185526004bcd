"""The run harness with a trainer that is not RL: least squares by SGD on streamed batches."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxrl_agents.train import harness, metrics

TRUE_W = np.array([1.5, -2.0, 0.5], np.float32)


class Batches:
  """Deterministic regression batches; its state is the next batch index (checkpointed)."""

  def __init__(self):
    self.index = 0

  def __next__(self):
    rng = np.random.default_rng(self.index)
    self.index += 1
    x = rng.normal(size=(16, 3)).astype(np.float32)
    return x, x @ TRUE_W

  def get_state(self):
    return {"index": self.index}

  def set_state(self, state):
    self.index = state["index"]


def _config(**overrides):
  c = ml_collections.ConfigDict(dict(
      seed=0, steps=6, eval_every=2, eval_every_s=0.0, time_budget_s=0.0, checkpoint_every=3,
      keep_checkpoints=5, sample_every=2, samples_per_log=2, tensorboard=False,
      max_consecutive_nonfinite=3, learning_rate=0.1))
  c.update(overrides)
  return c


def _train(config, workdir, stop_after=None):
  data = Batches()
  calls = []

  def train_step(state, rng, progress):
    x, y = next(data)
    noise = 0.01 * jax.random.normal(rng, y.shape)  # the step key must matter for the result
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y - noise) ** 2))(state["w"])
    calls.append(progress)
    if stop_after is not None and len(calls) > stop_after:
      raise KeyboardInterrupt  # a crash mid-run
    w = state["w"] - config.learning_rate * grad
    return harness.StepResult({"w": w, "bad": state["bad"] + (~jnp.isfinite(loss))},
                              {"loss": float(loss)}, [{"w0": float(w[0])}] * 3)

  def evaluate(state):
    return {"error": float(jnp.sum((state["w"] - TRUE_W) ** 2))}, [{"w": state["w"].tolist()}]

  result = harness.run(config, workdir, init_state=lambda: {"w": jnp.zeros(3),
                                                            "bad": jnp.zeros((), jnp.int32)},
                       train_step=train_step, evaluate=evaluate, data=data,
                       nonfinite_count=lambda s: (int(s["bad"]), int(s["bad"])), progress=False)
  return result, calls


def _records(workdir):
  return metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def test_schedule_logs_and_checkpoints(tmp_path):
  workdir = str(tmp_path / "run")
  result, calls = _train(_config(), workdir)
  records = _records(workdir)
  assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2, 4, 6]
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
  errors = [r["error"] for r in records if r["kind"] == "eval"]
  assert errors[-1] < 0.5 * errors[0] and result["error"] == errors[-1]
  assert calls == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])  # steps / config.steps
  assert all({"step_time_s", "train_time_s", "compile_time_s", "loss"} <= r.keys()
             for r in records if r["kind"] == "train")
  samples = metrics.read_jsonl(os.path.join(workdir, "samples.jsonl"))
  # samples_per_log of the train step's samples every sample_every steps, plus eval samples.
  assert sorted((s["step"], s["kind"]) for s in samples if s["kind"] == "train") == \
      [(2, "train")] * 2 + [(4, "train")] * 2 + [(6, "train")] * 2
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
  assert json.load(open(os.path.join(workdir, "config.json")))["steps"] == 6


def test_a_crash_resumes_to_the_same_run(tmp_path):
  whole = str(tmp_path / "whole")
  _train(_config(), whole)
  crashed = str(tmp_path / "crashed")
  with pytest.raises(KeyboardInterrupt):
    _train(_config(), crashed, stop_after=4)  # dies in step 5; step 3 is checkpointed
  assert max(r["step"] for r in _records(crashed)) == 4
  _, calls = _train(_config(), crashed)
  assert len(calls) == 3  # steps 4, 5, 6 only
  strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]
  assert strip(_records(crashed)) == strip(_records(whole))


def test_a_changed_config_is_refused_and_more_steps_continue(tmp_path):
  workdir = str(tmp_path / "run")
  _train(_config(), workdir)
  with pytest.raises(ValueError, match="learning_rate: 0.1 -> 0.2"):
    _train(_config(learning_rate=0.2), workdir)
  _, calls = _train(_config(steps=8), workdir)
  assert len(calls) == 2


def test_time_budget_stops_checkpoints_and_evaluates(tmp_path):
  workdir = str(tmp_path / "run")
  _train(_config(steps=1000, time_budget_s=1e-9, eval_every=0, eval_every_s=1.0), workdir)
  records = _records(workdir)
  assert [r["step"] for r in records if r["kind"] == "train"] == [1]
  assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 1]
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["1"]
  # Resumed with its budget spent, the run is over: no step, no second evaluation.
  result, calls = _train(_config(steps=1000, time_budget_s=1e-9, eval_every=0,
                                 eval_every_s=1.0), workdir)
  assert calls == [] and result == {k: v for k, v in records[-1].items()
                                    if k not in ("step", "kind")}
  assert _records(workdir) == records


def test_nonfinite_steps_stop_the_run(tmp_path):
  workdir = str(tmp_path / "run")
  data_nan = _config(learning_rate=float("nan"), max_consecutive_nonfinite=2)
  with pytest.raises(harness.TrainingStopped, match="2 consecutive updates"):
    _train(data_nan, workdir)
