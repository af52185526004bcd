"""Critic losses for PPO."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.losses._checks import check_bt
from jaxrl_agents.objectives.losses.aggregation import aggregate, masked_mean


def clipped_value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float | None = 0.2,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO's clipped value loss: 1/2 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2).

  "Proximal Policy Optimization Algorithms" (as implemented in OpenAI
  baselines, verl and TRL): the new value may move at most eps from the value
  the advantages were computed with before its error stops shrinking the loss.

  Args:
    values: f32[B, T] current critic values.
    old_values: f32[B, T] values at rollout time.
    returns: f32[B, T] targets (advantages + old values from GAE).
    mask: bool[B, T] positions that count.
    clip_eps: clipping range; None disables clipping (plain squared error / 2).
    aggregation: a registered aggregation mode.

  Returns:
    (scalar loss, {"value_loss", "value_clip_frac", "value_mean", "value_error"}).
  """
  check_bt(values=values, old_values=old_values, returns=returns, mask=mask)
  unclipped = jnp.square(values - returns)
  if clip_eps is None:
    per_token = unclipped
    clipped_more = jnp.zeros_like(mask)
  else:
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    clipped = jnp.square(clipped_values - returns)
    per_token = jnp.maximum(unclipped, clipped)
    clipped_more = clipped > unclipped
  loss = 0.5 * aggregate(per_token, mask, aggregation)
  metrics = {
      "value_loss": loss,
      "value_clip_frac": masked_mean(clipped_more.astype(jnp.float32), mask),
      "value_mean": masked_mean(values, mask),
      "value_error": masked_mean(jnp.abs(values - returns), mask),
  }
  return loss, metrics
