"""Shape checks and token-layout helpers the credit modules share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives import advantages as advantages_lib
from jaxrl_agents.objectives.losses._checks import check_rank, check_same_shape

_SCOPES = ("batch", "group", "none")


def _check_turns(turn_values: jax.Array, turn_mask: jax.Array | None, name: str) -> jax.Array:
  """Checks f32[B, K] + bool[B, K]; returns the mask (all True when None)."""
  check_rank(name, turn_values, 2)
  if turn_mask is None:
    return jnp.ones(turn_values.shape, dtype=bool)
  check_rank("turn_mask", turn_mask, 2)
  check_same_shape([(name, turn_values), ("turn_mask", turn_mask)])
  return turn_mask.astype(bool)


def _check_rows(name: str, x, batch: int) -> None:
  if jnp.shape(x)[0] != batch:
    raise ValueError(
      f"{name} has {jnp.shape(x)[0]} rows (shape {tuple(jnp.shape(x))}) but the batch has "
      f"{batch}; they must match"
    )


def _masked_standardize(
  x: jax.Array, m: jax.Array, axis, std_normalize: bool, eps: float
) -> jax.Array:
  """(x - mean) / (std + eps) with statistics over entries where m is True, along `axis`."""
  mf = m.astype(x.dtype)
  n = jnp.maximum(mf.sum(axis=axis, keepdims=True), 1.0)
  mean = jnp.where(m, x, 0.0).sum(axis=axis, keepdims=True) / n
  tied = advantages_lib.no_spread(x, axis, m)
  centred = jnp.where(m & ~tied, x - mean, 0.0)
  if not std_normalize:
    return centred
  std = jnp.sqrt((centred**2).sum(axis=axis, keepdims=True) / n)
  return jnp.where(tied, 0.0, centred / (std + eps))  # an exact tie with eps = 0: not 0 / 0


def _policy_first(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(order, inverse) int32[B, T]: a stable permutation putting each row's policy tokens
  first, in order, and the permutation that undoes it."""
  order = jnp.argsort(~mask.astype(bool), axis=1, stable=True)
  return order, jnp.argsort(order, axis=1)


def _turn_edges(turn_id: jax.Array, mask: jax.Array, which: str) -> jax.Array:
  """bool[B, T]: the "first" or "last" policy token of each turn."""
  m = mask.astype(bool)
  order, inverse = _policy_first(m)
  tid = jnp.take_along_axis(jnp.where(m, turn_id, -1), order, axis=1)
  pm = jnp.take_along_axis(m, order, axis=1)
  if which == "last":
    other = jnp.concatenate([tid[:, 1:], jnp.full(tid[:, :1].shape, -1)], axis=1)
    other_m = jnp.concatenate([pm[:, 1:], jnp.zeros_like(pm[:, :1])], axis=1)
  else:
    other = jnp.concatenate([jnp.full(tid[:, :1].shape, -1), tid[:, :-1]], axis=1)
    other_m = jnp.concatenate([jnp.zeros_like(pm[:, :1]), pm[:, :-1]], axis=1)
  edges = pm & (~other_m | (other != tid))
  return jnp.take_along_axis(edges, inverse, axis=1)


def _ends_of_turns(turn_id: jax.Array, mask: jax.Array) -> jax.Array:
  """bool[B, T]: the last policy token of each turn."""
  return _turn_edges(turn_id, mask, "last")
