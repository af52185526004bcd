"""Role-conditioned advantages for self-play (each side against its own running baseline)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.losses._checks import check_rank, check_same_shape


def role_conditioned_advantages(
  rewards: jax.Array,
  role: jax.Array,
  baseline: jax.Array,
  num_roles: int,
  decay: float,
  valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """SPIRAL's Role-conditioned Advantage Estimation (RAE) with an EMA baseline per role.

  "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via Multi-Agent
  Multi-Turn Reinforcement Learning" keeps one baseline b_{G,p} per game G and
  role p, an exponential moving average of that role's return, and uses
  A = R_p - b_{G,p}; a first-mover edge is then not credited to the policy.
  Encode (game, role) pairs as one index, e.g. role = game * 2 + player.
  Trajectories are processed in batch order, as in the reference
  implementation, with the baseline read before it is updated (unbiased):

    A_i = r_i - b_{role_i};   b_{role_i} <- decay * b_{role_i} + (1 - decay) * r_i.

  (The paper writes the update first; reading it first keeps A_i independent
  of r_i.) Rows that are not valid, or whose role is outside [0, R), get
  A = 0 and do not update the baseline.

  Args:
    rewards: f32[B] trajectory returns.
    role: int[B].
    baseline: f32[R] current baselines (zeros to start).
    num_roles: R (static).
    decay: EMA decay in [0, 1].
    valid: bool[B] or None.

  Returns:
    (advantages f32[B], new_baseline f32[R]).
  """
  check_rank("rewards", rewards, 1)
  check_rank("role", role, 1)
  check_same_shape([("rewards", rewards), ("role", role)])
  check_rank("baseline", baseline, 1)
  if baseline.shape[0] != num_roles:
    raise ValueError(f"baseline has shape {tuple(baseline.shape)} but num_roles is {num_roles}")
  ok = (role >= 0) & (role < num_roles)
  if valid is not None:
    check_same_shape([("rewards", rewards), ("valid", valid)])
    ok = ok & valid.astype(bool)
  idx = jnp.clip(role, 0, num_roles - 1)

  def step(b, x):
    r, i, v = x
    adv = jnp.where(v, r - b[i], 0.0)
    b = b.at[i].set(jnp.where(v, decay * b[i] + (1.0 - decay) * r, b[i]))
    return b, adv

  new_baseline, adv = jax.lax.scan(step, baseline.astype(rewards.dtype), (rewards, idx, ok))
  return adv, new_baseline


class RoleBaselineState(NamedTuple):
  """State of `role_baseline`: baseline f32[R] and number of updates per role int32[R]."""

  baseline: jax.Array
  count: jax.Array


class RoleBaseline(NamedTuple):
  """(init, update): init() -> state; update(rewards, role, state, valid=None) -> (adv, state)."""

  init: Callable[[], RoleBaselineState]
  update: Callable[..., tuple[jax.Array, RoleBaselineState]]


def role_baseline(num_roles: int, decay: float = 0.95) -> RoleBaseline:
  """Carried-state form of `role_conditioned_advantages` (SPIRAL's RAE), optax style.

  "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via Multi-Agent
  Multi-Turn Reinforcement Learning" uses decay 0.95.

  ```
  rae = role_baseline(num_roles=2)
  state = rae.init()
  adv, state = rae.update(rewards, role, state)   # jittable
  ```

  Args:
    num_roles: R.
    decay: EMA decay.

  Returns:
    RoleBaseline(init, update).
  """

  def init() -> RoleBaselineState:
    return RoleBaselineState(
      baseline=jnp.zeros((num_roles,), jnp.float32), count=jnp.zeros((num_roles,), jnp.int32)
    )

  def update(
    rewards: jax.Array,
    role: jax.Array,
    state: RoleBaselineState,
    valid: jax.Array | None = None,
  ) -> tuple[jax.Array, RoleBaselineState]:
    adv, baseline = role_conditioned_advantages(
      rewards, role, state.baseline, num_roles, decay, valid
    )
    ok = (role >= 0) & (role < num_roles)
    if valid is not None:
      ok = ok & valid.astype(bool)
    hits = jax.ops.segment_sum(ok.astype(jnp.int32), jnp.clip(role, 0, num_roles - 1), num_roles)
    return adv, RoleBaselineState(baseline=baseline, count=state.count + hits)

  return RoleBaseline(init=init, update=update)
