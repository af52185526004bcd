"""Process reward models: Monte-Carlo step labels, the trainer, and a PRM as GRPO's reward."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import process_reward_model as prm_experiment
from experiments import step_data
from experiments.configs import process_reward_model_arithmetic
from jaxrl_agents.data import preferences
from jaxrl_agents.data import steps as steps_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.train import metrics as metrics_lib


def test_label_steps_values_are_the_continuations_success_rates_by_hand():
  """Step k's value is the share of its continuations the grader accepts (each graded as the
  prefix plus the continuation); the last step's is the reply's own verdict."""
  seen = []

  def continue_fn(prompts, prefixes):
    seen.extend(zip(prompts, prefixes, strict=True))
    # from "a\n": 3 of 4 continuations end in "ok"; from "a\nb\n": 1 of 4
    table = {"a\n": ["ok", "ok", "no", "ok"], "a\nb\n": ["no", "no", "ok", "no"],
             "x\n": ["no"] * 4}
    return [table[p] for p in prefixes]

  def grade(texts, examples):
    return [float(t.endswith("ok")) for t in texts]

  rows = step_data.label_steps(["p", "q", "r"], ["a\nb\nc", "x\ny", "single"], [1.0, 0.0, 1.0],
                               [{"answer": "1"}, {"answer": "2"}, {"answer": "3"}],
                               continue_fn=continue_fn, grade=grade, separator="\n",
                               max_steps=4)
  assert seen == [("p", "a\n"), ("p", "a\nb\n"), ("q", "x\n")]
  assert [r["steps"] for r in rows] == [["a\n", "b\n", "c"], ["x\n", "y"], ["single"]]
  assert [r["values"] for r in rows] == [[0.75, 0.25, 1.0], [0.0, 0.0], [1.0]]
  assert [r["correct"] for r in rows] == [1.0, 0.0, 1.0] and rows[1]["answer"] == "2"


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def test_sampler_continuations_sample_m_replies_per_prefix_reproducibly(tiny):
  config = process_reward_model_arithmetic.get_config("tiny")
  fn = step_data.sampler_continuations(tiny, config, seed=3, desc="", progress=False)
  prompts, prefixes = ["What is 1 + 1?"] * 3, ["a ", "a b ", "zz"]
  out = fn(prompts, prefixes)
  m = config.generation.continuations
  assert len(out) == 3 and all(len(c) == m and all(isinstance(t, str) for t in c) for c in out)
  assert fn(prompts, prefixes) == out  # a function of the seed
  other = step_data.sampler_continuations(tiny, config, seed=4, desc="", progress=False)
  assert other(prompts, prefixes) != out


def _signal_rows(n, seed):
  """Replies of 1-3 random steps; a step ending in '!' has value 1, one ending in '?' 0."""
  rng = np.random.default_rng(seed)
  words = ["red", "blue", "cat", "dog", "sun", "sea", "tree", "rock"]
  rows = []
  for _ in range(n):
    k = int(rng.integers(1, 4))
    marks = rng.integers(0, 2, size=k)
    steps = [" ".join(rng.choice(words, size=2)) + ("!" if m else "?") + "\n" for m in marks]
    rows.append({"prompt": " ".join(rng.choice(words, size=2)), "steps": steps,
                 "values": [float(m) for m in marks]})
  return rows


def _signal_config(tmp_path):
  preferences.write_pairs(tmp_path / "train.jsonl", _signal_rows(256, 0))
  preferences.write_pairs(tmp_path / "eval.jsonl", _signal_rows(64, 1))
  config = process_reward_model_arithmetic.get_config("tiny")
  config.steps_jsonl = str(tmp_path / "train.jsonl")
  config.eval_steps_jsonl = str(tmp_path / "eval.jsonl")
  config.step_separator = "\n"
  config.eval_size, config.steps, config.rows_per_step = 64, 40, 16
  config.eval_every, config.checkpoint_every, config.sample_every = 40, 40, 40
  config.reward_model.frozen_layers = 0
  config.optimizer.learning_rate = 3e-3
  return config


def test_process_reward_model_learns_a_learnable_step_signal_on_the_tiny_model(tmp_path):
  """Each step is scored on its own: a '?' step after '!' steps must score low."""
  config = _signal_config(tmp_path)
  result = prm_experiment.train(config, str(tmp_path / "run"), progress=False)
  records = metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  assert evals[0]["step"] == 0 and evals[0]["step_loss"] == pytest.approx(np.log(2), rel=1e-4)
  assert np.mean([r["loss"] for r in train[-5:]]) < 0.5 * np.log(2)
  assert result["step_accuracy"] >= 0.9 and result["step_mae"] < 0.3


def test_tiny_generated_steps_run_writes_every_artifact_and_resumes_exactly(tmp_path,
                                                                          crashed_copy):
  config = process_reward_model_arithmetic.get_config("tiny")
  config.keep_checkpoints = 4  # the resume below starts from step 2's
  full = str(tmp_path / "full")
  result = prm_experiment.train(config, full, progress=False)
  for name in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard",
               "steps/train.jsonl", "steps/eval.jsonl", "steps/candidates.jsonl",
               "steps/generation.json"):
    assert os.path.exists(os.path.join(full, name)), name
  for key in ("step_loss", "step_accuracy", "best_of_2_accuracy/min", "best_of_2_accuracy/last",
              "greedy_accuracy", "pass_at_2"):
    assert key in result, key
  with open(os.path.join(full, "steps", "train.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  # the last step's label is the reply's verdict; the others are shares of 2 continuations
  assert all(r["values"][-1] == r["correct"] for r in rows)
  assert all(v in (0.0, 0.5, 1.0) for r in rows for v in r["values"])
  records = lambda w, kind: [r for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))
                             if r["kind"] == kind]
  # A crash after the checkpoint of step 2 (the labelled steps already generated), resumed.
  part = crashed_copy(full, tmp_path / "part", 2)
  prm_experiment.train(config, part, progress=False)
  strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                      for r in rs]
  assert strip(records(part, "train")) == strip(records(full, "train"))
  assert strip(records(part, "eval")) == strip(records(full, "eval"))
  config.max_steps = 3  # other settings: the generated rows are refused, not replaced
  with pytest.raises(ValueError, match="other settings"):
    prm_experiment.train(config, full, progress=False)


def test_a_trained_process_reward_model_is_grpos_reward(tmp_path):
  """Loaded as a reward, a reply's reward is the smallest sigmoid of its step scores (by
  default; "last" and "clip" on request), computed here from the model's own step scores;
  a tiny GRPO run with it as the only reward logs its component."""
  from experiments import grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.models import reward_model as rm_lib
  from jaxrl_agents.rewards import learned

  config = _signal_config(tmp_path)
  config.steps = 30
  prm_dir = str(tmp_path / "prm")
  prm_experiment.train(config, prm_dir, progress=False)

  replies = ["red cat!\nblue dog!", "red cat!\nblue dog?", "sun sea?"]
  got = {how: learned.reward_model_reward(replies, [{"question": "tree rock"}] * 3,
                                          workdir=prm_dir, prompt_template="{question}",
                                          batch_size=4, aggregate=how)
         for how in ("min", "last", "clip")}
  assert got["min"][0] > got["min"][1] and got["min"][0] > got["min"][2]
  reward = learned.load(prm_dir, 4, 0, "min")
  step_lists = [steps_lib.split_steps(r, "\n", config.max_steps) for r in replies]
  e = steps_lib.encode_steps(reward.tokenizer, ["tree rock"] * 3, step_lists,
                             max_len=config.reward_model.max_len, max_steps=config.max_steps)
  probs = np.asarray(jax.nn.sigmoid(rm_lib.step_scores(
      reward.params, *(jnp.asarray(x) for x in (e.tokens, e.mask, e.ends, e.step_mask)),
      cfg=zoo.load("tiny").cfg)))
  n = [len(s) for s in step_lists]
  np.testing.assert_allclose(got["min"], [probs[i, :k].min() for i, k in enumerate(n)],
                             rtol=1e-5)
  np.testing.assert_allclose(got["last"], [probs[i, k - 1] for i, k in enumerate(n)], rtol=1e-5)
  np.testing.assert_allclose(got["clip"], [np.minimum(probs[i, :k] - 0.5, 0).sum()
                                           for i, k in enumerate(n)], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="aggregate must be one of"):
    learned.LearnedReward(prm_dir, aggregate="sum")

  grpo_config = grpo_arithmetic.get_config("tiny")
  grpo_config.rewards = {"reward_model": {"weight": 1.0, "workdir": prm_dir}}
  grpo_config.steps = 2
  grpo.train(grpo_config, str(tmp_path / "grpo"), progress=False)
  train = [r for r in metrics_lib.read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
           if r["kind"] == "train"]
  assert len(train) == 2 and "reward/reward_model_mean" in train[0]
