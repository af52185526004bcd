"""Implicit process rewards per step (turn) and their combination with outcome advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.credit._common import _check_rows
from jaxrl_agents.objectives.credit.turns import broadcast_turn_values
from jaxrl_agents.objectives.losses._checks import check_bt, check_rank, check_same_shape


def _turn_sums(values: jax.Array, turn_id: jax.Array, mask: jax.Array, num_turns: int):
  """sum_t [turn_id_t == k] m_t v_t per row: f32[B, T] -> f32[B, K]."""
  # Out-of-range segment ids are dropped by segment_sum; masked tokens are sent there.
  ids = jnp.where(mask.astype(bool), turn_id, num_turns)
  return jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=num_turns))(values, ids)


def implicit_step_rewards(
  logp: jax.Array,
  ref_logp: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  num_turns: int,
  beta: float,
) -> jax.Array:
  """OPRL implicit process rewards: r_k = beta * sum_{t in turn k} (log pi_phi - log pi_ref).

  "Online Process Reward Leanring for Agentic Reinforcement Learning" trains an
  implicit PRM pi_phi with a trajectory-level DPO objective against the
  previous policy snapshot pi_ref = pi_theta_old; the reward of step (turn) k
  is r_phi(o_{1:k}, a_k) = beta log pi_phi(a_k | o_{1:k}) / pi_ref(a_k | o_{1:k}),
  i.e. the per-token log-ratio summed over the turn's action tokens. The step
  rewards of a trajectory therefore sum to its implicit (DPO) reward
  beta * sum_t m_t (logp_t - ref_logp_t) when every valid token lies in a turn.

  Args:
    logp: f32[B, T] token log-probabilities under the PRM pi_phi.
    ref_logp: f32[B, T] under the reference (old policy).
    turn_id: int[B, T]; tokens outside [0, num_turns) are ignored.
    mask: bool[B, T].
    num_turns: K (static).
    beta: DPO temperature.

  Returns:
    f32[B, K].
  """
  check_bt(logp=logp, ref_logp=ref_logp, turn_id=turn_id, mask=mask)
  return beta * _turn_sums(logp - ref_logp, turn_id, mask, num_turns)


def combine_outcome_and_step_advantages(
  outcome_adv: jax.Array,
  step_adv: jax.Array,
  weight: float,
  *,
  turn_id: jax.Array | None = None,
  mask: jax.Array | None = None,
) -> jax.Array:
  """OPRL's advantage fusion: A = A_outcome + w * A_step.

  "Online Process Reward Leanring for Agentic Reinforcement Learning" combines
  the episode-level advantage from outcome rewards (shared by every step of a
  trajectory) with step-level advantages from implicit step rewards. With
  w = 0 this is outcome-only training.

  Three layouts:
    * step_adv f32[B, K], no turn_id: per-turn result f32[B, K];
    * step_adv f32[B, T] (token level), no turn_id: per-token result f32[B, T];
    * step_adv f32[B, K] with turn_id int[B, T] and mask bool[B, T]: the step
      advantage is broadcast to the tokens of each turn, result f32[B, T]
      (valid tokens outside [0, K) get the outcome advantage only).
  `mask` (same shape as the result) zeroes invalid entries.

  Args:
    outcome_adv: f32[B].
    step_adv: f32[B, K] or f32[B, T].
    weight: w.
    turn_id: int[B, T] or None.
    mask: bool, shape of the result, or None.

  Returns:
    f32[B, K] or f32[B, T].
  """
  check_rank("outcome_adv", outcome_adv, 1)
  check_rank("step_adv", step_adv, 2)
  _check_rows("step_adv", step_adv, outcome_adv.shape[0])
  if turn_id is not None:
    if mask is None:
      raise ValueError("mask is required with turn_id")
    step_tok = broadcast_turn_values(step_adv, turn_id, mask)
    out = outcome_adv[:, None] + weight * step_tok
    return jnp.where(mask.astype(bool), out, 0.0)
  out = outcome_adv[:, None] + weight * step_adv
  if mask is None:
    return out
  check_same_shape([("step_adv", step_adv), ("mask", mask)])
  return jnp.where(mask.astype(bool), out, 0.0)
