"""SFT (experiments/sft.py) and rejection-sampling rounds (experiments/rejection_sampling.py)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import rejection_sampling, sft
from experiments.configs import rejection_sampling_arithmetic, sft_arithmetic
from jaxrl_agents.data import preferences
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.train import metrics as metrics_lib

_strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                     for r in rs]


def _records(workdir, kind):
  return [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["kind"] == kind]


def test_sft_loss_is_the_replys_mean_nll_from_an_unpadded_forward():
  model = zoo.load("tiny")
  rows = [("2 + 3?", "5"), ("a longer question?", "a longer answer")]
  batch, _ = sft.encode_rows(model.tokenizer, [p for p, _ in rows], [c for _, c in rows],
                             max_len=128, chat=True, system=None)
  loss, metrics = jax.jit(sft.sft_loss, static_argnames="cfg")(model.params, batch, cfg=model.cfg)
  nll, count = 0.0, 0
  for p, c in rows:
    ids, start = preferences.response_ids(model.tokenizer, p, c)
    # Jitted: eager, each op of the forward would compile on its own.
    logits, _ = jax.jit(transformer.apply, static_argnames="cfg")(
        model.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], model.cfg)
    logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    nll -= float(sum(logp[t - 1, ids[t]] for t in range(start, len(ids))))
    count += len(ids) - start
  assert float(loss) == pytest.approx(nll / count, rel=1e-5)
  assert float(metrics["num_tokens"]) == count


def test_sft_on_jsonl_lowers_held_out_nll_and_resumes_exactly(tmp_path):
  rng = np.random.default_rng(0)
  def rows(n):
    return [{"prompt": f"Repeat {w}", "completion": f"{w} {w}"}
            for w in rng.choice(["cat", "dog", "sun", "sea", "tree"], n)]
  for name, n in (("train", 64), ("eval", 16)):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows(n))
  config = sft_arithmetic.get_config("tiny")
  config.jsonl_path, config.eval_jsonl_path = str(tmp_path / "train.jsonl"), str(
      tmp_path / "eval.jsonl")
  config.task = ""  # no task: the held-out NLL only
  config.eval_size = 16
  full = str(tmp_path / "full")
  sft.train(config, full, progress=False)
  evals = _records(full, "eval")
  assert [e["step"] for e in evals] == [0, 2, 4]
  assert evals[-1]["held_out_nll"] < 0.8 * evals[0]["held_out_nll"]
  part = str(tmp_path / "part")
  config.steps = 2
  sft.train(config, part, progress=False)
  config.steps = 4
  sft.train(config, part, progress=False)
  assert _strip(_records(part, "train")) == _strip(_records(full, "train"))
  assert _strip(_records(part, "eval")) == _strip(_records(full, "eval"))
  with open(tmp_path / "bad.jsonl", "w") as f:
    f.write('{"prompt": "q", "completion": "a"}\n{"prompt": "q"}\n')
  config.jsonl_path = str(tmp_path / "bad.jsonl")
  with pytest.raises(ValueError, match="bad.jsonl:2: missing field 'completion'"):
    sft.train(config, str(tmp_path / "bad"), progress=False)


def test_sft_from_task_rows_writes_the_task_accuracy(tmp_path):
  config = sft_arithmetic.get_config("tiny")
  config.steps, config.eval_every = 2, 2
  result = sft.train(config, str(tmp_path / "run"), progress=False)
  assert "accuracy" in result and result["num_examples"] == 8
  rows = sft.task_rows(config)
  assert rows[0]["prompt"].endswith("Answer with just the number.")
  assert rows[0]["completion"].lstrip("-").isdigit()


def test_rejection_sampling_rounds_keep_the_best_replies_and_resume_exactly(tmp_path,
                                                                          monkeypatch):
  """Two rounds of two steps: each round logs its sampling figures on its first step, the
  kept rows are each question's best reply, and a run stopped mid-round resumes with the same
  buffer and the same records."""
  config = rejection_sampling_arithmetic.get_config("tiny")
  full = str(tmp_path / "full")
  rejection_sampling.train(config, full, progress=False)
  train = _records(full, "train")
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert [r.get("round") for r in train] == [1, None, 2, None]
  # min_reward 0: every question keeps exactly its best reply (keep_top 1).
  assert all(r["buffer_rows"] == 4 for r in train)
  assert train[0]["round_kept_frac"] == pytest.approx(1 / 4)
  assert all(np.isfinite(r["loss"]) for r in train)
  kept = [s for s in metrics_lib.read_jsonl(os.path.join(full, "samples.jsonl"))
          if s["kind"] == "train" and s["step"] == 1]
  assert len(kept) == 4 and all("reward" in s for s in kept)
  # Each kept reply is its question's best finished one.
  assert np.mean([s["reward"] for s in kept]) == pytest.approx(
      train[0]["round_best_finished_reward_mean"])
  evals = _records(full, "eval")
  assert [e["step"] for e in evals] == [0, 2, 4] and "accuracy" in evals[0]
  # Without keep_unfinished only finished replies are kept: the random model's rarely are.
  config.keep_unfinished = False
  config.steps = 2
  strict = str(tmp_path / "strict")
  rejection_sampling.train(config, strict, progress=False)
  first = _records(strict, "train")[0]
  assert first["buffer_rows"] == round(4 * first["round_prompts_with_a_kept_reply"])
  assert first["round_kept_frac"] <= first["round_finished_frac"]
  config.keep_unfinished = True
  part = str(tmp_path / "part")
  config.steps = 3
  with pytest.raises(ValueError, match="whole number of rounds"):
    rejection_sampling.train(config, part, progress=False)
  config.steps = 4
  # A crash in step 4 (the second step of round 2): the resumed run restores the buffer of
  # round 2 from the step-3 checkpoint and takes step 4 on it.
  original = rejection_sampling.RejectionSampling.train_step
  calls = []

  def crash_in_step_four(self, state, rng, progress):
    if len(calls) == 3:
      raise KeyboardInterrupt
    calls.append(1)
    return original(self, state, rng, progress)

  monkeypatch.setattr(rejection_sampling.RejectionSampling, "train_step", crash_in_step_four)
  with pytest.raises(KeyboardInterrupt):
    rejection_sampling.train(config, part, progress=False)
  monkeypatch.setattr(rejection_sampling.RejectionSampling, "train_step", original)
  assert [r["step"] for r in _records(part, "train")] == [1, 2, 3]
  rejection_sampling.train(config, part, progress=False)
  assert _strip(_records(part, "train")) == _strip(train)


def test_sft_command_line_gives_the_same_records_with_either_host_memory_setting(tmp_path):
  """`experiments.sft` keeps freed host memory by default (--host_memory=retain); how
  glibc hands out memory must not change a single figure."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  records = {}
  for setting, flag, logged in (("default", [], "host memory: freed memory retained"),
                                ("system", ["--host_memory=system"], "host memory: system malloc")):
    workdir = str(tmp_path / setting)
    cmd = [sys.executable, "-m", "experiments.sft",
           "--config=experiments/configs/sft_arithmetic.py:tiny", f"--workdir={workdir}",
           "--config.steps=2", "--config.eval_every=2", *flag]
    r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert logged in r.stderr
    records[setting] = _strip(metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")))
  assert [r["kind"] for r in records["default"]].count("train") == 2
  assert records["default"] == records["system"]
