"""Shape checks shared by the objectives: fail early with the argument named."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def check_rank(name: str, x, rank: int | Sequence[int]) -> None:
  """Raises ValueError naming `name` unless `x.ndim` is one of `rank`."""
  ranks = (rank,) if isinstance(rank, int) else tuple(rank)
  if jnp.ndim(x) not in ranks:
    expected = " or ".join(str(r) for r in ranks)
    raise ValueError(
        f"{name} must have rank {expected}, got shape {tuple(jnp.shape(x))}")


def check_same_shape(names_and_arrays: Sequence[tuple[str, object]]) -> None:
  """Raises ValueError naming the first argument whose shape differs from the first one."""
  ref_name, ref = names_and_arrays[0]
  for name, x in names_and_arrays[1:]:
    if jnp.shape(x) != jnp.shape(ref):
      raise ValueError(
          f"{name} has shape {tuple(jnp.shape(x))} but {ref_name} has shape "
          f"{tuple(jnp.shape(ref))}; they must match")


def check_bt(**arrays) -> None:
  """Each keyword array must be rank 2 ([B, T]) and all shapes must agree."""
  for name, x in arrays.items():
    check_rank(name, x, 2)
  check_same_shape(list(arrays.items()))
