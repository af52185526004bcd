"""Corrections for tokens sampled by another policy than the one being updated.

With the rollout overlapped with the update (`train/overlap.py`, `config.overlap`), the
tokens of step t were drawn by the policy before update t-1: one update
stale. The sampler recorded each token's log-probability under the policy that
drew it (`Trajectory.sampling_logprobs`, the behaviour policy mu), so the
per-token ratio to the policy being updated,

  rho_t = pi(y_t) / mu(y_t),

corrects for it. Three choices (as in verl's rollout importance sampling and
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):

  "none"  use the tokens as if pi had drawn them (rho ignored);
  "tis"   truncated importance sampling: each token's advantage times
          min(rho_t, cap);
  "mis"   masked importance sampling: tokens with rho_t outside [1/cap, cap]
          leave the policy-gradient term (and its normalizer; a KL or entropy
          term still counts them); the rest are weighted by rho_t.

The weights are constants (no gradient flows through rho): they rescale the
policy-gradient estimate, they are not part of the objective's derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.losses._checks import check_bt

CORRECTIONS = ("none", "tis", "mis")


def behavior_weights(logp: jax.Array, behavior_logp: jax.Array, mask: jax.Array, *,
                     correction: str, cap: float = 2.0
                     ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Per-token importance weights of the update's policy against the sampling one.

  Args:
    logp: f32[B, T] log pi of the sampled tokens under the policy being updated
      (its gradient is stopped here).
    behavior_logp: f32[B, T] log mu, what the sampler recorded.
    mask: bool[B, T] policy tokens.
    correction: one of CORRECTIONS.
    cap: the truncation level of "tis", the band [1/cap, cap] of "mis"; > 1.

  Returns:
    (weights f32[B, T] to multiply the token advantages by (0 off the mask),
     the policy-gradient term's mask (bool[B, T]; "mis" drops tokens), metrics:
     "behavior_kl" (k3 estimate of KL(mu || pi) per token), "is_weight_mean"
     (mean rho over the policy tokens), "is_corrected_frac" (tokens truncated by
     "tis" or dropped by "mis")).
  """
  if correction not in CORRECTIONS:
    raise ValueError(f"off-policy correction must be one of {CORRECTIONS}, got {correction!r}")
  if not cap > 1.0:
    raise ValueError(f"the importance-weight cap must be > 1, got {cap}")
  check_bt(logp=logp, behavior_logp=behavior_logp, mask=mask)
  log_ratio = jnp.where(mask, jax.lax.stop_gradient(logp) - behavior_logp, 0.0)
  # Clamped before exp: a token mu gave almost no mass must not overflow to inf.
  ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
  n = jnp.maximum(mask.sum(), 1)
  metrics = {"behavior_kl": jnp.sum(jnp.where(mask, ratio - 1.0 - log_ratio, 0.0)) / n,
             "is_weight_mean": jnp.sum(jnp.where(mask, ratio, 0.0)) / n}
  if correction == "none":
    weights, new_mask, corrected = mask.astype(jnp.float32), mask, jnp.zeros_like(mask)
  elif correction == "tis":
    weights = jnp.where(mask, jnp.minimum(ratio, cap), 0.0)
    new_mask, corrected = mask, mask & (ratio > cap)
  else:
    inside = (ratio <= cap) & (ratio >= 1.0 / cap)
    new_mask = mask & inside
    weights = jnp.where(new_mask, ratio, 0.0)
    corrected = mask & ~inside
  metrics["is_corrected_frac"] = corrected.sum() / n
  return weights, new_mask, metrics
