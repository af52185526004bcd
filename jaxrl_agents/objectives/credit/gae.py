"""GAE over multi-turn token streams: over the policy tokens only, over turns, and bi-level
(turn-level, then token-level inside each turn)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry, types
from jaxrl_agents.objectives import advantages as advantages_lib
from jaxrl_agents.objectives.credit._common import (
  _check_turns,
  _ends_of_turns,
  _policy_first,
  _turn_edges,
)
from jaxrl_agents.objectives.credit.information_gain import _last_valid_turn
from jaxrl_agents.objectives.credit.step_rewards import _turn_sums
from jaxrl_agents.objectives.credit.turns import broadcast_turn_values
from jaxrl_agents.objectives.losses._checks import check_bt


def _gae(rewards, values, dones, gamma, lam):
  return advantages_lib.generalized_advantage_estimation(rewards, values, dones, gamma=gamma,
                                                         lam=lam)


def rewards_at_turn_ends(turn_rewards: jax.Array, turn_id: jax.Array, mask: jax.Array,
                         turn_mask: jax.Array | None = None) -> jax.Array:
  """f32[B, T]: each turn's reward on its last policy token, 0 elsewhere (a single-turn
  stream: the outcome on the last token)."""
  ends = _ends_of_turns(turn_id, mask)
  return jnp.where(ends, broadcast_turn_values(turn_rewards, turn_id, mask, turn_mask), 0.0)


def policy_token_gae(
  token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE over a multi-turn stream's policy tokens, skipping everything else.

  The environment's tokens are not actions: the value after a turn's last token
  is the value at the next turn's first token (which has read the
  observation), the discount counts policy tokens only, and the episode ends
  at its last policy token. Rewards sit on policy tokens (a turn's reward on its
  last token). Computed by moving each row's policy tokens to the front (a
  stable permutation), running `generalized_advantage_estimation` there, and
  moving the results back.

  Args:
    token_rewards: f32[B, T] (0 off the policy tokens).
    values: f32[B, T] V before each token.
    mask: bool[B, T] policy tokens.
    gamma, lam: GAE's discount and lambda per policy token.

  Returns:
    (advantages f32[B, T], returns f32[B, T]), 0 off the policy tokens.
  """
  check_bt(token_rewards=token_rewards, values=values, mask=mask)
  return _gae_on_policy_tokens(token_rewards, values, mask, _episode_ends(mask),
                               gamma, lam)


def _episode_ends(mask: jax.Array) -> jax.Array:
  """bool[B, T]: each row's last policy token (the episode ends there)."""
  m = mask.astype(bool)
  t = m.shape[1]
  last = t - 1 - jnp.argmax(m[:, ::-1], axis=1)
  return m & (jnp.arange(t)[None, :] == last[:, None])


def _gae_on_policy_tokens(rewards, values, mask, dones, gamma, lam):
  """GAE over each row's policy tokens in order, everything else skipped: the policy tokens
  are moved to the front (a stable permutation), GAE runs there with `dones` (stream-aligned)
  ending its recursions, and the advantages move back. (advantages, returns), 0 elsewhere."""
  m = mask.astype(bool)
  order, inverse = _policy_first(m)
  take = lambda x: jnp.take_along_axis(x, order, axis=1)
  pm = take(m)
  adv, _ = _gae(jnp.where(pm, take(rewards), 0.0), jnp.where(pm, take(values), 0.0),
                take(dones) | ~pm, gamma, lam)
  adv = jnp.where(m, jnp.take_along_axis(adv, inverse, axis=1), 0.0)
  return adv, jnp.where(m, adv + values, 0.0)


def turn_values(values: jax.Array, turn_id: jax.Array, mask: jax.Array, num_turns: int, *,
                at: str = "first") -> jax.Array:
  """f32[B, K]: each turn's value, read at its "first" policy token (the state the turn
  starts from, before any of the reply) or its "last" (after all but one token of it);
  0 for a turn without tokens."""
  check_bt(values=values, turn_id=turn_id, mask=mask)
  if at not in ("first", "last"):
    raise ValueError(f"at must be 'first' or 'last', got {at!r}")
  edges = _turn_edges(turn_id, mask, at)
  return _turn_sums(jnp.where(edges, values, 0.0), turn_id, edges, num_turns)


def turn_level_gae(
  turn_rewards: jax.Array, values: jax.Array, turn_id: jax.Array, mask: jax.Array,
  turn_mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """GAE over turns, each token getting its turn's: the agentic MDP of a multi-turn episode.

  V_k is the value of the state turn k starts from, read at its first policy
  token (`turn_values`; the value there has seen the observation and none of
  the reply), r_k the turn's reward, and the episode ends after its last valid
  turn:

    delta_k = r_k + gamma V_{k+1} - V_k,   A_k = delta_k + gamma lam A_{k+1},

  every policy token of turn k gets A_k and the return target G_k = A_k + V_k.

  Args:
    turn_rewards: f32[B, K].
    values: f32[B, T] token values.
    turn_id: int[B, T].
    mask: bool[B, T] policy tokens.
    turn_mask: bool[B, K] turns that happened (a prefix).
    gamma, lam: per turn.

  Returns:
    (advantages f32[B, T], returns f32[B, T]), 0 off the policy tokens.
  """
  return _turn_gae(turn_rewards, values, turn_id, mask, turn_mask, gamma=gamma, lam=lam,
                   at="first")


def _turn_gae(turn_rewards, values, turn_id, mask, turn_mask, *, gamma, lam, at):
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  k = turn_rewards.shape[1]
  v = jnp.where(tm, turn_values(values, turn_id, mask, k, at=at), 0.0)
  last, _ = _last_valid_turn(tm)
  dones = (jnp.arange(k)[None, :] >= last[:, None]) | ~tm
  adv, _ = _gae(jnp.where(tm, turn_rewards, 0.0), v, dones, gamma, lam)
  adv = jnp.where(tm, adv, 0.0)
  return (broadcast_turn_values(adv, turn_id, mask, tm),
          broadcast_turn_values(adv + v, turn_id, mask, tm))


def bilevel_gae(
  turn_rewards: jax.Array, values: jax.Array, turn_id: jax.Array, mask: jax.Array,
  turn_mask: jax.Array, *, gamma: float, lam: float, turn_gamma: float, turn_lam: float
) -> tuple[jax.Array, jax.Array]:
  """Bi-level GAE (RAGEN's and VAGEN's multi-turn PPO): turn-level GAE across turns, then
  token-level GAE inside each turn started from the turn's.

  The turn level is GAE over turns (turn_gamma, turn_lam) as in
  `turn_level_gae`, but with V_k read at turn k's last token (RAGEN's choice:
  the value after the turn's action, so that the last token's advantage below
  is exactly the turn's). Inside turn k, token-level GAE (gamma, lam) runs over its
  policy tokens with no reward until the last, whose target is the turn's
  return G_k = A_k + V_k and after which nothing is bootstrapped: the last
  token's advantage is the turn's A_k, earlier tokens' are GAE towards it.

  Returns:
    (advantages f32[B, T], returns f32[B, T] = advantages + values), 0 off the
    policy tokens.
  """
  _, turn_returns_ = _turn_gae(turn_rewards, values, turn_id, mask, turn_mask,
                               gamma=turn_gamma, lam=turn_lam, at="last")
  ends = _ends_of_turns(turn_id, mask)
  # The turn's return is the last token's reward, with values[last] subtracted back by
  # GAE's delta: r_last = G_k gives delta_last = G_k - V_last = A_k.
  return _gae_on_policy_tokens(jnp.where(ends, turn_returns_, 0.0), values, mask, ends,
                               gamma, lam)


# PPO's credit by name (config.gae_level, registry kind "gae_level"): the trajectory, the
# f32[B, T] token rewards (each turn's reward on its last policy token, less any KL
# penalty: read at "token" only) and the critic's values -> (advantages, returns).


@registry.register("gae_level", "token")
def token_level(traj: types.Trajectory, token_rewards: jax.Array, values: jax.Array, *,
                gamma: float, lam: float, turn_gamma: float = 1.0, turn_lam: float = 0.95):
  """GAE over the policy tokens (the environment's tokens skipped)."""
  del turn_gamma, turn_lam
  return policy_token_gae(token_rewards, values, traj.policy_mask, gamma=gamma, lam=lam)


@registry.register("gae_level", "turn")
def turn_level(traj: types.Trajectory, token_rewards: jax.Array, values: jax.Array, *,
               gamma: float, lam: float, turn_gamma: float = 1.0, turn_lam: float = 0.95):
  """GAE over turns (a turn's value read at its last policy token), per turn to its tokens."""
  del token_rewards, gamma, lam
  return turn_level_gae(traj.turn_rewards, values, traj.turn_id, traj.policy_mask,
                        traj.turn_mask, gamma=turn_gamma, lam=turn_lam)


@registry.register("gae_level", "bilevel")
def bilevel(traj: types.Trajectory, token_rewards: jax.Array, values: jax.Array, *,
            gamma: float, lam: float, turn_gamma: float = 1.0, turn_lam: float = 0.95):
  """Turn-level GAE across turns, token-level GAE within each turn (ArCHer-style)."""
  del token_rewards
  return bilevel_gae(traj.turn_rewards, values, traj.turn_id, traj.policy_mask,
                     traj.turn_mask, gamma=gamma, lam=lam, turn_gamma=turn_gamma,
                     turn_lam=turn_lam)
