"""Loss aggregation modes: how a per-token loss f32[B, T] becomes a scalar.

The choice matters: "token-mean" weights every token equally (long answers
dominate), "seq-mean-token-mean" weights every sequence equally (GRPO as
published, which favours short correct and long wrong answers), and
"seq-mean-token-sum-norm" divides by a constant, the unbiased form of
"Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO).
Names follow verl's `loss_agg_mode`.

All modes take `values: f32[B, T]` and `mask: bool[B, T]` (True on policy
tokens). Sequences with no valid token are excluded from sequence means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_bt


def denominator(mask: jax.Array, mode: str = "token-mean",
                normalizer: float | None = None) -> jax.Array:
  """What `mode` divides the masked sum by (for "seq-mean-token-mean", the count its
  mean over sequences divides by): the policy tokens, the sequences with one, or B * L.

  A loss that is 0 on some rows can be aggregated without them and rescaled by the
  ratio of the denominators with and without (rollout.groups.skipped_loss_scale).
  """
  m = mask.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.maximum(m.sum(), 1.0)
  if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
    return jnp.maximum((m.sum(-1) > 0).sum(), 1.0)
  if mode == "seq-mean-token-sum-norm":
    return jnp.float32(mask.shape[0] * (mask.shape[-1] if normalizer is None else normalizer))
  raise ValueError(f"unknown aggregation {mode!r}; expected one of {sorted(AGGREGATIONS)}")


def _masked(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  check_bt(values=values, mask=mask)
  m = mask.astype(values.dtype)
  return values * m, m


@registry.register("aggregation", "token-mean")
def token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """sum_{b,t} m_bt v_bt / sum_{b,t} m_bt (DAPO's token-level loss).

  Args:
    values: f32[B, T] per-token values.
    mask: bool[B, T].

  Returns:
    f32[] scalar; 0 when the mask is empty.
  """
  vm, _ = _masked(values, mask)
  return vm.sum() / denominator(mask, "token-mean")


@registry.register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """mean_b [ sum_t m_bt v_bt / sum_t m_bt ] over sequences with >= 1 token (GRPO)."""
  vm, m = _masked(values, mask)
  length = m.sum(-1)
  per_seq = vm.sum(-1) / jnp.maximum(length, 1.0)
  return per_seq.sum() / denominator(mask, "seq-mean-token-mean")


@registry.register("aggregation", "seq-mean-token-sum")
def seq_mean_token_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
  """mean_b [ sum_t m_bt v_bt ] over sequences with >= 1 token."""
  vm, _ = _masked(values, mask)
  return vm.sum() / denominator(mask, "seq-mean-token-sum")


@registry.register("aggregation", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    values: jax.Array, mask: jax.Array, normalizer: float | None = None
) -> jax.Array:
  """sum_{b,t} m_bt v_bt / (B * L), with a constant L (Dr. GRPO).

  "Understanding R1-Zero-Like Training: A Critical Perspective" replaces the
  per-sequence length 1/|o_i| of GRPO with a constant so that the gradient is
  not biased towards long wrong answers; TRL's `dr_grpo` loss uses
  L = max_completion_length. verl divides by L only (not B); the factor B is
  a constant per step, kept here so the scale matches the other modes.

  Args:
    values: f32[B, T].
    mask: bool[B, T].
    normalizer: the constant L; defaults to T (the padded length), which is
      constant only if batches are always padded to the same length.

  Returns:
    f32[] scalar.
  """
  vm, _ = _masked(values, mask)
  return vm.sum() / denominator(mask, "seq-mean-token-sum-norm", normalizer)


AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(
    values: jax.Array, mask: jax.Array, mode: str = "token-mean", normalizer: float | None = None
) -> jax.Array:
  """Reduces `values: f32[B, T]` under `mask` with the aggregation mode named `mode`.

  `normalizer` is used by "seq-mean-token-sum-norm" only.
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {sorted(AGGREGATIONS)}")
  if mode == "seq-mean-token-sum-norm":
    return seq_mean_token_sum_norm(values, mask, normalizer)
  return AGGREGATIONS[mode](values, mask)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Token mean of any-shaped `values` under a same-shaped `mask` (for metrics)."""
  m = mask.astype(values.dtype)
  return (values * m).sum() / jnp.maximum(m.sum(), 1.0)


def masked_max(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Max of `values` over valid entries (-inf if none)."""
  return jnp.max(jnp.where(mask, values, -jnp.inf))
