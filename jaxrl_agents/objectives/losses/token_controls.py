"""Per-token masks applied before the policy loss: which tokens receive gradient.

Both controls rank the valid tokens by a score and keep or drop a fraction of
them. Shapes stay static: the number of tokens to select is computed from the
(traced) number of valid tokens and compared against each token's rank, so the
functions jit once for any mask. They return `(new_mask, metrics)`; feed
`new_mask` to the policy loss in place of `mask`.

```
mask, m1 = covariance_clip_mask(logp, adv, mask, frac=0.002)   # SPEAR
mask, m2 = entropy_gate_mask(entropy, mask, top_frac=0.2)       # EARL
```
A config chooses one by name (registry kind "token_control", the functions at the
end: log-probs, entropy, f32[B, T] advantages, mask, then `frac` and `per_sequence`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_bt

# Absorbs float error in frac * n (e.g. 0.29 * 100 = 28.999...) before rounding.
_COUNT_TOL = 1e-4


def _rank_descending(scores: jax.Array, mask: jax.Array, per_sequence: bool) -> jax.Array:
  """0-based rank of each valid entry by decreasing score; invalid entries rank last.

  Ties are broken by position (stable sort), so ranks are a permutation.
  """
  if per_sequence:
    order = jnp.lexsort((-scores, (~mask).astype(jnp.int32)), axis=-1)
    return jnp.argsort(order, axis=-1)
  flat_order = jnp.lexsort((-scores.reshape(-1), (~mask).reshape(-1).astype(jnp.int32)))
  return jnp.argsort(flat_order).reshape(scores.shape)


def _valid_count(mask: jax.Array, per_sequence: bool) -> jax.Array:
  m = mask.astype(jnp.float32)
  return m.sum(axis=-1, keepdims=True) if per_sequence else m.sum()


def _token_covariance(logp: jax.Array, advantages: jax.Array, m: jax.Array, n: jax.Array
                      ) -> jax.Array:
  """c_t = (logp_t - mean logp) * (A_t - mean A) over the n valid tokens of `m`; 0 elsewhere."""
  mf = m.astype(logp.dtype)
  lp_c = logp - (logp * mf).sum() / n
  adv_c = advantages - (advantages * mf).sum() / n
  return jnp.where(m, lp_c * adv_c, 0.0)


def covariance_clip_mask(
  logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  frac: float,
  *,
  per_sequence: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Drops the tokens with the highest log-probability/advantage covariance.

  "Learn the Ropes, Then Trust the Wins: Self-imitation with Progressive
  Exploration for Agentic Reinforcement Learning" (SPEAR) curbs over-confidence
  by clipping tokens whose probability and advantage covary most, the
  mechanism behind entropy collapse (the entropy change under policy gradient
  is driven by Cov(log pi, A)). For each valid token

    c_t = (logp_t - mean_v logp) * (A_t - mean_v A),

  with means over the valid tokens of the batch; the floor(frac * n_valid)
  tokens with the largest c_t lose their gradient (mask set False). The
  selection is the deterministic top fraction (the KL-Cov rule of "The
  Entropy Mechanism of Reinforcement Learning for Reasoning Language
  Models"), not Clip-Cov's random draw from a covariance band. frac = 0 is the
  identity.

  Args:
    logp: f32[B, T] token log-probabilities (treated as constants).
    advantages: f32[B, T] token advantages.
    mask: bool[B, T].
    frac: fraction of valid tokens to drop, in [0, 1]; may be traced.
    per_sequence: rank and count within each row instead of the whole batch
      (the means stay batch-wide).

  Returns:
    (new_mask bool[B, T], metrics) with metrics "num_dropped", "dropped_frac",
    "cov_mean" (mean c over valid tokens) and "cov_threshold" (smallest
    dropped c, -inf if none).
  """
  check_bt(logp=logp, advantages=advantages, mask=mask)
  m = mask.astype(bool)
  n = jnp.maximum(m.sum().astype(logp.dtype), 1.0)
  cov = _token_covariance(jax.lax.stop_gradient(logp), jax.lax.stop_gradient(advantages), m, n)
  count = _valid_count(m, per_sequence)
  num_drop = jnp.floor(frac * count + _COUNT_TOL)
  rank = _rank_descending(cov, m, per_sequence)
  dropped = m & (rank < num_drop)
  new_mask = m & ~dropped
  total_dropped = dropped.sum()
  metrics = {
    "num_dropped": total_dropped,
    "dropped_frac": total_dropped / n,
    "cov_mean": cov.sum() / n,
    "cov_threshold": jnp.min(jnp.where(dropped, cov, jnp.inf), initial=jnp.inf),
  }
  metrics["cov_threshold"] = jnp.where(total_dropped > 0, metrics["cov_threshold"], -jnp.inf)
  return new_mask, metrics


def entropy_gate_mask(
  entropy: jax.Array,
  mask: jax.Array,
  top_frac: float,
  *,
  per_sequence: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Keeps only the highest-entropy fraction of valid tokens.

  "EARL: Entropy-Aware RL Alignment of LLMs for Reliable RTL Code Generation"
  gates policy gradients to high-entropy tokens (few "forking" tokens such as
  `always`, `if`, `assign` decide control flow; most code tokens are nearly
  deterministic). The ceil(top_frac * n_valid) valid tokens with the largest
  entropy keep their mask; the rest are set False, so every kept entropy is
  >= every dropped one. top_frac = 1 is the identity. The abstract gives no
  closed form for the threshold; this is the standard top-percentile rule of
  "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
  Reinforcement Learning for LLM Reasoning".

  Args:
    entropy: f32[B, T] per-token policy entropy (treated as constant).
    mask: bool[B, T].
    top_frac: fraction of valid tokens to keep, in [0, 1]; may be traced.
    per_sequence: choose the fraction within each response instead of the
      whole batch.

  Returns:
    (new_mask bool[B, T], metrics) with "num_kept", "kept_frac",
    "entropy_threshold" (smallest kept entropy, +inf if none) and
    "kept_entropy_mean".
  """
  check_bt(entropy=entropy, mask=mask)
  m = mask.astype(bool)
  entropy = jax.lax.stop_gradient(entropy)
  count = _valid_count(m, per_sequence)
  num_keep = jnp.ceil(top_frac * count - _COUNT_TOL)
  rank = _rank_descending(jnp.where(m, entropy, -jnp.inf), m, per_sequence)
  new_mask = m & (rank < num_keep)
  kept = new_mask.sum()
  n = jnp.maximum(m.sum(), 1)
  metrics = {
    "num_kept": kept,
    "kept_frac": kept / n,
    "entropy_threshold": jnp.min(jnp.where(new_mask, entropy, jnp.inf), initial=jnp.inf),
    "kept_entropy_mean": jnp.where(new_mask, entropy, 0.0).sum() / jnp.maximum(kept, 1),
  }
  return new_mask, metrics


# The configs' names (config.token_control.name), one signature for all.


@registry.register("token_control", "none")
def no_control(logp, entropy, advantages, mask, *, frac: float = 0.0, per_sequence: bool = False):
  """Every policy token keeps its gradient."""
  del logp, entropy, advantages, frac, per_sequence
  return mask, {}


@registry.register("token_control", "covariance_clip")
def covariance_clip(logp, entropy, advantages, mask, *, frac: float, per_sequence: bool = False):
  """Drops the `frac` of tokens with the largest log-prob/advantage covariance (SPEAR)."""
  del entropy
  return covariance_clip_mask(logp, advantages, mask, frac, per_sequence=per_sequence)


@registry.register("token_control", "entropy_gate")
def entropy_gate(logp, entropy, advantages, mask, *, frac: float, per_sequence: bool = False):
  """Keeps the `frac` of tokens with the highest entropy (EARL's gate)."""
  del logp, advantages
  return entropy_gate_mask(entropy, mask, frac, per_sequence=per_sequence)
