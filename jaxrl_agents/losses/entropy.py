"""Policy entropy from logits, as a metric and as a bonus term.

"Reinforcement Learning for Reasoning in Large Language Models with One
Training Example" finds the entropy bonus matters; entropy collapse is also the
first thing to look for in a run's dynamics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.losses._checks import check_bt
from jaxrl_agents.losses.aggregation import aggregate


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """H(softmax(z)) = logsumexp(z) - sum_v softmax(z)_v z_v per position.

  Args:
    logits: f32[..., V] (bf16 is upcast to f32).

  Returns:
    f32[...] entropy in nats, in [0, log V].
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - log_z[..., None])
  return log_z - jnp.sum(probs * logits, axis=-1)


def entropy_bonus(
    entropy: jax.Array, mask: jax.Array, *, aggregation: str = "token-mean",
    normalizer: float | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Aggregated entropy of the policy tokens; subtract coef * this from the loss.

  Args:
    entropy: f32[B, T] per-token entropy (from `entropy_from_logits`).
    mask: bool[B, T] policy tokens.
    aggregation: a registered aggregation mode.
    normalizer: the constant of "seq-mean-token-sum-norm".

  Returns:
    (scalar entropy, {"entropy": same}).
  """
  check_bt(entropy=entropy, mask=mask)
  value = aggregate(entropy, mask, aggregation, normalizer)
  return value, {"entropy": value}
