"""Device meshes and sharding rules: the same jitted functions on one device or many.

A mesh has three named axes (`AXES`):

  data    batch rows split across devices; parameters replicated along it
  fsdp    batch rows split too, and each weight's input dimension (ZeRO-3 /
          FSDP: a device holds 1/fsdp of every weight and its optimizer
          moments; the compiler gathers a layer's weight when it is used)
  tensor  each weight's output dimension (Megatron-style: attention heads and
          MLP columns), with the matching input dimension of the projection back

`mesh_from_config({"data": 1, "fsdp": -1, "tensor": 1})` builds one (-1 takes
the devices left over); the default, every axis 1, is one device and changes
nothing. Sharding is data, not code: `RULES` maps a leaf's path in the
parameter tree ("layers/3/wq") to the mesh axis of each of its dimensions, and
the same rules shard the optimizer state, whose moments sit under paths that
end the same way ("opt_state/0/mu/layers/3/wq"). A dimension the axis size
does not divide stays whole on every device, so any model runs on any mesh.
Batches are split by rows over data x fsdp (`batch_sharding`).

Nothing here communicates by hand: arrays are placed with `jax.device_put`
(or created in place by `init_sharded`: `jax.eval_shape`, then `jax.jit` with
`out_shardings`, so a full copy never sits on one device), and `jax.jit`
propagates the shardings through every computation (GSPMD).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (path regex, the mesh axis of each dimension). Weights are stored [out, in].
RULES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    (r"(^|/)(embed|lm_head)$", ("tensor", "fsdp")),  # [V, D]: vocabulary over tensor
    (r"(^|/)(wq|wk|wv|w_gate|w_up)$", ("tensor", "fsdp")),  # [heads * dh or F, D]
    (r"(^|/)(wo|w_down)$", ("fsdp", "tensor")),  # [D, heads * dh or F]
    (r"(^|/)(bq|bk|bv)$", ("tensor",)),  # Qwen2's q/k/v biases
    # Gemma (`models/gemma.py`, the gemma library's names), weights stored [in, out]-wise
    # per head: heads and MLP columns over tensor, the model width over fsdp.
    (r"(^|/)embedder/input_embedding$", ("tensor", "fsdp")),  # [V, D]
    (r"(^|/)q_einsum/w$", ("tensor", "fsdp")),  # [N, D, H]
    (r"(^|/)(kv_einsum|qkv_einsum)/w$", (None, "tensor", "fsdp")),  # [2 or 3, K or N, D, H]
    (r"(^|/)attn_vec_einsum/w$", ("tensor", None, "fsdp")),  # [N, H, D]
    (r"(^|/)mlp/gating_einsum$", (None, "tensor", "fsdp")),  # [2, F, D]
    (r"(^|/)mlp/linear$", ("tensor", "fsdp")),  # [F, D]
    # LoRA adapters of the transformer's weights (models/lora.py): A [r, in] splits its
    # input like the weight does, B [out, r] its output; the rank stays whole.
    (r"(^|/)(wq|wk|wv|w_gate|w_up)/a$", (None, "fsdp")),
    (r"(^|/)(wq|wk|wv|w_gate|w_up)/b$", ("tensor", None)),
    (r"(^|/)(wo|w_down)/a$", (None, "tensor")),
    (r"(^|/)(wo|w_down)/b$", ("fsdp", None)),
)


# The KV cache (`transformer.KVCache`): rows over data x fsdp, key/value heads over tensor.
CACHE_RULES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    (r"(^|/)(k|v)/\d+$", (BATCH_AXES, "tensor")),  # [B, K, Dh, S] and [B, K, S, Dh]
    (r"(^|/)valid$", (BATCH_AXES,)),
)


def mesh_shape(spec: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
  """{axis: size} for `spec` ({axis: size}, one size may be -1: the devices left over)."""
  spec = dict(spec or {})
  unknown = sorted(set(spec) - set(AXES))
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; the axes are {AXES}")
  sizes = {axis: int(spec.get(axis, 1)) for axis in AXES}
  fill = [axis for axis, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ValueError(f"only one mesh axis may be -1, got {fill}")
  bad = [axis for axis, size in sizes.items() if size < 1 and size != -1]
  if bad:
    raise ValueError(f"mesh axis sizes must be >= 1 (or -1 for the rest), got "
                     f"{ {a: sizes[a] for a in bad} }")
  known = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if num_devices % known:
      raise ValueError(f"{num_devices} devices do not split into {sizes}")
    sizes[fill[0]] = num_devices // known
  if math.prod(sizes.values()) > num_devices:
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices; "
                     f"{num_devices} are available")
  return sizes


def mesh_from_config(spec: Mapping[str, int] | None = None,
                     devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over the first prod(sizes) of `devices` (default: every device of every
  process), axes `AXES` in that order."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(spec, len(devices))
  n = math.prod(sizes.values())
  grid = np.asarray(devices[:n], dtype=object).reshape(tuple(sizes[a] for a in AXES))
  return Mesh(grid, AXES)


def for_config(config) -> Mesh | None:
  """The mesh of `config.mesh` ({axis: size}); None (one device, nothing placed) when it is
  absent or has a single device."""
  spec = dict(config.get("mesh", None) or {})
  devices = math.prod(mesh_shape(spec, jax.device_count()).values())
  if jax.process_count() > 1 and devices != jax.device_count():
    # A mesh short of some process's devices would leave that process's arrays its own,
    # which no checkpoint of the run can hold.
    raise ValueError(f"{jax.process_count()} processes with {jax.device_count()} devices in "
                     f"all: config.mesh {mesh_shape(spec, jax.device_count())} must use every "
                     "device (set one axis to -1, e.g. --config.mesh.data=-1)")
  if devices == 1:
    return None
  return mesh_from_config(spec)


def mesh_of(tree: Any) -> Mesh | None:
  """The mesh of several devices `tree`'s arrays are placed on (the first leaf with a
  NamedSharding), or None: the params tell a rollout where to split its rows."""
  for leaf in jax.tree.leaves(tree):
    placed = getattr(leaf, "sharding", None)
    if isinstance(placed, NamedSharding) and placed.mesh.size > 1:
      return placed.mesh
  return None


def path_name(path) -> str:
  """"layers/3/wq" for a pytree key path."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def spec_for(name: str, shape: Sequence[int], mesh: Mesh | Mapping[str, int],
             rules: Sequence[tuple[str, Sequence[Any]]] = RULES) -> PartitionSpec:
  """The PartitionSpec of a leaf: the first rule matching its path. An axis whose
  dimension it does not divide moves to the largest free dimension it divides, else is
  dropped (the array stays whole along it); a size-1 axis is never named. A rule's entry
  may name several axes for one dimension (rows over data x fsdp). `mesh` is a Mesh or
  its {axis: size} (to plan for devices this process does not have)."""
  sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
  for pattern, axes in rules:
    if re.search(pattern, name):
      if len(shape) == len(axes) + 1 and re.search(r"(^|/)layers/[^/]+(/[ab])?$", name):
        axes = (None, *axes)  # the stacked layout's leading layer axis stays whole
      if len(axes) > len(shape):
        return PartitionSpec()  # e.g. a scalar where the rule expects a matrix
      dims: list[Any] = [None] * len(shape)
      homeless = []
      for i, axis in enumerate(axes):
        names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        split = math.prod(sizes[a] for a in names)
        if split > 1 and shape[i] % split == 0:
          dims[i] = axis
        elif split > 1:
          homeless.append((axis, split))
      # An axis its dimension cannot take goes to another free dimension it divides
      # (SmolLM2's d = 576 does not split 256 ways; its vocabulary of 49152 does).
      for axis, split in homeless:
        free = [i for i in range(len(shape)) if dims[i] is None and shape[i] % split == 0]
        if free:
          dims[max(free, key=lambda i: shape[i])] = axis
      while dims and dims[-1] is None:
        dims.pop()
      return PartitionSpec(*dims)
  return PartitionSpec()


def shard_count(spec: PartitionSpec, mesh: Mesh | Mapping[str, int]) -> int:
  """Into how many pieces `spec` splits an array on `mesh` (its size over one device's)."""
  sizes = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
  count = 1
  for entry in spec:
    for axis in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
      count *= sizes[axis]
  return count


def shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Sequence[Any]]] = RULES) -> Any:
  """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs; None stays None)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, spec_for(path_name(path), np.shape(x), mesh, rules)),
      tree)


def shard(tree: Any, mesh: Mesh | None,
          rules: Sequence[tuple[str, Sequence[Any]]] = RULES) -> Any:
  """`tree` placed on `mesh` by the rules (parameters, optimizer state, a train state);
  unchanged when `mesh` is None (one device)."""
  if mesh is None:
    return tree
  return jax.device_put(tree, shardings(tree, mesh, rules))


def init_sharded(init_fn: Callable[..., Any], mesh: Mesh, *args,
                 rules: Sequence[tuple[str, Sequence[Any]]] = RULES) -> Any:
  """`init_fn(*args)` created in place on `mesh`: shapes from `jax.eval_shape`, then the
  jitted init with `out_shardings`, so no device ever holds the whole result."""
  abstract = jax.eval_shape(init_fn, *args)
  return jax.jit(init_fn, out_shardings=shardings(abstract, mesh, rules))(*args)


def batch_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """Rows over data x fsdp when they divide evenly, else replicated."""
  rows = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if not shape or rows == 1 or shape[0] % rows:
    return PartitionSpec()
  return PartitionSpec(BATCH_AXES)


def shard_batch(tree: Any, mesh: Mesh | None, rows: int | None = None) -> Any:
  """The arrays of `tree` split by their leading (row) axis over data x fsdp: all of them,
  or with `rows` only those with that many rows (the rest, e.g. state carried in a batch,
  stay where they are). Unchanged when `mesh` is None (one device)."""
  if mesh is None:
    return tree

  def place(x):
    if rows is not None and (not np.shape(x) or np.shape(x)[0] != rows):
      return x
    return jax.device_put(x, NamedSharding(mesh, batch_spec(np.shape(x), mesh)))

  return jax.tree.map(place, tree)


def bytes_per_device(tree: Any) -> int:
  """The most bytes of `tree`'s arrays that any one device holds."""
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for s in leaf.addressable_shards:
      per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
  return max(per_device.values(), default=0)
