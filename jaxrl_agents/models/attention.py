"""Self-attention for the models: one entry point, the implementation chosen by name.

`attend(q, k, v, mask, implementation=...)` is grouped-query attention (H query heads
over K key/value heads, H % K == 0) with every pass's mask described by `Mask`, which
holds vectors, never a [B, T, S] array: a query at index i sees key slot j iff the
key is valid, j <= i and j >= the start of the query's segment. Training, scoring and
prefill (causal within segments, padding anywhere), a pass through a KV cache (the
query's slot against the cache's valid slots) and continuations after a shared prefix
all have that form (`Mask.segments`, `Mask.cached`, `Mask.after_prefix`).

Implementations (`IMPLEMENTATIONS`; "auto" picks by backend and dtype, `resolve`):

- "xla": einsums over the whole scores, causal passes in blocks of `CAUSAL_BLOCK`
  queries against the keys up to the block. The fastest at short rows on CPU, and
  the CPU default, but it keeps each block's f32 scores for the backward pass:
  memory grows with T * S.
- "chunked": tokamax's `xla_chunked` (Rabe & Staats, arXiv:2112.05682): queries and
  keys in chunks with an online softmax, each chunk rematerialized in the backward
  pass, so memory grows with T. Pure XLA: it runs on every backend (the default for
  float32 on a GPU and on TPU), but on an H200 it is slower than the einsums.
- "cudnn": cuDNN's fused attention (through tokamax and `jax.nn.dot_product_attention`),
  bfloat16 or float16 inputs only; the GPU default for those. Checked against
  `reference` on an H200 (forward and gradient, every kind of mask) and measured there
  (benchmarks/attention_kernels.py, docs/long_sequences.md). It is given the mask
  materialized as bool[B, 1, T, S] (tokamax's translation), and odd lengths padded
  (`pad_to_even`).
- "triton", "mosaic": tokamax's Pallas kernels (Triton on GPU; Mosaic on TPU and Hopper
  GPUs), given the same mask. tokamax 0.0.12's GPU ones failed to trace under the GPU
  image's jax 0.11.2 (Triton: `pl.dot` removed; Mosaic GPU: a `Mesh` argument), so
  they are unverified; on TPU they are untested.

None of the kernels run on a CPU (a clear error names the ones that do).

`reference` is the plain softmax over a materialized mask, the tests' oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn", "triton", "mosaic")

# Query rows per block of a causal pass under "xla" (see `_einsum_attention`).
CAUSAL_BLOCK = 64

# (query, key) chunk sizes of "chunked". tokamax's own default is (512, 1024). At 4 rows
# and SmolLM2's shapes the gradient of scoring compiled to 1.35 / 1.29 / 1.32 GiB of
# temporaries with (128, 256) / (256, 512) / (512, 1024) at 2,048 tokens and 7.32 / 6.16
# / 5.59 GiB at 8,192 (benchmarks/long_context.py --chunks, a CPU): within 10% of each
# other; the middle one is kept.
CHUNK = (256, 512)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
  """Which key slots each query sees: query i sees slot j iff `q_valid[b, i]`,
  `key_valid[b, j]`, j <= `q_index[b, i]` and j >= `k_start[b, i]`. A query that sees
  no key gets zeros.

  Attributes:
    key_valid: bool[B, S].
    q_index: int32[B, T], each query's own slot (None: query i is slot i, S == T).
    k_start: int32[B, T], the first slot of each query's segment (None: 0).
    q_valid: bool[B, T], the queries that attend at all (padding in a cacheless pass;
      in the others every query that has a valid key at or before its slot).
  """

  key_valid: jax.Array
  q_index: jax.Array | None
  k_start: jax.Array | None
  q_valid: jax.Array

  @classmethod
  def segments(cls, segment_ids: jax.Array) -> Mask:
    """A cacheless pass over int[B, T] segment ids: token i sees token j iff j <= i,
    both are in the same segment and it is not 0 (padding). Each segment id's tokens
    must form one run (padding may interrupt it; packed sequences one after another),
    as every caller's are (`lm.attention_allowed` is the same mask, materialized)."""
    t = segment_ids.shape[1]
    valid = segment_ids != 0
    slots = jnp.arange(t, dtype=jnp.int32)
    # The segment of the last valid token before each one: its run starts where that
    # differs from its own.
    last_valid = jax.lax.cummax(jnp.where(valid, slots, -1), axis=1)
    before = jnp.concatenate([jnp.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], 1)
    previous_segment = jnp.where(
        before >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(before, 0), 1), 0)
    starts = valid & (previous_segment != segment_ids)
    k_start = jax.lax.cummax(jnp.where(starts, slots, 0), axis=1)
    return cls(key_valid=valid, q_index=None, k_start=k_start, q_valid=valid)

  @classmethod
  def cached(cls, valid: jax.Array, start: jax.Array, t: int) -> Mask:
    """T queries written at slots [start, start + T) of a cache whose bool[B, S] `valid`
    (already updated with them) says which slots are real: each sees the valid slots up
    to its own (`lm.cached_attention_allowed`)."""
    b = valid.shape[0]
    q_index = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    valid_so_far = jnp.cumsum(valid, axis=1) > 0
    sees = jnp.take_along_axis(valid_so_far, jnp.minimum(q_index, valid.shape[1] - 1), 1)
    return cls(key_valid=valid, q_index=q_index, k_start=None, q_valid=sees)

  @classmethod
  def after_prefix(cls, prefix_valid: jax.Array, own_valid: jax.Array) -> Mask:
    """Continuations [B, N] after a prefix [B, Lp] (`transformer.apply_shared_prefix`):
    keys are the prefix's Lp slots then the row's own N; continuation token i sees the
    valid prefix slots and its own valid tokens up to i."""
    b, lp = prefix_valid.shape
    n = own_valid.shape[1]
    q_index = jnp.broadcast_to(lp + jnp.arange(n, dtype=jnp.int32), (b, n))
    sees = prefix_valid.any(1, keepdims=True) | (jnp.cumsum(own_valid, axis=1) > 0)
    return cls(key_valid=jnp.concatenate([prefix_valid, own_valid], 1), q_index=q_index,
               k_start=None, q_valid=sees)

  def padded(self, t_pad: int, s_pad: int) -> Mask:
    """The mask of `t_pad` more queries that attend to nothing and `s_pad` more key slots
    nobody sees, both at the end (`pad_to_even`)."""
    pad = lambda a, n, value: None if a is None else jnp.pad(
        a, ((0, 0), (0, n)), constant_values=value)
    return Mask(key_valid=pad(self.key_valid, s_pad, False),
                q_index=pad(self.q_index, t_pad, 0), k_start=pad(self.k_start, t_pad, 0),
                q_valid=pad(self.q_valid, t_pad, False))

  def as_bool(self, t: int) -> jax.Array:
    """The mask as bool[B, T, S] (the "xla" implementation's and the reference's)."""
    s = self.key_valid.shape[1]
    q = jnp.arange(t, dtype=jnp.int32)[None] if self.q_index is None else self.q_index
    slots = jnp.arange(s, dtype=jnp.int32)
    allowed = (slots[None, None, :] <= q[:, :, None]) & self.key_valid[:, None, :]
    if self.k_start is not None:
      allowed &= slots[None, None, :] >= self.k_start[:, :, None]
    return allowed & self.q_valid[:, :, None]


def check_name(implementation: str) -> None:
  """A clear error for a name not in `IMPLEMENTATIONS`; touches no backend, so configs
  can be checked before `jax.distributed.initialize` (which must precede any backend)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {list(IMPLEMENTATIONS)}, got "
                     f"{implementation!r}")


def resolve(implementation: str, dtype=None, backend: str | None = None) -> str:
  """The implementation "auto" means for inputs of `dtype` on `backend` (default: this
  process's); others are checked and returned. Asks for the backend: call it at trace
  time, not when a config is built.

  "auto" is chosen by measurement (docs/long_sequences.md): on CPU the einsums, faster
  at the rows a CPU trains on and sooner compiled; on a GPU cuDNN's fused kernel for
  bfloat16 and float16 (on an H200 4-8x faster than "chunked" and 4x the einsums at rows
  of 2k-8k, with the fewest temporaries) and "chunked" for float32, which cuDNN
  refuses; elsewhere (TPU) "chunked", memory linear in the row, until a kernel there
  is measured.
  """
  check_name(implementation)
  if implementation != "auto":
    return implementation
  backend = jax.default_backend() if backend is None else backend
  if backend == "cpu":
    return "xla"
  if backend in ("gpu", "cuda", "rocm") and dtype is not None and jnp.dtype(dtype) in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "cudnn"
  return "chunked"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, *,
           implementation: str = "auto", slots_last: bool = False,
           compute_dtype=None) -> jax.Array:
  """Grouped-query attention, f[B, T, H * Dh] in q's dtype.

  Args:
    q: f[B, T, H, Dh]; k: f[B, K, S, Dh], or f[B, K, Dh, S] if `slots_last` (a KV
      cache's layout); v: f[B, K, S, Dh].
    mask: which keys each query sees.
    implementation: one of `IMPLEMENTATIONS`.
    compute_dtype: the dtype the products round their inputs to (default q's): "xla"
      multiplies in float32 inputs rounded to it.
  """
  dtype = q.dtype if compute_dtype is None else compute_dtype
  name = resolve(implementation, dtype)
  if name == "xla":
    causal = mask.q_index is None and not slots_last
    return _einsum_attention(q, k, v, mask.as_bool(q.shape[1]), dtype, slots_last=slots_last,
                             causal=causal)
  if slots_last:
    k = k.transpose(0, 1, 3, 2)
  return _tokamax_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, name)


def reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> jax.Array:
  """The definition, for tests: softmax(q k^T / sqrt(Dh)) v over the allowed keys in
  float32, zeros for a query that sees none. q f[B, T, H, Dh]; k, v f[B, S, K, Dh]."""
  b, t, h, dh = q.shape
  heads = h // k.shape[2]
  kf = jnp.repeat(k.astype(jnp.float32), heads, axis=2)
  vf = jnp.repeat(v.astype(jnp.float32), heads, axis=2)
  scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf) / math.sqrt(dh)
  allowed = mask.as_bool(t)[:, None]
  probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
  probs = jnp.where(allowed.any(-1, keepdims=True), probs, 0.0)
  return jnp.einsum("bhts,bshd->bthd", probs, vf).reshape(b, t, h * dh)


def _einsum_attention(q, k, v, allowed, dtype, *, slots_last: bool, causal: bool):
  """"xla": the scores of each query against every key, in f32.

  causal: `allowed` never lets query i see a key after slot i (a cacheless pass, S = T).
  The queries then go in blocks of `CAUSAL_BLOCK`, each against the keys up to its
  last row only: the same result for about (n + 1) / 2n of the scores' work with n
  blocks (fwd + bwd of SmolLM2's attention at 8 x 256 tokens on a 2-core CPU: 69 -> 41
  ms a layer).
  """
  b, t, h, dh = q.shape
  if causal and t > CAUSAL_BLOCK:
    return jnp.concatenate([
        _einsum_attention(q[:, s:s + CAUSAL_BLOCK], k[:, :, :s + CAUSAL_BLOCK],
                          v[:, :, :s + CAUSAL_BLOCK],
                          allowed[:, s:s + CAUSAL_BLOCK, :s + CAUSAL_BLOCK], dtype,
                          slots_last=False, causal=False)
        for s in range(0, t, CAUSAL_BLOCK)], axis=1)
  n_kv = v.shape[1]
  q = q.reshape(b, t, n_kv, h // n_kv, dh)
  f32 = lambda a: rounded_f32(a, dtype)
  kv_f32 = lambda a: cached_f32(a, dtype)
  spec = "btkgd,bkds->bkgts" if slots_last else "btkgd,bksd->bkgts"
  scores = jnp.einsum(spec, f32(q), kv_f32(k)) / math.sqrt(dh)
  scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  # A query with no allowed key (a padding row) gets zeros, not NaN or noise.
  probs = jnp.where(allowed[:, None, None].any(-1, keepdims=True), probs, 0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", f32(probs), kv_f32(v))
  return out.reshape(b, t, h * dh).astype(q.dtype)


def rounded_f32(a: jax.Array, dtype) -> jax.Array:
  """a rounded to the compute dtype, then held in float32.

  Attention multiplies these: the products of bf16 values are exact in float32, so
  this is bf16 x bf16 with float32 accumulation, which XLA:CPU has no kernel for in
  batched dots.
  """
  return a.astype(dtype).astype(jnp.float32)


def cached_f32(a: jax.Array, dtype) -> jax.Array:
  """Keys or values in float32 for the attention, rounded to the compute dtype.

  A float32 cache under bf16 compute already holds rounded values (they are rounded
  before they are stored), so it is read as is.
  """
  return a if a.dtype == jnp.float32 else rounded_f32(a, dtype)


@functools.cache
def _tokamax_ops():
  """tokamax's attention ops by this module's names (imported on first use: it is only
  needed off the "xla" path)."""
  try:
    from tokamax._src.ops.attention import api, base, xla_chunked
  except ImportError as e:
    raise ImportError("attention='chunked', 'cudnn', 'triton' or 'mosaic' needs tokamax: "
                      "pip install 'tokamax==0.0.12'") from e
  from absl import flags
  if not flags.FLAGS.is_parsed():
    # tokamax reads its options from absl flags and, outside an absl app (pytest, a
    # notebook, a plain script), would parse sys.argv itself and fail on the host's own
    # arguments. Unparsed flags keep their defaults this way; an absl app parses later.
    flags.FLAGS.mark_as_parsed()
  ops = {"chunked": xla_chunked.XlaChunkedDotProductAttention(chunk_size=CHUNK)}
  for name, key in (("cudnn", "cudnn"), ("triton", "triton")):
    if key in api.IMPLEMENTATIONS:
      ops[name] = api.IMPLEMENTATIONS[key]
  mosaic = "mosaic_gpu" if jax.default_backend() == "gpu" else "mosaic_tpu"
  if mosaic in api.IMPLEMENTATIONS:
    ops["mosaic"] = api.IMPLEMENTATIONS[mosaic]
  return ops, base.Mask


def pad_to_even(q, k, v, mask: Mask):
  """(q, k, v, mask) with an even number of queries and of key slots, and the query
  count before. cuDNN's fused attention refuses the backward pass of a masked (biased)
  attention at odd lengths ("Unsupported sequence length", seen on an H200), and
  scoring's rows are one shorter than the tokens. The padding attends to nothing and
  is seen by nothing. q f[B, T, H, Dh]; k, v f[B, S, K, Dh]."""
  t, s = q.shape[1], k.shape[1]
  if mask.q_index is None:  # query i is slot i: pad both alike
    t_pad = s_pad = t % 2
  else:
    t_pad, s_pad = t % 2, s % 2
  if not (t_pad or s_pad):
    return q, k, v, mask, t
  along = lambda a, n: jnp.pad(a, ((0, 0), (0, n)) + ((0, 0),) * (a.ndim - 2))
  return along(q, t_pad), along(k, s_pad), along(v, s_pad), mask.padded(t_pad, s_pad), t


def _tokamax_attention(q, k, v, mask: Mask, name: str):
  """q f[B, T, H, Dh], k and v f[B, S, K, Dh] through a tokamax op, the mask as its
  vectors: key validity broadcast over queries, the segment start as `k_start`, the
  queries' slots as `q_indices` against causal order."""
  b, t, h, dh = q.shape
  if name != "chunked" and jax.default_backend() == "cpu":
    raise ValueError(f"attention={name!r} is an accelerator kernel; on CPU use 'xla' or "
                     "'chunked' (or 'auto')")
  ops, tokamax_mask = _tokamax_ops()
  if name not in ops:
    raise ValueError(f"attention={name!r}: tokamax has no such kernel here "
                     f"(available: {sorted(ops)})")
  if name == "cudnn":
    q, k, v, mask, t = pad_to_even(q, k, v, mask)
  out = _tokamax_op(ops[name], tokamax_mask, q, k, v, mask)[:, :t]
  return out.reshape(b, t, h * dh).astype(q.dtype)


def _tokamax_op(op, tokamax_mask, q, k, v, mask: Mask):
  """f[B, T, H, Dh] of a tokamax op, the mask given as its vectors (zeros where
  `mask.q_valid` is False)."""
  kw = {}
  if mask.k_start is not None:
    kw["k_start"] = mask.k_start[:, None, :]
  spec = tokamax_mask(mask.key_valid[:, None, None, :], is_causal=True, **kw)
  q_indices = None if mask.q_index is None else mask.q_index[:, None, :]
  out = op(q, k, v, mask=spec, q_indices=q_indices)
  return jnp.where(mask.q_valid[:, :, None, None], out, 0.0)
