"""Heads on the decoder's final hidden states: scalar value / reward per position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry


def init_scalar_head(rng: jax.Array, d_model: int, scale: float = 0.0) -> dict:
  """A linear map D -> 1; zero-initialized by default so initial values are exactly 0.

  Args:
    rng: PRNG key (used when scale > 0).
    d_model: hidden size D.
    scale: std of the initial weights.

  Returns:
    {"w": f32[D], "b": f32[]}.
  """
  w = scale * jax.random.normal(rng, (d_model,), jnp.float32) if scale else jnp.zeros(
      (d_model,), jnp.float32)
  return {"w": w, "b": jnp.zeros((), jnp.float32)}


def apply_scalar_head(head: dict, hidden: jax.Array) -> jax.Array:
  """f[..., D] hidden states -> f32[...] scalars (values, rewards, process rewards)."""
  return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), head["w"]) + head["b"]


# A value model's backbone by name (PPO's config.critic, registry kind "critic"): the
# initial policy parameters -> the critic's own backbone parameters, or None where the
# value head reads the policy's hidden states.


@registry.register("critic", "shared")
def shared_backbone(params):
  """The value head on the policy's own backbone (one forward pass gives both)."""
  del params
  return None


@registry.register("critic", "separate")
def separate_backbone(params):
  """A copy of the initial backbone, trained as the critic (the classic RLHF setup)."""
  return jax.tree.map(jnp.copy, params)
