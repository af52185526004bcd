"""KL divergence estimators between the policy and a reference, per token.

The sampled-token estimators take the log-probabilities of the same sampled
tokens under both policies, `logp, ref_logp: f32[B, T]`, and return a per-token
`f32[B, T]` estimate of KL(pi || pi_ref) (reverse KL, the one RLHF penalizes).
With r = pi_ref(y) / pi(y) and log r = ref_logp - logp (after John Schulman's
"Approximating KL Divergence" note):
  k1 = -log r                     unbiased, can be negative
  k2 = (log r)^2 / 2              biased, low variance, non-negative
  k3 = r - 1 - log r              unbiased, low variance, non-negative (GRPO's choice)
Full-vocabulary KL from logits (forward or reverse) is exact and needs both
models' logits at every position.

A KL term enters training either as a loss (`kl_loss`, GRPO) or as a penalty
subtracted from the reward (`kl_reward_penalty`, classic RLHF PPO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_bt, check_same_shape
from jaxrl_agents.objectives.losses.aggregation import aggregate


@registry.register("kl", "k1")
def kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """k1 = logp - ref_logp; f32[B, T] each -> f32[B, T]."""
  check_same_shape([("logp", logp), ("ref_logp", ref_logp)])
  return logp - ref_logp


@registry.register("kl", "k2")
def kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """k2 = (logp - ref_logp)^2 / 2; f32[B, T] each -> f32[B, T]."""
  check_same_shape([("logp", logp), ("ref_logp", ref_logp)])
  return 0.5 * jnp.square(logp - ref_logp)


@registry.register("kl", "k3")
def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 >= 0; f32[B, T] each -> f32[B, T].

  The estimator of "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
  in Open Language Models" (GRPO) and verl's "low_var_kl" (which additionally
  clamps to [-10, 10]; not done here so the identity k3 >= 0 holds exactly).
  """
  check_same_shape([("logp", logp), ("ref_logp", ref_logp)])
  log_ratio = ref_logp - logp
  return jnp.exp(log_ratio) - log_ratio - 1.0


def kl_from_logits(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
  """Exact KL(p || q) = sum_v p_v (log p_v - log q_v) per position.

  Args:
    p_logits: f32[..., V] logits of p.
    q_logits: f32[..., V] logits of q.

  Returns:
    f32[...] KL at every position (>= 0).
  """
  check_same_shape([("p_logits", p_logits), ("q_logits", q_logits)])
  log_p = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
  log_q = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def forward_kl_from_logits(logits: jax.Array, ref_logits: jax.Array) -> jax.Array:
  """Forward KL(pi_ref || pi) per position from full logits, f32[..., V] -> f32[...].

  Mass-covering: penalizes the policy for dropping tokens the reference likes.
  "Unlocking Reasoning Capabilities in LLMs via Reinforcement Learning
  Exploration" (RAPO) uses it in place of the reverse KL to keep exploration.
  """
  return kl_from_logits(ref_logits, logits)


def reverse_kl_from_logits(logits: jax.Array, ref_logits: jax.Array) -> jax.Array:
  """Reverse KL(pi || pi_ref) per position from full logits, f32[..., V] -> f32[...]."""
  return kl_from_logits(logits, ref_logits)


def kl_loss(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    estimator: str = "k3",
    aggregation: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """KL to the reference as a loss term (GRPO adds beta times this to the policy loss).

  Args:
    logp: f32[B, T] policy log-probs of the sampled tokens.
    ref_logp: f32[B, T] reference log-probs of the same tokens.
    mask: bool[B, T] policy tokens.
    estimator: a registered "kl" name.
    aggregation: a registered aggregation mode.
    normalizer: the constant of "seq-mean-token-sum-norm".

  Returns:
    (scalar KL, {"kl": same}).
  """
  check_bt(logp=logp, ref_logp=ref_logp, mask=mask)
  per_token = registry.get("kl", estimator)(logp, ref_logp)
  value = aggregate(per_token, mask, aggregation, normalizer)
  return value, {"kl": value}


def kl_reward_penalty(
    token_rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    beta: float | jax.Array,
    *,
    estimator: str = "k1",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """KL as a reward penalty: r'_t = r_t - beta * kl_t on policy tokens (RLHF PPO).

  "Fine-Tuning Language Models from Human Preferences" and "Training language
  models to follow instructions with human feedback" subtract the per-token
  log-ratio from the reward, so the penalty is credited like any reward
  (through GAE) instead of being a separate gradient term. No gradient flows
  through the penalty.

  Args:
    token_rewards: f32[B, T] rewards per token (outcome reward on the last one).
    logp: f32[B, T] policy (old/behaviour) log-probs of the sampled tokens.
    ref_logp: f32[B, T] reference log-probs.
    mask: bool[B, T] policy tokens; the penalty is 0 elsewhere.
    beta: KL coefficient (a scalar, possibly from a KL controller).
    estimator: a registered "kl" name.

  Returns:
    (penalized rewards f32[B, T], {"kl_penalty": mean per-sequence summed KL}).
  """
  check_bt(token_rewards=token_rewards, logp=logp, ref_logp=ref_logp, mask=mask)
  kl = registry.get("kl", estimator)(logp, ref_logp)
  kl = jax.lax.stop_gradient(jnp.where(mask, kl, 0.0))
  return token_rewards - beta * kl, {"kl_penalty": kl.sum(-1).mean()}
