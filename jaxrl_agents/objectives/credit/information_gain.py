"""IGPO's information-gain turn rewards: how much each turn raised the gold answer's probability."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.credit._common import _check_rows
from jaxrl_agents.objectives.losses._checks import check_rank


def information_gain_rewards(answer_logp: jax.Array, turn_mask: jax.Array) -> jax.Array:
  """IGPO turn rewards: the gain in the policy's probability of the ground-truth answer.

  "Information Gain-based Policy Optimization: A Simple and Effective Approach
  for Multi-Turn LLM Agents" scores the gold answer a = (a_1..a_L) after each
  turn with the policy itself,

    p_k = pi_theta(a | q, o_{<=k}) = exp( (1/L) sum_j log pi_theta(a_j | q, o_{<=k}, a_{<j}) ),

  and defines the reward of turn k as the difference of probabilities (not of
  log-probabilities): IG_k = p_k - p_{k-1}. So `answer_logp[:, k]` must be the
  length-normalized (per-token mean) log-probability of the answer after k
  turns, index 0 being the prompt alone; the rewards lie in [-1, 1] and
  telescope: sum_{k valid} IG_k = p_n - p_0 for a prefix mask of length n.
  A turn that leaves the answer probability unchanged gets 0.

  Args:
    answer_logp: f32[B, K + 1].
    turn_mask: bool[B, K]; invalid turns get 0.

  Returns:
    f32[B, K].
  """
  check_rank("answer_logp", answer_logp, 2)
  check_rank("turn_mask", turn_mask, 2)
  b, k = turn_mask.shape
  if answer_logp.shape != (b, k + 1):
    raise ValueError(
      f"answer_logp must have shape {(b, k + 1)} (one more than turn_mask {(b, k)}), "
      f"got {tuple(answer_logp.shape)}"
    )
  p = jnp.exp(answer_logp)
  return jnp.where(turn_mask.astype(bool), p[:, 1:] - p[:, :-1], 0.0)


def _last_valid_turn(turn_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Index of the last True per row (0 if none) and whether the row has any."""
  k = turn_mask.shape[1]
  last = k - 1 - jnp.argmax(turn_mask[:, ::-1], axis=1)
  return last, turn_mask.any(axis=1)


def igpo_turn_rewards(
  answer_logp: jax.Array,
  turn_mask: jax.Array,
  outcome_rewards: jax.Array,
  *,
  replace_last: bool = True,
) -> jax.Array:
  """IGPO's dense reward trajectory: information gain per turn, outcome on the last turn.

  "Information Gain-based Policy Optimization: A Simple and Effective Approach
  for Multi-Turn LLM Agents": r_k = IG_k for the turns before the answer and
  r_K = the outcome reward (e.g. F1 of the answer) on the last turn. IGPO then
  standardizes all turn rewards of a group jointly (`normalize_turn_rewards`
  with scope="group") and uses discounted turn returns as advantages.

  Args:
    answer_logp: f32[B, K + 1], see `information_gain_rewards`.
    turn_mask: bool[B, K].
    outcome_rewards: f32[B].
    replace_last: True (the paper) puts only the outcome on the last valid
      turn; False adds it to that turn's information gain.

  Returns:
    f32[B, K]; rows with no valid turn are 0.
  """
  ig = information_gain_rewards(answer_logp, turn_mask)
  check_rank("outcome_rewards", outcome_rewards, 1)
  _check_rows("outcome_rewards", outcome_rewards, ig.shape[0])
  tm = turn_mask.astype(bool)
  last, has_any = _last_valid_turn(tm)
  is_last = (jnp.arange(ig.shape[1])[None, :] == last[:, None]) & has_any[:, None]
  base = jnp.where(is_last, 0.0, ig) if replace_last else ig
  return base + jnp.where(is_last, outcome_rewards[:, None], 0.0)
