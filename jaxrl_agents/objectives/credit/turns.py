"""Per-turn rewards to advantages: normalized turn rewards, their broadcast to tokens,
returns-to-go, and GiGPO's step groups (turns taken from the same environment state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives import advantages as advantages_lib
from jaxrl_agents.objectives.credit._common import (
  _SCOPES,
  _check_rows,
  _check_turns,
  _masked_standardize,
)
from jaxrl_agents.objectives.losses._checks import check_bt, check_rank, check_same_shape


def normalize_turn_rewards(
  turn_rewards: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  scope: str = "batch",
  group_size: int | None = None,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """Standardizes turn rewards over the valid turns of a scope.

    A_{b,k} = (r_{b,k} - mean_S r) / (std_S r + eps),   S = valid turns in the scope of b,

  with the population standard deviation. Scopes: "batch" (all valid turns of
  the batch), "group" (the valid turns of the G rollouts of the same prompt,
  GRPO-style, rows prompt-major B = P * G), "none" (no normalization). Invalid
  turns get 0. `std_normalize=False` only centres (Dr. GRPO style).

  Args:
    turn_rewards: f32[B, K].
    turn_mask: bool[B, K], which turns exist; None means all.
    scope: "batch", "group" or "none" (static).
    group_size: G, required for scope="group"; B must be a multiple of G.
    std_normalize: divide by the standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  if scope not in _SCOPES:
    raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")
  if scope == "none":
    return jnp.where(tm, turn_rewards, 0.0)
  if scope == "batch":
    return _masked_standardize(turn_rewards, tm, None, std_normalize, eps)
  b, k = turn_rewards.shape
  if group_size is None or group_size < 1 or b % group_size:
    raise ValueError(
      f"group_size must be a positive divisor of the batch size {b} for scope='group', "
      f"got {group_size!r}"
    )
  grouped = turn_rewards.reshape(b // group_size, group_size * k)
  gmask = tm.reshape(b // group_size, group_size * k)
  out = _masked_standardize(grouped, gmask, -1, std_normalize, eps)
  return out.reshape(b, k)


def broadcast_turn_values(
  turn_values: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  turn_mask: jax.Array | None = None,
) -> jax.Array:
  """Gives each token the value of its turn: out_{b,t} = v_{b, turn_id_{b,t}}.

  Tokens with mask False, turn_id outside [0, K), or a turn that is not in
  `turn_mask` get 0.

  Args:
    turn_values: f32[B, K].
    turn_id: int[B, T].
    mask: bool[B, T].
    turn_mask: bool[B, K] or None (all turns exist).

  Returns:
    f32[B, T].
  """
  tm = _check_turns(turn_values, turn_mask, "turn_values")
  check_bt(turn_id=turn_id, mask=mask)
  _check_rows("turn_id", turn_id, turn_values.shape[0])
  k = turn_values.shape[1]
  in_range = (turn_id >= 0) & (turn_id < k)
  idx = jnp.clip(turn_id, 0, k - 1)
  values = jnp.take_along_axis(turn_values, idx, axis=1)
  exists = jnp.take_along_axis(tm, idx, axis=1)
  return jnp.where(mask.astype(bool) & in_range & exists, values, 0.0)


def turn_rewards_to_token_advantages(
  turn_rewards: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  scope: str = "batch",
  group_size: int | None = None,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """Turn-level rewards to token advantages: normalize within a scope, then broadcast.

  "RLVMR: Reinforcement Learning with Verifiable Meta-Reasoning Rewards for
  Robust Long-Horizon Agents" rewards individual (tagged) steps and optimizes
  them with a critic-free, group-normalized policy gradient. Here

    A_{b,k} = (r_{b,k} - mean_S r) / (std_S r + eps),    A_{b,t} = A_{b, turn_id_{b,t}},

  where S is the set of valid turns in the scope ("batch", "group" of the G
  rollouts of one prompt, or "none"; see `normalize_turn_rewards`). Tokens
  with mask False or outside any valid turn get 0.

  Args:
    turn_rewards: f32[B, K].
    turn_id: int[B, T].
    mask: bool[B, T].
    turn_mask: bool[B, K], which turns exist; None means all K.
    scope: "batch", "group" or "none" (static).
    group_size: G for scope="group".
    std_normalize: divide by the scope's standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, T] token advantages.
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  adv = normalize_turn_rewards(
    turn_rewards, tm, scope=scope, group_size=group_size, std_normalize=std_normalize, eps=eps
  )
  return broadcast_turn_values(adv, turn_id, mask, tm)


def turn_returns(
  turn_rewards: jax.Array, turn_mask: jax.Array | None = None, *, gamma: float = 1.0
) -> jax.Array:
  """Discounted return-to-go of each turn: G_k = sum_{j >= k, j valid} gamma^(j - k) r_j.

  Invalid turns contribute no reward and get 0 themselves (the discount still
  counts turn indices, so with a prefix mask this is the textbook return).

  Args:
    turn_rewards: f32[B, K].
    turn_mask: bool[B, K] or None (all turns exist).
    gamma: discount per turn.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  r = jnp.where(tm, turn_rewards, 0.0)

  def back(later, r_k):
    g = r_k + gamma * later
    return g, g

  _, returns = jax.lax.scan(back, jnp.zeros(r.shape[:1], r.dtype), r.T, reverse=True)
  return jnp.where(tm, returns.T, 0.0)


def _check_group_size(batch: int, group_size: int) -> None:
  if group_size < 1 or batch % group_size:
    raise ValueError(f"group_size must be a positive divisor of the batch size {batch}, "
                     f"got {group_size!r}")


def step_group_advantages(
  returns: jax.Array,
  state_keys: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  group_size: int,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """GiGPO's step-level advantages: turns from the same state are compared with each other.

  "Group-in-Group Policy Optimization for LLM Agent Training" (GiGPO) finds,
  among the G episodes of one task, the turns taken from the same environment
  state (an anchor state) and forms a step group of them; a turn's step
  advantage is its return relative to its step group's:

    A_{b,k} = (R_{b,k} - mean_S R) / (std_S R + eps),
    S = {(b', k') in the group of b : key_{b',k'} = key_{b,k}, turn k' of b' valid},

  with the population standard deviation (`std_normalize=False` only centres).
  A turn alone in its step group, an invalid turn and a turn with a negative
  key (no state identity) get 0. The paper adds these to the episode-level
  GRPO advantage with a weight (`combine_outcome_and_step_advantages`).

  Args:
    returns: f32[B, K], e.g. `turn_returns` (discounted, the paper's choice).
    state_keys: int32[B, K] the state each turn was taken from (equal keys are
      the same state; compared within a group only).
    turn_mask: bool[B, K] or None.
    group_size: G; B must be a multiple of it (rows prompt-major).
    std_normalize: divide by the step group's standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(returns, turn_mask, "returns")
  check_rank("state_keys", state_keys, 2)
  check_same_shape([("returns", returns), ("state_keys", state_keys)])
  b, k = returns.shape
  _check_group_size(b, group_size)
  n = group_size * k
  r = returns.reshape(-1, n)
  keys = state_keys.reshape(-1, n)
  ok = (tm & (state_keys >= 0)).reshape(-1, n)
  same = (keys[:, :, None] == keys[:, None, :]) & ok[:, :, None] & ok[:, None, :]
  w = same.astype(r.dtype)
  count = jnp.maximum(w.sum(-1), 1.0)
  mean = (w * r[:, None, :]).sum(-1) / count
  # A step group whose returns all tie: exactly 0 (the float32 rounding of its mean over
  # std + eps is not; see advantages.no_spread).
  tied = advantages_lib.no_spread(jnp.broadcast_to(r[:, None, :], same.shape), -1,
                                  same)[..., 0]
  centred = jnp.where(ok & ~tied, r - mean, 0.0)
  if std_normalize:
    var = (w * (r[:, None, :] - mean[:, :, None]) ** 2).sum(-1) / count
    scale = jnp.sqrt(var) + eps
    centred = centred / jnp.where(scale > 0, scale, 1.0)  # a lone turn: 0 / 0 -> 0
  return centred.reshape(b, k)
