"""Policy-gradient surrogates: PPO/GRPO clipping and its variants, selectable by name.

Every loss has the signature
```
loss, metrics = registry.get("policy_loss", name)(logp, old_logp, advantages, mask, **hp)
```
with `logp: f32[B, T]` the current policy's log-probs of the sampled tokens
(differentiated), `old_logp: f32[B, T]` those of the policy that sampled them
(constants), `advantages: f32[B, T]` (or f32[B], broadcast over tokens),
`mask: bool[B, T]` the policy's tokens. Losses are minimized. Metrics always
include the ratio statistics and clip fractions, so variants can be compared
in one plot:
  ratio_mean / ratio_max   r = pi / pi_old over policy tokens
  approx_kl                mean of old_logp - logp (k1 estimate of KL(pi_old || pi))
  clip_frac                fraction of tokens whose gradient clipping removed
  clip_frac_low/high       ... at the lower bound (A < 0) / upper bound (A > 0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_bt, check_rank
from jaxrl_agents.objectives.losses.aggregation import aggregate, masked_max, masked_mean

# exp() of a log-ratio beyond this overflows f32 gradients; verl clamps the same way.
_MAX_LOG_RATIO = 20.0


def _prepare(logp, old_logp, advantages, mask):
  check_bt(logp=logp, old_logp=old_logp, mask=mask)
  check_rank("advantages", advantages, (1, 2))
  if advantages.ndim == 1:
    if advantages.shape[0] != logp.shape[0]:
      raise ValueError(
          f"advantages has shape {tuple(advantages.shape)}; per-sequence advantages need "
          f"shape ({logp.shape[0]},) to match logp {tuple(logp.shape)}")
    advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
  elif advantages.shape != logp.shape:
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)} but logp has shape "
        f"{tuple(logp.shape)}; they must match")
  advantages = jax.lax.stop_gradient(advantages.astype(logp.dtype))
  old_logp = jax.lax.stop_gradient(old_logp)
  log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  return old_logp, advantages, log_ratio


def _ratio_metrics(log_ratio, mask):
  ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
  return {
      "ratio_mean": masked_mean(ratio, mask),
      "ratio_max": masked_max(ratio, mask),
      "approx_kl": masked_mean(-jax.lax.stop_gradient(log_ratio), mask),
  }


def _clip_metrics(ratio, advantages, mask, eps_low, eps_high):
  low = (ratio < 1.0 - eps_low) & (advantages < 0)
  high = (ratio > 1.0 + eps_high) & (advantages > 0)
  return {
      "clip_frac_low": masked_mean(low.astype(jnp.float32), mask),
      "clip_frac_high": masked_mean(high.astype(jnp.float32), mask),
      "clip_frac": masked_mean((low | high).astype(jnp.float32), mask),
  }


@registry.register("policy_loss", "ppo")
def ppo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped surrogate with clip-higher and dual-clip (the GRPO/DAPO loss).

  "Proximal Policy Optimization Algorithms":
    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi/pi_old.
  eps_high > eps_low is DAPO's clip-higher ("DAPO: An Open-Source LLM
  Reinforcement Learning System at Scale"), letting unlikely tokens with
  positive advantage grow. Dual clip ("Mastering Complex Control in MOBA Games
  with Deep Reinforcement Learning") bounds the loss of negative-advantage
  tokens with a huge ratio: for A_t < 0, l_t = min(l_t, -A_t c) with c > 1.
  A clipped token has zero gradient; at r = 1 the gradient is -A grad log pi.

  Args:
    logp, old_logp, advantages, mask: see the module docstring.
    eps_low: lower clip range.
    eps_high: upper clip range; eps_low when None (symmetric PPO).
    dual_clip: the constant c (> 1) of dual clip; None disables it.
    aggregation: a registered aggregation mode.
    normalizer: the constant of "seq-mean-token-sum-norm".

  Returns:
    (scalar loss, metrics).
  """
  eps_high = eps_low if eps_high is None else eps_high
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
  _, advantages, log_ratio = _prepare(logp, old_logp, advantages, mask)
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = jnp.maximum(unclipped, clipped)
  metrics = _clip_metrics(jax.lax.stop_gradient(ratio), advantages, mask, eps_low, eps_high)
  if dual_clip is not None:
    bound = -advantages * dual_clip
    dual = (advantages < 0) & (per_token > bound)
    per_token = jnp.where(dual, bound, per_token)
    metrics["dual_clip_frac"] = masked_mean(dual.astype(jnp.float32), mask)
  loss = aggregate(per_token, mask, aggregation, normalizer)
  return loss, {"pg_loss": loss, **metrics, **_ratio_metrics(log_ratio, mask)}


@registry.register("policy_loss", "gspo")
def gspo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO: clip a sequence-level, length-normalized importance ratio.

  "Group Sequence Policy Optimization":
    s_i = exp( (1/|y_i|) sum_t (log pi(y_it) - log pi_old(y_it)) )
    l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))
  in the token form of the paper (GSPO-token), s_it = sg[s_i] pi(y_it) / sg[pi(y_it)],
  whose value is s_i and whose gradient is s_i grad log pi(y_it); with
  seq-mean-token-mean aggregation and per-sequence advantages it equals
  sequence-level GSPO. The clip ranges are much smaller than PPO's because the
  ratio is a per-token geometric mean.

  Args:
    logp, old_logp, advantages, mask: see the module docstring.
    eps_low, eps_high: clip ranges of the sequence ratio.
    aggregation: a registered aggregation mode (the paper's is seq-mean-token-mean).
    normalizer: the constant of "seq-mean-token-sum-norm".

  Returns:
    (scalar loss, metrics); the ratio metrics are of the sequence ratio.
  """
  _, advantages, log_ratio = _prepare(logp, old_logp, advantages, mask)
  m = mask.astype(logp.dtype)
  seq_log_ratio = (log_ratio * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)
  token_log_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)[
      :, None]
  ratio = jnp.exp(jnp.minimum(token_log_ratio, _MAX_LOG_RATIO))
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = jnp.maximum(unclipped, clipped)
  loss = aggregate(per_token, mask, aggregation, normalizer)
  metrics = _clip_metrics(jax.lax.stop_gradient(ratio), advantages, mask, eps_low, eps_high)
  seq_ratio = jnp.broadcast_to(seq_log_ratio[:, None], logp.shape)
  return loss, {"pg_loss": loss, **metrics, **_ratio_metrics(seq_ratio, mask)}


@registry.register("policy_loss", "cispo")
def cispo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.2,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

  "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention":
    l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t).
  Unlike PPO, no token loses its gradient: clipping bounds the weight, not the
  update, so rare "fork" tokens with large ratios still learn. The paper
  imposes no lower bound (eps_low=None here).

  Args:
    logp, old_logp, advantages, mask: see the module docstring.
    eps_low: lower clip range; None for no lower bound.
    eps_high: upper clip range.
    aggregation: a registered aggregation mode (the paper's is token-mean).
    normalizer: the constant of "seq-mean-token-sum-norm".

  Returns:
    (scalar loss, metrics); clip fractions count tokens whose weight was clipped.
  """
  _, advantages, log_ratio = _prepare(logp, old_logp, advantages, mask)
  ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
  low = -jnp.inf if eps_low is None else 1.0 - eps_low
  weight = jnp.clip(ratio, low, 1.0 + eps_high)
  per_token = -weight * advantages * logp
  loss = aggregate(per_token, mask, aggregation, normalizer)
  clip_low = jnp.inf if eps_low is None else eps_low
  lo = (ratio < 1.0 - clip_low).astype(jnp.float32)
  hi = (ratio > 1.0 + eps_high).astype(jnp.float32)
  metrics = {
      "clip_frac_low": masked_mean(lo, mask),
      "clip_frac_high": masked_mean(hi, mask),
      "clip_frac": masked_mean(jnp.maximum(lo, hi), mask),
  }
  return loss, {"pg_loss": loss, **metrics, **_ratio_metrics(log_ratio, mask)}


@registry.register("policy_loss", "reinforce")
def reinforce_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """REINFORCE: l_t = -A_t log pi(y_t), no importance ratio (strictly on-policy).

  "Simple Statistical Gradient-Following Algorithms for Connectionist
  Reinforcement Learning". `old_logp` only feeds the ratio metrics, which show
  how off-policy the update has drifted.

  Returns:
    (scalar loss, metrics) with clip fractions 0.
  """
  _, advantages, log_ratio = _prepare(logp, old_logp, advantages, mask)
  loss = aggregate(-advantages * logp, mask, aggregation, normalizer)
  zero = jnp.zeros((), jnp.float32)
  metrics = {"clip_frac": zero, "clip_frac_low": zero, "clip_frac_high": zero}
  return loss, {"pg_loss": loss, **metrics, **_ratio_metrics(log_ratio, mask)}
