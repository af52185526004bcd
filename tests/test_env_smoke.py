"""Every environment's `:tiny` smoke config trains with a gradient: its rewards vary on the tiny
random model and one update moves the weights (else a smoke or resume test on it could not
tell a working update from a broken one)."""

import importlib
import os

import jax
import numpy as np
import pytest

from experiments import grpo
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import env_loop
from jaxrl_agents.train import checkpointing
from jaxrl_agents.train import metrics as metrics_lib


def assert_the_update_had_a_gradient(workdir) -> None:
  """Some step's rewards varied within a group and had a gradient, the reply reward varied,
  and the newest checkpoint's weights all differ from the tiny model's."""
  train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
           if r["kind"] == "train"]
  assert min(r["zero_variance_groups"] for r in train) < 1.0
  assert max(r["grad_norm"] for r in train) > 0.0
  assert max(r["reward/reply/length_penalty_std"] for r in train) > 0.0
  params, _, _ = checkpointing.latest_policy_params(str(workdir))
  moved = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
           for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(zoo.load("tiny").params),
                           strict=True)]
  assert min(moved) > 0.0, "some weights of the policy did not move"


# grpo_calculator's and grpo_frozen_lake's tiny runs check the same in their own tests
# (tests/test_host_loop.py, tests/test_frozen_lake.py).
@pytest.mark.slow
@pytest.mark.parametrize("module", ["grpo_text_to_sql", "grpo_search_qa", "grpo_sokoban",
                                    "grpo_tic_tac_toe"])
def test_one_step_of_every_environments_tiny_config_moves_the_weights(tmp_path, module):
  config = importlib.import_module(f"experiments.configs.{module}").get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every, config.sample_every = 1, 0, 1, 0
  grpo.train(config, str(tmp_path), progress=False)
  assert_the_update_had_a_gradient(tmp_path)


class _Tokenizer:
  def decode(self, ids, skip_special_tokens=False):
    del skip_special_tokens
    return "".join(chr(ord("a") + i) for i in ids)


def test_reply_rewards_score_the_replies_alone_and_add_to_the_return():
  """Only the policy's tokens are scored (the environment's text is not the agent's), and the
  score adds to the return; the return and the success flag are kept as they were."""
  import types as pytypes

  from jaxrl_agents import types

  # Two episodes, prompt width 1: [prompt | reply | env | reply].
  tokens = np.array([[0, 1, 1, 2, 2, 2, 1], [0, 1, 2, 2, 2, 2, 1]])
  valid = np.ones_like(tokens, bool)
  policy = np.array([[0, 1, 1, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 1]], bool)
  traj = types.Trajectory(
      tokens=tokens, valid=valid, policy_mask=policy, turn_id=np.where(policy, 0, -1),
      sampling_logprobs=np.zeros(tokens.shape, np.float32),
      turn_rewards=np.array([[1.0, 0.0], [0.0, 0.0]], np.float32),
      turn_mask=np.ones((2, 2), bool), prompt_width=1)
  eps = pytypes.SimpleNamespace(traj=traj, info={"success": np.array([1.0, 0.0])},
                                turn_keys=np.zeros((2, 2)), roles=None)
  config = {"env_reply_rewards": {"length_penalty": {"budget": 1, "coef": 1.0}}}
  reply = env_loop.reply_rewards(_Config(config))
  r = env_loop.to_rollout(_Tokenizer(), eps, ["a", "b"], reply_reward=reply)
  # Replies "bbb" (3 characters) and "bb" (2): penalties -(3-1)/1 and -(2-1)/1.
  np.testing.assert_allclose(r.components["reply/length_penalty"], [-2.0, -1.0])
  np.testing.assert_allclose(r.rewards, [1.0 - 2.0, 0.0 - 1.0])
  np.testing.assert_allclose(r.components["return"], [1.0, 0.0])
  np.testing.assert_allclose(r.correct, [1.0, 0.0])


class _Config(dict):
  def get(self, key, default=None):
    return super().get(key, default)


@pytest.mark.parametrize("spec, message", [
    ({"no_such_reward": 1.0}, "no_such_reward"),
    ({"length_penalty": {"budget": 4, "bugdet": 2}}, "bugdet"),
    ({"reward_model": {"workdir": "/nowhere"}}, "score with a model"),
])
def test_bad_reply_rewards_are_named_before_anything_runs(tmp_path, spec, message):
  import ml_collections

  from experiments.configs import grpo_calculator

  config = grpo_calculator.get_config("tiny")
  config.env_reply_rewards = ml_collections.ConfigDict(spec)
  with pytest.raises((KeyError, ValueError), match=message):
    grpo.validate(config)


def test_reply_rewards_outside_an_environment_run_are_refused():
  import ml_collections

  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  config.env_reply_rewards = ml_collections.ConfigDict({"length_penalty": 1.0})
  with pytest.raises(ValueError, match="single-turn run's rewards are config.rewards"):
    grpo.validate(config)
