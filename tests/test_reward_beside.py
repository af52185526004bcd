"""A reward model trained beside the policy (experiments/reward_beside.py)."""

import os

import jax
import numpy as np
import pytest

from experiments import grpo
from experiments import reward_beside as beside
from experiments import reward_model as rm_experiment
from experiments.configs import grpo_arithmetic, reward_model_arithmetic
from jaxrl_agents import registry
from jaxrl_agents.data import preferences
from jaxrl_agents.models import reward_model as rm_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.train import checkpointing
from jaxrl_agents.train import metrics as metrics_lib


def test_grader_labels_prefer_accepted_replies_each_text_once():
  texts = ["a", "b", "a", "c", "x", "y", "x", "x"]
  correct = np.asarray([1, 0, 1, 0, 0, 0, 0, 0], np.float32)
  groups = beside.preferred_rows("grader", texts, correct, 4)
  assert groups == [([0], [1, 3]), ([], [4, 5])]
  pairs = beside.draw_pairs(groups, correct, limit=8, seed=0)
  assert sorted(zip(pairs.chosen, pairs.rejected, strict=True)) == [(0, 1), (0, 3)]
  assert pairs.graded_right.all()


def test_majority_labels_need_a_strict_majority_of_two_or_more():
  read = lambda reply: reply.split("=")[-1].strip() or None
  texts = ["1+1 = 2", "1+1= 2", "1+1 = 3", "oops =",      # "2" twice: the majority
           "2+2 = 4", "2+2 = 5", "4", "5",                # 4 and 5 tie: no pair
           "3+3 = 6", "7", "8", "9"]                      # all distinct: no pair
  correct = np.asarray([1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0], np.float32)
  groups = beside.preferred_rows("majority", texts, correct, 4, read)
  assert groups == [([0, 1], [2, 3]), ([], []), ([], [])]
  pairs = beside.draw_pairs(groups, correct, limit=3, seed=1)
  assert len(pairs.chosen) == 3  # the limit, out of four combinations
  assert set(pairs.chosen) <= {0, 1} and set(pairs.rejected) <= {2, 3}


def test_pairs_are_drawn_from_the_groups_in_turn():
  """One group with many combinations cannot fill the step while others have pairs."""
  groups = [([0, 1, 2], [3, 4, 5]), ([6], [7])]
  pairs = beside.draw_pairs(groups, np.zeros(8), limit=2, seed=0)
  assert sorted(pairs.chosen)[-1] == 6
  assert not pairs.graded_right.any()  # the grader rejected every reply here


def test_padding_pairs_leave_the_loss_and_its_gradient_unchanged():
  """weight-0 copies (the fixed-shape padding) against the real pairs alone."""
  model = zoo.load("tiny")
  params = rm_lib.init(model.params, jax.random.key(0), model.cfg, head_scale=0.5)
  config = reward_model_arithmetic.get_config("tiny")
  s = rm_experiment.settings_from_config(config, model.cfg)
  rows = [{"prompt": "2+2", "chosen": "4", "rejected": "five"},
          {"prompt": "1+3", "chosen": "4!", "rejected": "3"}]
  real, _ = rm_experiment.pair_batch(model.tokenizer, rows, s)
  padded, _ = rm_experiment.pair_batch(model.tokenizer, rows + [rows[0]] * 2, s)
  loss = lambda p, b: beside.weighted_bt_loss(p, b, cfg=model.cfg, s=s)[0]
  step = jax.jit(jax.value_and_grad(loss))  # eager, each op would compile on its own
  a, ga = step(params, (real, np.ones(2, np.float32)))
  b, gb = step(params, (padded, np.asarray([1, 1, 0, 0], np.float32)))
  np.testing.assert_allclose(a, b, rtol=1e-6)
  np.testing.assert_allclose(ga["head"]["w"], gb["head"]["w"], rtol=1e-5, atol=1e-7)


def _odd_length(completions, examples=None):
  """A grader the tiny random model passes about half the time."""
  del examples
  return np.asarray([len(c) % 2 for c in completions], np.float32)


def _grpo_config(rm_dir: str, steps: int):
  c = grpo_arithmetic.get_config("tiny")
  c.rewards = {"reward_model": {"weight": 1.0, "workdir": rm_dir}}
  c.reward_model_beside.pairs_per_step = 4
  c.reward_model_beside.head_learning_rate = 1e-2
  c.grader, c.reward_time_limit_s = "odd_length", 0.0  # registered in this process only
  c.steps = steps
  return c


def test_grpo_trains_its_reward_model_beside_the_policy_and_resumes_exactly(tmp_path,
                                                                            crashed_copy):
  """The policy's reward is the train state's reward model, which takes a Bradley-Terry step
  on the step's graded pairs: its checkpointed head moves away from the loaded one, every
  step logs its pairs, and a run that crashed after step 2's checkpoint and resumed logs the
  same records."""
  preferences.write_pairs(tmp_path / "pairs.jsonl", [
      {"prompt": "1+1", "chosen": "2", "rejected": "3"}] * 8)
  rm_config = reward_model_arithmetic.get_config("tiny")
  rm_config.pairs_jsonl = str(tmp_path / "pairs.jsonl")
  rm_config.steps = rm_config.eval_every = rm_config.checkpoint_every = 1
  rm_dir = str(tmp_path / "rm")
  rm_experiment.train(rm_config, rm_dir, progress=False)
  loaded, _, _ = checkpointing.latest_policy_params(rm_dir)

  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  with registry.registered("reward", "odd_length", _odd_length):
    grpo.train(_grpo_config(rm_dir, 3), full, progress=False)
    crashed_copy(full, part, 2)
    grpo.train(_grpo_config(rm_dir, 3), part, progress=False)

  records = lambda w: [r for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))
                       if r["kind"] == "train"]
  train = records(full)
  assert [r["step"] for r in train] == [1, 2, 3]
  assert all(r["reward_model/pairs"] == 4 for r in train)  # odd and even lengths in a group
  for r in train:
    assert r["reward_mean"] == pytest.approx(r["reward/reward_model_mean"])
    assert 0 <= r["reward_model/fresh_pair_accuracy"] <= 1
    assert r["reward_model/label_accuracy"] == 1.0 and np.isfinite(r["reward_model/loss"])
  strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                      for r in rs]
  assert strip(records(part)) == strip(train)

  state = checkpointing.plain_state(full, 3)
  head = np.asarray(state["reward_model"]["params"]["head"]["w"])
  assert np.abs(head - np.asarray(loaded["head"]["w"])).max() > 1e-4


@pytest.mark.parametrize("change, message", [
    (dict(rewards={"math_strict": 1.0}), "add {'reward_model'"),
    (dict(labels="votes"), "labels must be one of"),
    (dict(labels="majority", grader="short_reply"), "has no answer reader"),
    (dict(overlap=True), "set overlap=False"),
])
def test_bad_settings_are_refused_before_anything_loads(tmp_path, change, message):
  c = _grpo_config(str(tmp_path / "rm"), 1)
  c.grader = "math_strict"
  for key, value in change.items():
    if key == "labels":
      c.reward_model_beside.labels = value
    else:
      setattr(c, key, value)
  with pytest.raises(ValueError, match=message):
    beside.validate(c)
