"""LoRA: low-rank adapters on any model definition, chosen by parameter path.

A LoRA model is another model definition (`lm.CausalLM`), `LoraLM(base, spec)`,
whose params are `{"base": the base model's params, "lora": the adapters}`. Every
pass merges the adapters into the weights they adapt, W + (alpha / rank) * B @ A,
and runs the base definition on the result, so the trainers, the sampler, scoring,
the multi-turn loops and the sharding rules run on it unchanged. The base weights
pass through `stop_gradient`: their gradient is zero, and `optim.make_optimizer`
keeps optimizer moments for the adapters only (`trainable`, `with_trainable`).

Adapters are chosen by path in the base params ("layers/3/wq", "layer_0/attn/q_einsum/w"):
`LoraSpec.targets` names groups ("attention", "mlp", "all") or regular expressions.
Each adapted weight is read as a matrix [out, in] through its axes (`AXES`): the
project's transformer stores [out, in] (stacked: [L, out, in], a pair per layer),
Gemma's einsum weights mix heads and widths, a Flax `Dense` kernel is [in, out].
A pattern may say its axes after an "@": "dense_0/kernel@io" (letters b: a batch
of independent matrices, o: out, i: in, one per dimension).

The adapters mirror the base tree (the same nesting, only the adapted leaves), each
`{"a": f32[..., r, in], "b": f32[..., out, r]}` as PEFT's lora_A / lora_B: A drawn
uniform in +-1/sqrt(in), B zero, so a new LoRA model is exactly its base. The
reference policy of a KL term is the base with the adapters off (`reference_params`),
with no second copy of the weights.

Why not qwix's `LoraProvider`: it rewrites Flax linen / NNX modules (it intercepts
their dot_generals and creates the adapters in the module's parameter scope). The
project's transformer is plain functions over a dict, which it cannot wrap; merging
by path serves that transformer, Gemma and a user's Flax module alike. Dropout on
the adapters' input needs the unmerged product x A^T B^T, so it is not offered yet.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_agents.models import lm

Params = Any

# Target groups: the project's transformer's names, then Gemma's (the gemma library's).
GROUPS = {
    "attention": (r"(^|/)(wq|wk|wv|wo|wqkv)$",
                  r"(^|/)attn/(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum)/w$"),
    "mlp": (r"(^|/)(w_gate|w_up|w_down|w_gate_up)$", r"(^|/)mlp/(gating_einsum|linear)$"),
}
GROUPS["all"] = GROUPS["attention"] + GROUPS["mlp"]

# How a weight reads as a matrix, one letter per dimension (b: batch, o: out, i: in); for
# "oi" any leading dimensions are batch (the stacked layout's layers). First match wins.
AXES: tuple[tuple[str, str], ...] = (
    (r"(^|/)(wq|wk|wv|wo|wqkv|w_gate|w_up|w_down|w_gate_up)$", "oi"),  # [(L,) out, in]
    (r"(^|/)q_einsum/w$", "oio"),  # [N, D, H]
    (r"(^|/)(kv_einsum|qkv_einsum)/w$", "boio"),  # [2 or 3, K, D, H]: k, v (, q) apart
    (r"(^|/)attn_vec_einsum/w$", "iio"),  # [N, H, D]
    (r"(^|/)mlp/linear$", "io"),  # [F, D]
    (r"(^|/)kernel$", "io"),  # a Flax Dense kernel [in, out]
)
GATING = r"(^|/)mlp/gating_einsum$"  # Gemma's [2, F, D], or [2, D, F] untransposed


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What to adapt and how much (config.lora).

  Attributes:
    rank: r, the adapters' inner width.
    alpha: the update's scale is alpha / rank (PEFT's lora_alpha).
    targets: group names (GROUPS) or path regexes, each optionally "@" + axes.
    dropout: must be 0 (see the module docstring).
  """

  rank: int
  alpha: float = 16.0
  targets: tuple[str, ...] = ("all",)
  dropout: float = 0.0

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
    if self.dropout:
      raise ValueError(f"lora.dropout={self.dropout}: adapters are merged into the weights, "
                       "which leaves no adapter input to drop; set it to 0")
    if isinstance(self.targets, str) or not self.targets:
      raise ValueError(f"lora.targets must be a non-empty tuple of group names "
                       f"{sorted(GROUPS)} or path patterns, got {self.targets!r}")
    for target in self.targets:
      pattern, _, axes = target.partition("@")
      close = difflib.get_close_matches(pattern, GROUPS, n=1, cutoff=0.8)
      if pattern not in GROUPS and close:  # a misspelt group, not a weight's name
        raise ValueError(f"lora.targets: {pattern!r} is not a group; did you mean "
                         f"{close[0]!r}? (groups {sorted(GROUPS)}, or path patterns)")
      if pattern not in GROUPS:
        try:
          re.compile(pattern)
        except re.error as e:
          raise ValueError(f"lora.targets: {pattern!r} is neither a group {sorted(GROUPS)} "
                           f"nor a regular expression ({e})") from None
      if axes and (set(axes) - set("boi") or "o" not in axes or "i" not in axes):
        raise ValueError(f"lora.targets: {target!r}: the axes after '@' are one letter per "
                         "dimension, b (batch), o (out) or i (in), with at least one o and i")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def patterns(self) -> tuple[tuple[str, str], ...]:
    """(path regex, axes or "") pairs, the groups expanded."""
    out = []
    for target in self.targets:
      pattern, _, axes = target.partition("@")
      out.extend((p, axes) for p in GROUPS.get(pattern, (pattern,)))
    return tuple(out)


def spec_from_config(block) -> LoraSpec | None:
  """The LoraSpec of a config.lora block ({rank, alpha, targets, dropout}); None when rank is 0
  or the block is absent."""
  if block is None or not block.get("rank", 0):
    return None
  targets = block.get("targets", ("all",))
  targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) \
      else tuple(targets)
  return LoraSpec(rank=block["rank"], alpha=float(block.get("alpha", 16.0)), targets=targets,
                  dropout=float(block.get("dropout", 0.0)))


# ----------------------------------------------------------------------------
# Which weights, read how.

def _join(path: str, key) -> str:
  return f"{path}/{key}" if path else str(key)


def _axes(path: str, shape: tuple[int, ...], given: str, parent: dict) -> str:
  """One letter per dimension of the weight at `path` (see AXES)."""
  axes = given
  if not axes and re.search(GATING, path):
    linear = parent.get("linear")
    f = None if linear is None else linear.shape[0]
    axes = "bio" if f is not None and shape[2] == f and shape[1] != f else "boi"
  if not axes:
    axes = next((a for pattern, a in AXES if re.search(pattern, path)), "")
  if not axes:
    raise ValueError(f"lora: no known axes for the weight {path!r} {shape}; name them after "
                     "the pattern, e.g. 'dense/kernel@io' (b batch, o out, i in)")
  if axes == "oi" and len(shape) >= 2:
    axes = "b" * (len(shape) - 2) + axes
  if len(axes) != len(shape):
    raise ValueError(f"lora: axes {axes!r} do not fit the weight {path!r} of shape {shape}")
  return axes


def _matrix_shapes(shape, axes) -> tuple[tuple[int, ...], int, int]:
  batch = tuple(n for n, a in zip(shape, axes, strict=True) if a == "b")
  out = math.prod(n for n, a in zip(shape, axes, strict=True) if a == "o")
  inn = math.prod(n for n, a in zip(shape, axes, strict=True) if a == "i")
  return batch, out, inn


def targeted(base: Params, spec: LoraSpec) -> dict[str, str]:
  """{path: axes} of the weights `spec` adapts in `base` (arrays or shape structs).

  Raises ValueError when nothing matches (naming a few of the paths there are)."""
  patterns = [(re.compile(p), a) for p, a in spec.patterns()]
  found = {}

  def visit(node, path, parent):
    if isinstance(node, dict):
      for k, v in node.items():
        visit(v, _join(path, k), node)
    elif isinstance(node, list | tuple):
      for i, v in enumerate(node):
        visit(v, _join(path, i), {})
    elif hasattr(node, "shape"):
      for pattern, given in patterns:
        if pattern.search(path):
          found[path] = _axes(path, tuple(node.shape), given, parent)
          break

  visit(base, "", {})
  if not found:
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(base)[0]]
    raise ValueError(f"lora.targets {spec.targets} match no weight of the model; its weights "
                     f"include {paths[:8]}")
  return found


# ----------------------------------------------------------------------------
# Adapters.

def init(rng: jax.Array, base: Params, spec: LoraSpec) -> Params:
  """Adapters for `base`: the base tree's nesting with each targeted weight replaced by
  {"a": U(+-1/sqrt(in)) [..., r, in], "b": zeros [..., out, r]} (f32)."""
  found = targeted(base, spec)
  keys = dict(zip(sorted(found), jax.random.split(rng, len(found)), strict=True))

  def leaf(path, w):
    batch, out, inn = _matrix_shapes(w.shape, found[path])
    bound = 1.0 / math.sqrt(inn)
    a = jax.random.uniform(keys[path], (*batch, spec.rank, inn), jnp.float32, -bound, bound)
    return {"a": a, "b": jnp.zeros((*batch, out, spec.rank), jnp.float32)}

  return _mirror(base, found, leaf)


def _mirror(base, found, leaf, path=""):
  """The adapted part of `base`'s nesting, `leaf(path, weight)` at each found path; lists
  keep every entry (a layer without adapters is an empty dict)."""
  def child(k, v):
    p = _join(path, k)
    return leaf(p, v) if p in found else _mirror(v, found, leaf, p)

  if isinstance(base, dict):
    return {k: child(k, v) for k, v in base.items()
            if any(f == _join(path, k) or f.startswith(_join(path, k) + "/") for f in found)}
  if isinstance(base, list | tuple):
    return [child(i, v) for i, v in enumerate(base)]
  return {}


def delta(a: jax.Array, b: jax.Array, shape: tuple[int, ...], axes: str, scale: float
          ) -> jax.Array:
  """scale * B @ A (f32) laid out as the weight of `shape` whose dimensions `axes` name."""
  order = ([i for i, x in enumerate(axes) if x == "b"] + [i for i, x in enumerate(axes) if x == "o"]
           + [i for i, x in enumerate(axes) if x == "i"])
  d = scale * jnp.matmul(b, a, preferred_element_type=jnp.float32)  # [*batch, out, in]
  d = d.reshape(tuple(shape[i] for i in order))
  return jnp.transpose(d, tuple(order.index(i) for i in range(len(shape))))


def merge(base: Params, adapters: Params | None, spec: LoraSpec) -> Params:
  """The base params with every adapter merged: W + (alpha / rank) B @ A, in f32, cast back
  to W's dtype. `adapters` None gives `base` itself."""
  return base if adapters is None else materialize(adapted(base, adapters, spec))


@jax.tree_util.register_pytree_node_class
class Adapted:
  """A weight with its adapters, merged where a layer reads it (`materialize`), not before.

  A model whose layers run under one `lax.scan` (the stacked transformer) slices this
  like any leaf, so each layer merges its own slice: neither the merged [L, ...] weights
  nor their gradient exist whole, only one layer's at a time (benchmarks/lora_memory.py).
  `axes` are the whole weight's; a slice drops their leading batch letters."""

  def __init__(self, w, a, b, axes: str, scale: float):
    self.w, self.a, self.b, self.axes, self.scale = w, a, b, axes, scale

  shape = property(lambda self: self.w.shape)
  dtype = property(lambda self: self.w.dtype)

  def tree_flatten(self):
    return (self.w, self.a, self.b), (self.axes, self.scale)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  def merged(self) -> jax.Array:
    axes = self.axes[len(self.axes) - self.w.ndim:]
    d = delta(self.a, self.b, tuple(self.w.shape), axes, self.scale)
    return (self.w.astype(jnp.float32) + d).astype(self.w.dtype)


def materialize(tree: Any) -> Any:
  """`tree` with every `Adapted` weight merged (a model's layer calls this on its params)."""
  is_adapted = lambda n: isinstance(n, Adapted)
  return jax.tree.map(lambda n: n.merged() if is_adapted(n) else n, tree, is_leaf=is_adapted)


def adapted(base: Params, adapters: Params, spec: LoraSpec) -> Params:
  """`merge` deferred: each adapted weight an `Adapted` for the model to `materialize`."""
  def visit(node, adapt, path, parent):
    if isinstance(adapt, dict) and not adapt:
      return node
    if isinstance(adapt, dict) and set(adapt) == {"a", "b"} and hasattr(node, "shape"):
      axes = _axes(path, tuple(node.shape), _given_axes(spec, path), parent)
      return Adapted(node, adapt["a"], adapt["b"], axes, spec.scale)
    if isinstance(node, dict):
      return {k: (visit(v, adapt[k], _join(path, k), node) if k in adapt else v)
              for k, v in node.items()}
    if isinstance(node, list | tuple):
      return type(node)(visit(v, a, _join(path, i), {})
                        for i, (v, a) in enumerate(zip(node, adapt, strict=True)))
    raise ValueError(f"lora: the adapters do not fit the model at {path!r}")

  return visit(base, adapters, "", {})


def _given_axes(spec: LoraSpec, path: str) -> str:
  return next((a for p, a in spec.patterns() if re.search(p, path)), "")


# ----------------------------------------------------------------------------
# The model definition, and what the optimizer and the reference read of its params.

def is_lora_params(node: Any) -> bool:
  return isinstance(node, dict) and set(node) == {"base", "lora"}


def trainable(tree: Any) -> Any:
  """`tree` (params, or a pytree of their shape: gradients, updates) with each LoRA node
  {"base", "lora"} replaced by its adapters: what the optimizer keeps moments for."""
  if is_lora_params(tree):
    return tree["lora"]
  if isinstance(tree, dict):
    return {k: trainable(v) for k, v in tree.items()}
  return tree


def with_trainable(like: Any, part: Any) -> Any:
  """`like`'s structure with the trainable part from `part` and zeros of `like`'s frozen
  leaves (the updates of frozen base weights)."""
  if is_lora_params(like):
    return {"base": jax.tree.map(jnp.zeros_like, like["base"]), "lora": part}
  if isinstance(like, dict):
    return {k: with_trainable(v, part[k]) for k, v in like.items()}
  return part


def has_adapters(tree: Any) -> bool:
  if is_lora_params(tree):
    return True
  return isinstance(tree, dict) and any(has_adapters(v) for v in tree.values())


def reference_params(params: Params) -> Params:
  """The base policy within LoRA params: the same base arrays, adapters off (no copy)."""
  if is_lora_params(params):
    return {"base": params["base"], "lora": None}
  if isinstance(params, dict):
    return {k: reference_params(v) for k, v in params.items()}
  return params


def without_base(tree: Any) -> tuple[Any, list[Params]]:
  """(`tree` with each LoRA node's base weights replaced by None, those bases in order): a
  checkpoint holds the adapters, and a restore takes the bases from the model it loads."""
  bases = []

  def strip(node):
    if is_lora_params(node):
      bases.append(node["base"])
      return {"base": None, "lora": node["lora"]}
    return node

  return jax.tree.map(strip, tree, is_leaf=is_lora_params), bases


def with_base(tree: Any, bases: list[Params]) -> Any:
  """`without_base` undone: each LoRA node's base from `bases`, in order."""
  it = iter(bases)
  out = jax.tree.map(lambda node: {"base": next(it), "lora": node["lora"]}
                     if is_lora_params(node) else node, tree, is_leaf=is_lora_params)
  if next(it, None) is not None:
    raise ValueError("with_base: more bases than LoRA nodes")
  return out


def laid_out_like(base: Params, adapters: Params) -> Params:
  """The base model's params in its adapters' layout: stacked ([L, ...] leaves,
  `transformer.stack_layers`) where the adapters were trained on stacked layers."""
  from jaxrl_agents.models import transformer  # here: the transformer does not import lora

  if (isinstance(adapters, dict) and isinstance(adapters.get("layers"), dict)
      and isinstance(base, dict) and isinstance(base.get("layers"), list)):
    return transformer.stack_layers(base)
  return base


def reference_copy(params: Params) -> Params | None:
  """What a train state keeps as its frozen reference policy: a copy of `params`, or None
  for LoRA params, whose reference is their own base (`reference`)."""
  return None if has_adapters(params) else jax.tree.map(jnp.copy, params)


def reference(kept: Params | None, params: Params) -> Params:
  """The reference policy's params: the copy a train state kept (`reference_copy`), else the
  base inside `params` with the adapters off."""
  return kept if kept is not None else reference_params(params)


@dataclasses.dataclass(frozen=True)
class LoraLM:
  """`base` with adapters (see the module docstring). Params: {"base": ..., "lora": ...};
  "lora" None runs the base alone (the reference, and params already merged for decoding)."""

  base: Any
  spec: LoraSpec

  def __post_init__(self):
    lm.check_definition(self.base)

  # The contract's fields are the base's.
  vocab_size = property(lambda self: self.base.vocab_size)
  d_model = property(lambda self: self.base.d_model)
  n_layers = property(lambda self: self.base.n_layers)
  max_seq_len = property(lambda self: self.base.max_seq_len)
  dtype = property(lambda self: self.base.dtype)
  param_dtype = property(lambda self: self.base.param_dtype)
  activation_mesh = property(lambda self: self.base.activation_mesh)

  def merged(self, params: Params, per_layer: bool = False) -> Params:
    """The base's params with the adapters merged; the base weights get no gradient. With
    `per_layer`, where the base merges `Adapted` weights in its layers
    (`merges_adapters_per_layer`), each layer merges its own when it runs."""
    base = jax.lax.stop_gradient(params["base"])
    if params["lora"] is None:
      return base
    if per_layer and getattr(self.base, "merges_adapters_per_layer", False):
      return adapted(base, params["lora"], self.spec)
    return merge(base, params["lora"], self.spec)

  def init(self, rng: jax.Array) -> Params:
    base_rng, lora_rng = jax.random.split(rng)
    base = self.base.init(base_rng)
    return {"base": base, "lora": init(lora_rng, base, self.spec)}

  def apply(self, params: Params, tokens: jax.Array, positions: jax.Array, **kwargs):
    # A pass that fills a cache reads the weights per layer outside the layers' loop.
    per_layer = kwargs.get("cache") is None and kwargs.get("new_cache_len") is None
    return self.base.apply(self.merged(params, per_layer), tokens, positions, **kwargs)

  def lm_head(self, params: Params, hidden: jax.Array) -> jax.Array:
    return self.base.lm_head(self.merged(params), hidden)

  def decode_step(self, params: Params, tokens: jax.Array, positions: jax.Array, cache,
                  vocab_major: bool = False):
    return self.base.decode_step(self.merged(params), tokens, positions, cache,
                                 vocab_major=vocab_major)

  def init_cache(self, batch_size: int, max_len: int, dtype: str | None = None):
    return self.base.init_cache(batch_size, max_len, dtype)

  def loop_params(self, params: Params) -> Params:
    """Merged once before a decoding loop, not at every token (`lm.loop_params`)."""
    return {"base": lm.loop_params(self.base, self.merged(params)), "lora": None}

  def decoding_params(self, params: Params, rows: int) -> Params:
    return {"base": self.base.decoding_params(self.merged(params), rows), "lora": None}

  def replace(self, **changes) -> LoraLM:
    return dataclasses.replace(self, base=self.base.replace(**changes))

  @property
  def apply_shared_prefix(self):
    """The base's `apply_shared_prefix` on merged params, where the base has one (an
    AttributeError otherwise, so `hasattr` says whether the contract's option is there)."""
    shared = self.base.apply_shared_prefix  # AttributeError: not offered

    def call(params, *args, **kwargs):
      return shared(self.merged(params, per_layer=True), *args, **kwargs)
    return call

  def __getattr__(self, name):
    # Settings of the base a caller may read (attention, remat, head_dim, ...); never its
    # methods, which would run on params they do not understand.
    if name.startswith("__") or name in ("base", "spec"):
      raise AttributeError(name)
    value = getattr(self.base, name)
    if callable(value):
      raise AttributeError(f"LoraLM has no {name!r} (the base's method would see LoRA params)")
    return value


def wrap(model, spec: LoraSpec, rng: jax.Array):
  """A loaded `zoo.Model` with new adapters: its cfg a LoraLM, its params {"base", "lora"}."""
  model.params = {"base": model.params, "lora": init(rng, model.params, spec)}
  model.cfg = LoraLM(model.cfg, spec)
  return model
