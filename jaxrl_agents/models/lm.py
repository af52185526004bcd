"""The model contract: what the sampler, scoring, losses, heads and sharding need from a policy.

A model is two objects:

- `params`, a pytree of arrays. Nested dicts read best: the sharding rules
  (`sharding.RULES`) and checkpoints name leaves by their path, and the
  optimizer, the checkpoints and the losses treat the tree as opaque.
- a model definition, called `cfg` throughout the library: an immutable,
  hashable object that says how to run `params`. It is passed to `jax.jit` as a
  static argument, so two equal definitions share compiled programs.

The definition provides (`CausalLM`):

| member | what |
|---|---|
| `vocab_size`, `d_model`, `n_layers` | V, the hidden width heads read (D), the depth |
| `max_seq_len` | the longest context the model was trained for |
| `dtype`, `param_dtype` | compute and storage dtype names ("float32", "bfloat16") |
| `activation_mesh` | None, or the mesh whose data x fsdp axes split activation rows |
| `init(rng)` | random params |
| `apply(params, tokens, positions, ...)` | the forward pass, with or without a cache (below) |
| `lm_head(params, hidden)` | f32 logits from `apply(..., return_hidden=True)`'s hidden states |
| `decode_step(params, tokens, positions, cache)` | one token per row through the cache |
| `init_cache(batch, max_len)` | an empty cache of `max_len` slots per row |
| `decoding_params(params, rows)` | the params layout decoding `rows` rows runs fastest with |
| `replace(**changes)` | a copy with fields changed (`dtype`, `param_dtype`, `activation_mesh`) |
| `apply_shared_prefix(...)` | optional: prefixes and G continuations of each in one pass (below) |
| `loop_params(params)` | optional: params as a decoding loop reads them at every token (below) |

`apply(params, tokens int[B, T], positions int[B, T], *, segment_ids=None,
cache=None, return_hidden=False, new_cache_len=None, cache_dtype=None,
num_positions=None)` returns (f32 logits [B, T, V] or hidden states [B, T, D],
the new cache or None):
- without a cache, token i attends to token j iff j <= i and both carry the
  same nonzero segment id (segment 0 is padding); `new_cache_len` also
  returns a cache of that many slots holding the T tokens (a prefill);
- with a cache, the T tokens take slots [index, index + T) of every row and
  attend to every valid slot up to their own; padding is written but marked
  invalid.
`num_positions` is a static bound on the positions a model may use to
precompute tables; `cache_dtype` the new cache's dtype; both are hints a model
may ignore.

`apply_shared_prefix(params, prefix_tokens, prefix_positions, prefix_segments,
tokens, positions, segment_ids, *, group_size, num_positions=None)` returns the
hidden states of P prefixes f[P, Lp, D] and of their P * G continuations
f[P * G, N, D], row b continuing prefix b // G: what `apply` gives for the
prefixes with `new_cache_len`, then for the continuations with that cache
repeated G times (scoring uses it when present, that pair otherwise). With
`keep=int32[M]` (flat indices into the continuations' B * N tokens) it runs
only those continuation tokens and returns (the prefixes' f[P, Lp, D], theirs
f[M, D]); the packed scoring (`scoring.packed_policy_logits`, GRPO's
`pack_replies`) needs this argument.

`loop_params(params)` returns the params in the layout `decode_step` reads
without preparing anything, computed once before the sampler's decoding loop
instead of inside it at every token: the project's transformer in its stacked
layout slices its layers there (`loop_params`, below).

The cache is a NamedTuple with `valid: bool[B, S]` (which slots hold real
tokens) and `index: int32[]` (the next slot every row writes); its other
leaves are the model's buffers, each with the batch as its leading axis. The
sampler rewrites `valid` and `index` itself, and `repeat_cache` copies rows.

Implementations: `transformer.TransformerConfig` (the project's Llama-family
decoder, pure functions over dict params) and `flax_lm.FlaxLM` (any Flax
linen or NNX language model, Gemma among them).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

Params = Any


@runtime_checkable
class CausalLM(Protocol):
  """A model definition (see the module docstring)."""

  vocab_size: int
  d_model: int
  n_layers: int
  max_seq_len: int
  dtype: str
  param_dtype: str
  activation_mesh: Any

  def init(self, rng: jax.Array) -> Params: ...

  def apply(self, params: Params, tokens: jax.Array, positions: jax.Array, **kwargs
            ) -> tuple[jax.Array, Any]: ...

  def lm_head(self, params: Params, hidden: jax.Array) -> jax.Array: ...

  def decode_step(self, params: Params, tokens: jax.Array, positions: jax.Array, cache: Any,
                  vocab_major: bool = False) -> tuple[jax.Array, Any]: ...

  def init_cache(self, batch_size: int, max_len: int, dtype: str | None = None) -> Any: ...

  def decoding_params(self, params: Params, rows: int) -> Params: ...

  def replace(self, **changes) -> CausalLM: ...


def check_definition(cfg: Any) -> None:
  """Raises a TypeError naming what `cfg` lacks of the contract."""
  members = ("vocab_size", "d_model", "n_layers", "max_seq_len", "dtype", "param_dtype",
             "activation_mesh", "init", "apply", "lm_head", "decode_step", "init_cache",
             "decoding_params", "replace")
  missing = [name for name in members if not hasattr(cfg, name)]
  if missing:
    raise TypeError(f"{type(cfg).__name__} is not a model definition (jaxrl_agents.models.lm): "
                    f"it lacks {', '.join(missing)}")
  try:
    hash(cfg)
  except TypeError as e:
    raise TypeError(f"a model definition must be hashable (jit takes it as static): {e}") from e


def loop_params(cfg: Any, params: Params) -> Params:
  """`params` as `cfg`'s decoding loop reads them (its `loop_params`, where it has one).

  Why: whatever `decode_step` derives from the params inside a `lax.while_loop`
  body is derived again at every token. For the stacked transformer that is a slice
  per layer: a rollout of 64 rows x 48 tokens of SmolLM2 took 1.20x the list layout's
  time stacked while the loop sliced, 1.05x with this (2-core CPU;
  benchmarks/rollout_layout.py).
  """
  prepare = getattr(cfg, "loop_params", None)
  return params if prepare is None else prepare(params)


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """Positions int[B, T] for a bool[B, T] token mask: 0, 1, ... over real tokens."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def repeat_cache(cache: Any, repeats: int) -> Any:
  """Each row of a cache `repeats` times: row i becomes rows [i * repeats, (i + 1) * repeats).

  Samples and completions of one prompt share its prefix: prefill the P
  distinct prompts once, then repeat their cache for the P * repeats rows.
  Every leaf but the scalar write index has the batch first (the contract).
  Differentiable: the gradient of a repeated row sums over its copies.
  """
  return jax.tree.map(lambda x: jnp.repeat(x, repeats, axis=0) if x.ndim else x, cache)


def take_rows(cache: Any, index: jax.Array) -> Any:
  """The cache of rows `index` (int[b]) of a cache, in that order (batch first, the contract)."""
  return jax.tree.map(lambda x: x[index] if x.ndim else x, cache)


def attention_allowed(segment_ids: jax.Array) -> jax.Array:
  """bool[B, T, T] for a cacheless pass: causal, within a segment, never onto padding."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  return (causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
          & (segment_ids != 0)[:, None, :])


def cached_attention_allowed(valid: jax.Array, start: jax.Array, t: int) -> jax.Array:
  """bool[B, T, S] for T tokens written at slots [start, start + T) of a cache whose slots
  `valid` (already updated with them) says are real: each sees the valid slots up to its own."""
  query_slot = start + jnp.arange(t)
  return (jnp.arange(valid.shape[1])[None, :] <= query_slot[:, None])[None] & valid[:, None, :]
