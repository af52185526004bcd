"""Turn-level credit in GRPO on real episodes: each credit rule against a loop over the turns,
potential shaping's telescoping, and the config's refusals."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo
from experiments.configs import grpo_arithmetic, grpo_calculator, grpo_guess_number
from jaxrl_agents import envs
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.rollout import env_loop, multiturn
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.train import metrics as metrics_lib

P, G, K = 2, 4, 3


def _guessing(high: int, targets: list[int]):
  """(model, env, the args of `multiturn.rollout` up to its keywords): guess-the-number
  episodes of the tiny model (numbers 1 to `high`), replies of two tokens."""
  model = zoo.load("tiny")
  tok = model.tokenizer
  env = envs.make("guess_number", tok, low=1, high=high)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=2, temperature=1.0,
                                        stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                        pad_id=tok.pad_token_id)
  return model, env, (model.params, model.cfg, env, multiturn.turn_template(tok),
                      jnp.asarray(targets, jnp.int32), jax.random.key(5), sampling)


@pytest.fixture(scope="module")
def played():
  """Guess-the-number episodes (numbers 1-4) with several turns each."""
  model, env, args = _guessing(4, [2, 3])
  return model.tokenizer, env, multiturn.rollout(*args, group_size=G, num_turns=K)


def _settings(name, gamma=1.0, step_weight=1.0):
  config = grpo_guess_number.get_config("tiny")
  config.prompts_per_step, config.group_size = P, G
  config.turn_credit.name, config.turn_credit.gamma = name, gamma
  config.turn_credit.step_weight = step_weight
  return grpo.settings_from_config(config)


def _per_token(traj, per_turn: np.ndarray) -> np.ndarray:
  """Each policy token gets its turn's value (a loop, not the library's gather)."""
  turn_id, policy = np.asarray(traj.turn_id), np.asarray(traj.policy_mask)
  out = np.zeros(turn_id.shape, np.float32)
  for b, t in zip(*np.nonzero(policy), strict=True):
    out[b, t] = per_turn[b, turn_id[b, t]]
  return out


def _returns(rewards, mask, gamma):
  out = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    later = 0.0
    for k in reversed(range(rewards.shape[1])):
      later = (rewards[b, k] if mask[b, k] else 0.0) + gamma * later
      out[b, k] = later if mask[b, k] else 0.0
  return out


def test_the_played_episodes_have_turns_to_credit(played):
  _, _, eps = played
  live = np.asarray(eps.traj.turn_mask)
  assert live.sum() > live.shape[0]  # some episode went past its first turn
  keys = np.asarray(eps.turn_keys)
  assert (keys[:, 0] == 1 * 5 + 4).all() and (keys[~live] == -1).all()


def test_episode_credit_is_the_group_advantage_unchanged(played):
  tok, _, eps = played
  r = env_loop.to_rollout(tok, eps, ["x"] * P * G, G)
  _, adv, _ = grpo.group_advantages(_settings("episode"), r)
  assert adv.shape == (P * G,)


def _turn_credit_by_hand(traj, rewards: np.ndarray, gamma: float) -> np.ndarray:
  """Per token: the discounted return-to-go of turn rewards standardized over each group's
  valid turns."""
  mask = np.asarray(traj.turn_mask)
  normalized = np.zeros_like(rewards)
  for p in range(P):
    rows = slice(p * G, p * G + G)
    valid = rewards[rows][mask[rows]]
    normalized[rows] = np.where(mask[rows], (rewards[rows] - valid.mean()) /
                                (valid.std() + 1e-6), 0.0)
  return _per_token(traj, _returns(normalized, mask, gamma))


def test_turn_credit_is_returns_to_go_of_group_standardized_turn_rewards(played):
  tok, _, eps = played
  r = env_loop.to_rollout(tok, eps, ["x"] * P * G, G)
  traj, adv, _ = grpo.group_advantages(_settings("turn", gamma=0.5), r)
  want = _turn_credit_by_hand(traj, np.asarray(traj.turn_rewards), 0.5)
  np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)
  assert np.abs(want).sum() > 0


def test_gigpo_adds_the_step_group_advantage_of_turns_from_one_state(played):
  tok, _, eps = played
  r = env_loop.to_rollout(tok, eps, ["x"] * P * G, G)
  _, episode_adv, _ = grpo.group_advantages(_settings("episode"), r)
  traj, adv, _ = grpo.group_advantages(_settings("gigpo", gamma=0.9, step_weight=0.5), r)
  mask, keys = np.asarray(traj.turn_mask), np.asarray(eps.turn_keys)
  returns = _returns(np.asarray(traj.turn_rewards), mask, 0.9)
  step = np.zeros_like(returns)
  for b in range(P * G):
    group = range(b // G * G, b // G * G + G)
    for k in range(K):
      if not mask[b, k]:
        continue
      peers = [returns[i, j] for i in group for j in range(K)
               if mask[i, j] and keys[i, j] == keys[b, k]]
      step[b, k] = (returns[b, k] - np.mean(peers)) / (np.std(peers) + 1e-6)
  policy = np.asarray(traj.policy_mask)
  want = np.where(policy, np.asarray(episode_adv)[:, None] + 0.5 * _per_token(traj, step), 0.0)
  np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_potential_shaping_telescopes_and_leaves_episode_advantages_alone(played, gamma):
  tok, env, eps = played
  plain = env_loop.to_rollout(tok, eps, ["x"] * P * G, G)
  shaped = env_loop.to_rollout(tok, eps, ["x"] * P * G, G, shaping_gamma=gamma)
  # The episode rewards (GRPO's group advantage) are the returns, shaped or not.
  np.testing.assert_array_equal(shaped.rewards, plain.rewards)
  np.testing.assert_array_equal(shaped.components["return"], plain.rewards)
  _, a_plain, _ = grpo.group_advantages(_settings("episode"), plain)
  _, a_shaped, _ = grpo.group_advantages(_settings("episode"), shaped)
  np.testing.assert_array_equal(np.asarray(a_shaped), np.asarray(a_plain))
  # Per turn: r_k + gamma phi(s_{k+1}) - phi(s_k), by hand from the recorded potentials.
  phi, live = np.asarray(eps.turn_potentials), np.asarray(eps.traj.turn_mask)
  after = np.concatenate([phi[:, 1:], np.zeros((P * G, 1))], axis=1)
  want = np.where(live, np.asarray(eps.traj.turn_rewards) + gamma * after - phi, 0.0)
  np.testing.assert_allclose(np.asarray(shaped.traj.turn_rewards), want, atol=1e-6)
  # The discounted shaped return from the first turn is the discounted return - phi(s_0):
  # phi(s_0) = -1 (two bits missing of two), the terminal state's is 0.
  rewards = np.asarray(eps.traj.turn_rewards)
  discount = gamma ** np.arange(K)
  np.testing.assert_allclose((want * discount).sum(1), (rewards * discount).sum(1) + 1.0,
                             rtol=1e-5)
  if gamma == 1.0:
    np.testing.assert_allclose(shaped.components["shaped_return"], plain.rewards + 1.0,
                               rtol=1e-6)


@pytest.fixture(scope="module")
def scored():
  """Episodes of `played`'s shape that also score the gold answer at every turn boundary."""
  model, env, args = _guessing(12, [2, 11])
  eps = multiturn.rollout(*args, group_size=G, num_turns=K, score_answers=True)
  by_turn = multiturn.rollout_by_turn(*args, group_size=G, num_turns=K, score_answers=True)
  return model, env, eps, by_turn


def test_answer_logprobs_equal_a_forward_over_the_history_and_the_answer(scored):
  """Before turn k the policy's mean log-prob per token of the gold answer equals a fresh
  forward pass (no cache) over the history up to reply k followed by the answer."""
  model, env, eps, by_turn = scored
  traj = eps.traj
  tokens, valid = np.asarray(traj.tokens), np.asarray(traj.valid)
  answer_logp = np.asarray(eps.answer_logp)
  assert answer_logp.shape == (P * G, K + 1)
  mask = np.asarray(traj.turn_mask)
  # Every history + answer right-padded to one width: under causal attention the padding
  # after them changes none of their logits, and one program serves every row and turn.
  width = tokens.shape[1] + 2
  forward = jax.jit(lambda ids: jax.nn.log_softmax(transformer.apply(
      model.params, ids, jnp.arange(width)[None], model.cfg)[0][0].astype(jnp.float32), -1))
  for b in range(P * G):
    answer = env.answer(jnp.asarray([2, 11])[b // G])
    gold = np.asarray(answer.ids)[np.asarray(answer.mask)].tolist()
    assert len(gold) == (1 if b < G else 2)
    for k in range(int(mask[b].sum())):  # before each turn the row played
      end = traj.reply_spans[k][0] if k < K else tokens.shape[1]
      history = tokens[b, :end][valid[b, :end]].tolist()
      ids = history + gold
      logp = np.asarray(forward(jnp.asarray([ids + [0] * (width - len(ids))])))
      want = float(np.mean([logp[len(history) - 1 + i, t] for i, t in enumerate(gold)]))
      np.testing.assert_allclose(answer_logp[b, k], want, atol=1e-4, err_msg=f"row {b} k {k}")
  # Driving the turns from Python scores the same answers, up to each row's last turn (the
  # columns after it are undefined: nothing was asked there).
  defined = np.concatenate([mask, np.zeros((P * G, 1), bool)], 1)
  np.testing.assert_allclose(np.asarray(by_turn.answer_logp)[defined], answer_logp[defined],
                             atol=1e-5)


def test_igpo_credit_is_turn_credit_over_information_gains(scored):
  """IGPO: each turn but an episode's last is rewarded by the rise of exp(answer_logp)
  across it, the last by the episode's return; then `turn` credit over those rewards."""
  model, _, eps, _ = scored
  tok = model.tokenizer
  r = env_loop.to_rollout(tok, eps, ["x"] * P * G, G, information_gain=True)
  p, mask = np.exp(np.asarray(eps.answer_logp)), np.asarray(eps.traj.turn_mask)
  returns = np.asarray(eps.traj.rewards)
  want, before_last = np.zeros((P * G, K), np.float32), np.zeros((P * G, K), bool)
  for b in range(P * G):
    turns = np.flatnonzero(mask[b])
    for k in turns:
      want[b, k] = returns[b] if k == turns[-1] else p[b, k + 1] - p[b, k]
      before_last[b, k] = k != turns[-1]
  np.testing.assert_allclose(np.asarray(r.traj.turn_rewards), want, atol=1e-6)
  assert before_last.any() and np.abs(want[before_last]).min() > 0  # the gains are not 0
  # Logged: the gains the update used (every turn's but the last).
  np.testing.assert_allclose(r.components["information_gain"],
                             np.where(before_last, want, 0.0).sum(1), atol=1e-6)
  np.testing.assert_array_equal(r.rewards, returns)  # the group's rewards stay the returns
  traj, igpo, _ = grpo.group_advantages(_settings("igpo", gamma=0.5), r)
  np.testing.assert_allclose(np.asarray(igpo), _turn_credit_by_hand(traj, want, 0.5),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tiny_igpo_run_logs_the_information_gain(tmp_path):
  config = grpo_guess_number.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 2, 2, 2
  config.turn_credit.name = "igpo"
  grpo.train(config, str(tmp_path), progress=False)
  train = [r for r in metrics_lib.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
           if r["kind"] == "train"]
  assert len(train) == 2
  for r in train:
    assert np.isfinite(r["loss"]) and "reward/information_gain_mean" in r, r


@pytest.mark.slow
def test_tiny_gigpo_run_with_shaping_logs_both_returns(tmp_path):
  config = grpo_guess_number.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 2, 2, 2
  config.turn_credit.name, config.turn_credit.gamma = "gigpo", 0.9
  config.potential_shaping = True
  grpo.train(config, str(tmp_path), progress=False)
  train = [r for r in metrics_lib.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
           if r["kind"] == "train"]
  assert len(train) == 2
  for r in train:
    assert np.isfinite(r["loss"]), r
    assert "reward/shaped_return_mean" in r and "reward/return_mean" in r, r


def test_turn_credit_is_refused_where_it_cannot_apply():
  single = grpo_arithmetic.get_config("tiny")
  single.turn_credit = grpo_guess_number.get_config("tiny").turn_credit
  single.turn_credit.name = "turn"
  with pytest.raises(ValueError, match="single-turn"):
    grpo.validate(single)
  config = grpo_guess_number.get_config("tiny")
  config.turn_credit.name = "gae"
  with pytest.raises(ValueError, match="unknown turn_credit"):
    grpo.validate(config)
  config.turn_credit.name, config.turn_credit.gamma = "turn", 0.0
  with pytest.raises(ValueError, match="gamma"):
    grpo.validate(config)
  config.turn_credit.gamma, config.advantage = 1.0, "rloo"
  with pytest.raises(ValueError, match="advantage='grpo'"):
    grpo.validate(config)
  tiny = zoo.load("tiny").tokenizer

  def check(config, env_name):  # what env_loop.make checks of GRPO's credit
    env_loop._check_credit(grpo.episode_credit(config), envs.make(env_name, tiny), env_name)

  tool = grpo_calculator.get_config("tiny")
  tool.turn_credit.name = "gigpo"
  with pytest.raises(ValueError, match="turn_credit 'gigpo' .* no state_key"):
    check(tool, "calculator")
  tool.turn_credit.name, tool.potential_shaping = "episode", True
  with pytest.raises(ValueError, match="potential"):
    check(tool, "calculator")
  tool.potential_shaping, tool.turn_credit.name = False, "igpo"
  with pytest.raises(ValueError, match="no answer"):
    check(tool, "frozen_lake")
  game = grpo_guess_number.get_config("tiny")
  game.turn_credit.name, game.potential_shaping = "igpo", True
  with pytest.raises(ValueError, match="use one"):
    check(game, "guess_number")
  # The shaping's discount is the credit's: GRPO's turn_credit.gamma, PPO's turn_gamma.
  from experiments import ppo
  from experiments.configs import ppo_frozen_lake

  assert grpo.episode_credit(grpo_guess_number.get_config("tiny")).shaping_gamma is None
  shaped = grpo_guess_number.get_config("tiny")
  shaped.potential_shaping, shaped.turn_credit.gamma = True, 0.9
  assert grpo.episode_credit(shaped).shaping_gamma == 0.9
  ppo_config = ppo_frozen_lake.get_config("tiny")
  ppo_config.turn_gamma, ppo_config.potential_shaping = 0.8, True
  assert ppo.episode_credit(ppo_config).shaping_gamma == 0.8
  ppo_config.gae_level, ppo_config.gamma = "token", 0.99
  with pytest.raises(ValueError, match="use gamma=1"):
    ppo.episode_credit(ppo_config)


@pytest.mark.slow
def test_tiny_ppo_on_frozen_lake_trains_with_bilevel_gae(tmp_path):
  from experiments import ppo
  from experiments.configs import ppo_frozen_lake

  config = ppo_frozen_lake.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 2, 2, 2
  ppo.train(config, str(tmp_path), progress=False)
  train = [r for r in metrics_lib.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
           if r["kind"] == "train"]
  assert len(train) == 2
  for r in train:
    assert np.isfinite(r["loss"]) and np.isfinite(r["value_loss"]), r
    assert "reward/shaped_return_mean" in r and "episode_turns" in r, r


def test_ppo_credit_is_refused_where_it_cannot_apply():
  from experiments import ppo
  from experiments.configs import ppo_arithmetic, ppo_frozen_lake

  config = ppo_frozen_lake.get_config("tiny")
  ppo.validate(config)
  config.gae_level = "episode"
  with pytest.raises(ValueError, match="unknown gae_level"):
    ppo.validate(config)
  config.gae_level, config.kl_coef = "turn", 0.1
  with pytest.raises(ValueError, match="KL penalty is per token"):
    ppo.validate(config)
  config.kl_coef, config.turn_credit.name = 0.0, "gigpo"
  with pytest.raises(ValueError, match="is GRPO's"):
    ppo.validate(config)
  single = ppo_arithmetic.get_config("tiny")
  single.gae_level = "bilevel"
  with pytest.raises(ValueError, match="single-turn"):
    ppo.validate(single)
