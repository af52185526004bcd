"""How the advantage of a multi-turn episode reaches its tokens: the configs' named
choices (config.turn_credit.name, registry kind "turn_credit").

Each entry takes the episodes' f32[B] advantages (a group estimator over
returns), the trajectory and its turns' environment-state keys, and returns the
token advantages: f32[B] as they are ("episode") or f32[B, T]. Options
(keyword-only): group_size, gamma (per turn), step_weight (GiGPO).
"""

from __future__ import annotations

import jax

from jaxrl_agents import registry, types
from jaxrl_agents.objectives.credit.step_rewards import combine_outcome_and_step_advantages
from jaxrl_agents.objectives.credit.turns import (
  broadcast_turn_values,
  normalize_turn_rewards,
  step_group_advantages,
  turn_returns,
)


@registry.register("turn_credit", "episode")
def episode(episode_adv: jax.Array, traj: types.Trajectory, turn_keys=None, *,
            group_size: int, gamma: float = 1.0, step_weight: float = 1.0) -> jax.Array:
  """Every token of an episode gets its episode's advantage."""
  del traj, turn_keys, group_size, gamma, step_weight
  return episode_adv


@registry.register("turn_credit", "turn")
def turn(episode_adv: jax.Array, traj: types.Trajectory, turn_keys=None, *,
         group_size: int, gamma: float = 1.0, step_weight: float = 1.0) -> jax.Array:
  """Each turn's return-to-go of the turn rewards standardized over its group (dense IGPO)."""
  del episode_adv, turn_keys, step_weight
  tm = traj.turn_mask
  normalized = normalize_turn_rewards(traj.turn_rewards, tm, scope="group",
                                      group_size=group_size)
  per_turn = turn_returns(normalized, tm, gamma=gamma)
  return broadcast_turn_values(per_turn, traj.turn_id, traj.policy_mask, tm)


@registry.register("turn_credit", "igpo")
def igpo(episode_adv: jax.Array, traj: types.Trajectory, turn_keys=None, *,
         group_size: int, gamma: float = 1.0, step_weight: float = 1.0) -> jax.Array:
  """IGPO: `turn` over information-gain turn rewards (the policy's gain on the gold answer).

  "Information Gain-based Policy Optimization": the rollout writes the rise in the
  policy's probability of the gold answer across each turn as its reward, with the
  episode's return on its last turn."""
  return turn(episode_adv, traj, turn_keys, group_size=group_size, gamma=gamma,
              step_weight=step_weight)


@registry.register("turn_credit", "gigpo")
def gigpo(episode_adv: jax.Array, traj: types.Trajectory, turn_keys=None, *,
          group_size: int, gamma: float = 1.0, step_weight: float = 1.0) -> jax.Array:
  """GiGPO: the episode advantage plus step_weight x the advantage among same-state turns.

  "Group-in-Group Policy Optimization": turns taken from the same environment state
  are compared by discounted return (the environment must have `state_key`)."""
  if turn_keys is None:
    raise ValueError("turn_credit 'gigpo' needs the state of every turn: the rollout has none")
  tm = traj.turn_mask
  returns = turn_returns(traj.turn_rewards, tm, gamma=gamma)
  step = step_group_advantages(returns, turn_keys, tm, group_size=group_size)
  return combine_outcome_and_step_advantages(episode_adv, step, step_weight,
                                             turn_id=traj.turn_id, mask=traj.policy_mask)
