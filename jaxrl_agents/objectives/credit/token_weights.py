"""Which tokens an advantage reaches, and how strongly: R^3L's pivotal mask, positive
amplification."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.losses._checks import check_bt, check_same_shape


def pivotal_mask(
  tokens_a: jax.Array,
  tokens_b: jax.Array,
  mask_a: jax.Array,
  mask_b: jax.Array | None = None,
) -> jax.Array:
  """R^3L pivotal credit: keep gradient only on the suffix where a pair diverges.

  "R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
  Exploration, Pivotal Credit, and Positive Amplification" retries a failed
  attempt from the diagnosed failure point, so the two trajectories share a
  prefix that carries no contrastive signal; it is excluded from the update.
  With L_b the length of the common prefix of rows b (the first position where
  the tokens differ, T if none),

    out_{b,t} = mask_a_{b,t} and t >= L_b.

  Apply it to both members of a pair (swap the arguments for the other one).

  Args:
    tokens_a: int[B, T] trajectory whose mask is returned.
    tokens_b: int[B, T] its partner, aligned position by position.
    mask_a: bool[B, T].
    mask_b: bool[B, T] or None; when given, a position where exactly one of
      the two is valid also counts as a divergence (so padding never extends
      the common prefix).

  Returns:
    bool[B, T].
  """
  check_bt(tokens_a=tokens_a, tokens_b=tokens_b, mask_a=mask_a)
  same = tokens_a == tokens_b
  if mask_b is not None:
    check_same_shape([("mask_a", mask_a), ("mask_b", mask_b)])
    same = same & (mask_a.astype(bool) == mask_b.astype(bool))
  in_prefix = jnp.cumprod(same.astype(jnp.int32), axis=1).astype(bool)
  return mask_a.astype(bool) & ~in_prefix


def positive_amplification(advantages: jax.Array, weight: float) -> jax.Array:
  """R^3L positive amplification: A' = w * A where A > 0, else A.

  "R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
  Exploration, Pivotal Credit, and Positive Amplification" upweights
  successful trajectories so that failure-dominated groups do not drown the
  few positive signals. Any shape; w = 1 is the identity.
  """
  return jnp.where(advantages > 0, weight * advantages, advantages)
