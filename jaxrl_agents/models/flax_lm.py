"""Any Flax language model behind the model contract (`lm.CausalLM`).

`FlaxLM` wraps a Flax linen module (`FlaxLM.linen`), or an NNX module through
`nnx.split`/`nnx.merge` (`FlaxLM.nnx`), so that GRPO, PPO, the multi-turn
loops, scoring and the heads run on it unchanged. The params are a plain
nested dict either way (the linen module's "params" collection, the NNX
module's state as `to_pure_dict()`), so the optimizer, checkpoints and
sharding rules treat them like the project's own transformer's.

What the wrapped module provides, in one of two forms:

A cached model (`cached=True`), the fast path:

    __call__(tokens int[B, T], positions int[B, T], attention_mask bool[B, T, S],
             kv=None, write_index=None) -> (hidden f[B, T, D], kv)
    logits(hidden f[..., D]) -> f32[..., V]
    init_kv(batch_size, max_len, dtype) -> kv      # an empty cache; no params used

    Without `kv`, S == T and the mask is the T tokens' own. With `kv` (S slots a
    row), the module writes the T new keys and values at slots
    [write_index, write_index + T) of every row and attends under the mask; it
    returns the updated kv. `jaxrl_agents.models.gemma.Gemma` is one.

A model without a cache (`cached=False`): only

    __call__(tokens, positions, attention_mask) -> hidden f[B, T, D]
    logits(hidden) -> f32[..., V]

    The adapter's cache then holds the tokens and positions, and every pass
    with a cache reruns the model over all S slots and keeps the T new
    columns: decoding N tokens after a prompt of P costs N full passes over
    P + N slots instead of N one-token steps. Correct, slower: a model that
    only needs to be tried, or checked, runs this way.

The adapter builds every attention mask itself from the contract's segment ids
and cache validity (causal, within a segment, never onto padding; a padding
query sees itself so no softmax row is empty), so a module needs no notion of
padding. Masks mark slots, positions say where each token is: a module that
attends by position (a sliding window, say) compares positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents.models import lm

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class FlaxCache(NamedTuple):
  """A cached model's state: its own kv pytree (batch-major leaves), and the contract's
  slot bookkeeping."""

  kv: Any
  valid: jax.Array  # bool[B, S]
  index: jax.Array  # int32[] the next slot every row writes


class TokenCache(NamedTuple):
  """The cache of a model without one: the tokens and positions so far, recomputed each pass."""

  tokens: jax.Array  # int32[B, S]
  positions: jax.Array  # int32[B, S]
  valid: jax.Array  # bool[B, S]
  index: jax.Array  # int32[]


def _see_self(allowed: jax.Array, start) -> jax.Array:
  """bool[B, T, S] `allowed` with each query (at slot start + i) also seeing its own slot:
  a padding query then has a non-empty softmax row; a real one sees itself already."""
  t, slots = allowed.shape[1:]
  return allowed | (jnp.arange(slots)[None, :] == (start + jnp.arange(t))[:, None])[None]


@dataclasses.dataclass(frozen=True)
class FlaxLM:
  """A Flax language model as a model definition (see the module docstring).

  Build one with `FlaxLM.linen(module, ...)` or `FlaxLM.nnx(factory, ...)`.

  Attributes:
    module: the linen module, or the NNX module's GraphDef.
    vocab_size: V.
    d_model: D, the width of the hidden states `__call__` returns (what heads read).
    n_layers: the depth (informational: reports and plans).
    max_seq_len: the longest context the model was trained for (prompts longer
      than it are refused).
    cached: the module takes and returns a kv cache (else the recompute path).
    make: NNX only: `make(rngs)` builds the module (for `init`).
    dtype: compute dtype name; a linen module with a `dtype` field gets it.
    param_dtype: storage dtype name of the params.
    activation_mesh: the mesh set by `zoo.load(mesh=...)`; the adapter leaves
      activation sharding to the compiler.
  """

  module: Any
  vocab_size: int
  d_model: int
  n_layers: int
  max_seq_len: int = 8192
  cached: bool = True
  make: Callable[..., Any] | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  activation_mesh: Any = None

  def __post_init__(self):
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
    if self.is_nnx:
      if (self.dtype, self.param_dtype) != ("float32", "float32"):
        raise ValueError("an NNX model computes and stores in the dtypes its `make` gives it; "
                         "build it in the dtype you want and leave dtype/param_dtype float32")
      return
    # A linen module with dtype fields runs in the definition's dtypes, whichever way the
    # definition was built (the constructor, `replace`, `dataclasses.replace`), so that equal
    # definitions hold equal modules and hash alike (jit caches by them).
    fields = {name: jnp.dtype(_DTYPES[getattr(self, name)])
              for name in ("dtype", "param_dtype") if hasattr(self.module, name)}
    if any(getattr(self.module, name) != value for name, value in fields.items()):
      object.__setattr__(self, "module", self.module.clone(**fields))
    needs = ["logits"] + (["init_kv"] if self.cached else [])
    missing = [name for name in needs if not callable(getattr(self.module, name, None))]
    if missing:
      raise TypeError(f"{type(self.module).__name__} lacks {', '.join(missing)} "
                      "(see jaxrl_agents.models.flax_lm)"
                      + ("; a model without a KV cache takes cached=False" if self.cached
                         else ""))

  # ---------------------------------------------------------------- building

  @classmethod
  def linen(cls, module, *, vocab_size: int, d_model: int, n_layers: int, cached: bool = True,
            **kwargs) -> FlaxLM:
    """Wraps a linen module (see the module docstring for what it provides)."""
    return cls(module=module, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
               cached=cached, **kwargs)

  @classmethod
  def nnx(cls, make: Callable[..., Any], *, vocab_size: int, d_model: int, n_layers: int,
          cached: bool = True, **kwargs) -> tuple[FlaxLM, dict]:
    """(definition, params) for the NNX module `make(nnx.Rngs(0))` builds.

    `make` must be a module-level function (the definition is hashed and compared)."""
    from flax import nnx

    graphdef, params, rest = nnx.split(make(nnx.Rngs(0)), nnx.Param, ...)
    if jax.tree.leaves(rest):
      raise ValueError(
          "the NNX model holds state that is not nnx.Param (RNG streams, batch statistics: "
          f"{sorted(rest.to_pure_dict())}); the policy's state is its params only: build it "
          "without stored Rngs (deterministic dropout) or split that state off first")
    model = cls(module=graphdef, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                cached=cached, make=make, **kwargs)
    return model, params.to_pure_dict()

  @property
  def is_nnx(self) -> bool:
    return self.make is not None

  def replace(self, **changes) -> FlaxLM:
    return dataclasses.replace(self, **changes)  # __post_init__ re-types the module

  # ---------------------------------------------------------------- the module

  def _call(self, params, method: str | None, *args, **kwargs):
    if self.is_nnx:
      from flax import nnx

      model = nnx.merge(self.module, params)
      return (getattr(model, method) if method else model)(*args, **kwargs)
    return self.module.apply({"params": params}, *args, method=method, **kwargs)

  def _forward(self, params, tokens, positions, mask, kv=None, write_index=None):
    if not self.cached:
      return self._call(params, None, tokens, positions, mask), None
    return self._call(params, None, tokens, positions, mask, kv=kv, write_index=write_index)

  def init(self, rng: jax.Array):
    if self.is_nnx:
      from flax import nnx

      return nnx.split(self.make(nnx.Rngs(rng)), nnx.Param, ...)[1].to_pure_dict()
    cached = self.cached

    def forward_and_head(module, tokens, positions, mask):  # so the head's params exist too
      out = module(tokens, positions, mask)
      return module.logits(out[0] if cached else out)

    one = jnp.zeros((1, 1), jnp.int32)
    return self.module.init(rng, one, one, jnp.ones((1, 1, 1), bool),
                            method=forward_and_head)["params"]

  # ---------------------------------------------------------------- the contract

  def init_cache(self, batch_size: int, max_len: int, dtype: str | None = None):
    valid, index = jnp.zeros((batch_size, max_len), bool), jnp.zeros((), jnp.int32)
    if not self.cached:
      zeros = jnp.zeros((batch_size, max_len), jnp.int32)
      return TokenCache(tokens=zeros, positions=zeros, valid=valid, index=index)
    dt = _DTYPES[dtype or self.dtype]
    if self.is_nnx:  # a module of abstract arrays: init_kv reads its configuration only
      from flax import nnx

      kv = nnx.eval_shape(lambda: self.make(nnx.Rngs(0))).init_kv(batch_size, max_len, dt)
    else:
      kv = self.module.init_kv(batch_size, max_len, dt)
    return FlaxCache(kv=kv, valid=valid, index=index)

  def apply(self, params, tokens: jax.Array, positions: jax.Array, *,
            segment_ids: jax.Array | None = None, cache=None, return_hidden: bool = False,
            new_cache_len: int | None = None, cache_dtype: str | None = None,
            num_positions: int | None = None, remat: str | None = None):
    """The contract's forward (`lm` module docstring); `num_positions` and `remat` are
    hints this adapter does not use."""
    del num_positions, remat
    if tokens.ndim != 2 or positions.shape != tokens.shape:
      raise ValueError(f"tokens and positions must be int[B, T] of one shape, got "
                       f"{tokens.shape} and {positions.shape}")
    b, t = tokens.shape
    segment_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
    if segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {tokens.shape}")
    if cache is None and new_cache_len is None:
      hidden, _ = self._forward(params, tokens, positions,
                                _see_self(lm.attention_allowed(segment_ids), 0))
      new_cache = None
    else:
      fresh = cache is None
      if fresh:
        if new_cache_len < t:
          raise ValueError(f"new_cache_len {new_cache_len} < {t} tokens")
        cache = self.init_cache(b, new_cache_len, cache_dtype)
      elif new_cache_len is not None:
        raise ValueError("new_cache_len is for a prefill without a cache; got a cache too")
      if cache.valid.shape[0] != b:
        raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {b}")
      hidden, new_cache = self._cached_pass(params, tokens, positions, segment_ids, cache, fresh)
    if return_hidden:
      return hidden, new_cache
    return self.lm_head(params, hidden), new_cache

  def _cached_pass(self, params, tokens, positions, segment_ids, cache, fresh: bool):
    """The T tokens through the cache, at slots [index, index + T). A `fresh` cache (a
    prefill) keeps the cacheless rule, attention within a segment."""
    t, slots = tokens.shape[1], cache.valid.shape[1]
    start = cache.index
    valid = jax.lax.dynamic_update_slice(cache.valid, segment_ids != 0, (0, start))
    if self.cached:
      allowed = (jnp.pad(lm.attention_allowed(segment_ids), ((0, 0), (0, 0), (0, slots - t)))
                 if fresh else lm.cached_attention_allowed(valid, start, t))
      hidden, kv = self._forward(params, tokens, positions, _see_self(allowed, start), cache.kv,
                                 start)
      return hidden, FlaxCache(kv=kv, valid=valid, index=start + t)
    # Without a cache: rerun every slot, keep the T new columns.
    all_tokens = jax.lax.dynamic_update_slice(cache.tokens, tokens, (0, start))
    all_positions = jax.lax.dynamic_update_slice(cache.positions, positions, (0, start))
    allowed = (lm.attention_allowed(jnp.pad(segment_ids, ((0, 0), (0, slots - t)))) if fresh
               else lm.cached_attention_allowed(valid, jnp.int32(0), slots))
    hidden, _ = self._forward(params, all_tokens, all_positions, _see_self(allowed, 0))
    hidden = jax.lax.dynamic_slice_in_dim(hidden, start, t, axis=1)
    return hidden, TokenCache(tokens=all_tokens, positions=all_positions, valid=valid,
                              index=start + t)

  def lm_head(self, params, hidden: jax.Array) -> jax.Array:
    return self._call(params, "logits", hidden).astype(jnp.float32)

  def decode_step(self, params, tokens: jax.Array, positions: jax.Array, cache,
                  vocab_major: bool = False):
    if tokens.ndim != 1 or positions.shape != tokens.shape:
      raise ValueError(f"tokens and positions must be int[B], got {tokens.shape} and "
                       f"{positions.shape}")
    logits, cache = self.apply(params, tokens[:, None], positions[:, None], cache=cache)
    logits = logits[:, 0]
    return (logits.T if vocab_major else logits), cache

  def decoding_params(self, params, rows: int):
    del rows
    return params
