"""Llama-family decoder as pure functions over a plain parameter pytree.

Covers Llama 2/3, SmolLM2 and Qwen2: RMSNorm, rotary position embeddings (with
the Llama-3 frequency scaling when the config asks for it), grouped-query
attention, SwiGLU MLP, tied or untied LM head and optional q/k/v biases.

Parameters are a nested dict with one dict per layer, and matrices stored
[out, in] as in PyTorch checkpoints:

```
params = {
  "embed":      f[V, D],
  "layers": [                      # one dict per layer, L of them
    {"attn_norm": f[D],
     "wq": f[H*Dh, D], "wk": f[K*Dh, D], "wv": f[K*Dh, D],
     "bq": f[H*Dh],    "bk": f[K*Dh],    "bv": f[K*Dh],        # qkv_bias only
     "wo": f[D, H*Dh],
     "mlp_norm": f[D],
     "w_gate": f[F, D], "w_up": f[F, D], "w_down": f[D, F]},
    ...
  ],
  "final_norm": f[D],
  "lm_head":    f[V, D],                                        # untied only
}
```

Why a list of layers and not stacked arrays under `lax.scan`: on XLA:CPU a
decode step's matmul against a slice of a stacked weight (inside scan or by
static index) ran 3-10x slower than against a separate array, and bf16 matmuls
lost their fast path entirely (measured in benchmarks/sampler.py's notes). In
training the stacked layout costs less, 6-17% per step (the SFT step, and the
learning race's updates on a 2-core Zen 4: docs/learning_race.md), and
compiles about 3x faster. The unrolled layer loop costs compile time, not run
time. Why [out, in]: contracting the last axis of both operands is the faster
layout for bf16 and small batches on this backend, and it matches Hugging Face
checkpoints without transposes.

For accelerators there is the stacked layout as well (`stack_layers`):
"layers" is one dict of arrays with a leading layer axis, f[L, ...], and the
cacheless forward (training, scoring) runs one `lax.scan` over it, with the
layer body rematerialized in the backward pass when `remat` asks: compile time
no longer grows with depth, and activation memory is traded for compute. A
pass with a cache unstacks first (a slice per layer). `is_stacked` tells the
layouts apart; both give the same logits and gradients.

The KV cache is an explicit pytree (see `init_cache`): per-layer key/value
buffers over ``S`` slots, a per-slot validity mask and the next write slot.
A batch moves through the cache in lockstep (left-padded prompts), so a single
scalar write index serves every row while RoPE positions stay per token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_agents.models import attention, lora
from jaxrl_agents.parallel.sharding import BATCH_AXES

Params = dict[str, Any]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _as_dtype(name: str) -> jnp.dtype:
  if name not in _DTYPES:
    raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Static architecture description; hashable so jit can treat it as static.

  Attributes:
    vocab_size: V.
    d_model: D, the residual width.
    n_layers: L.
    n_heads: H, query heads.
    n_kv_heads: K, key/value heads (H % K == 0; K < H is grouped-query attention).
    head_dim: Dh.
    ffn_dim: F, the SwiGLU hidden width.
    rope_theta: base of the rotary frequencies.
    rope_scaling: None, or the Llama-3 scaling as a tuple of
      (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the embedding matrix.
    qkv_bias: q/k/v projections carry biases (Qwen2 family).
    max_seq_len: the longest context the model was trained for (informational).
    param_dtype: storage dtype of the parameters.
    dtype: compute dtype of activations and matmul inputs. Matmuls accumulate
      in float32 whatever this is; norms, softmax and logits are float32.
    remat: what the stacked layout's scanned layer keeps for the backward pass
      (`REMAT_POLICIES`); the per-layer list ignores it.
    attention: the attention implementation of cacheless passes (training, scoring,
      prefill) and of `apply_shared_prefix` (`attention.IMPLEMENTATIONS`; "auto" is
      the einsums on CPU, the chunked online softmax, memory linear in the row, on
      accelerators). A pass through a KV cache always uses the einsums.
    activation_mesh: a `jax.sharding.Mesh` (set by `zoo.load(mesh=...)`): the
      residual stream's rows are constrained over its data x fsdp axes after the
      embedding and every layer, so that with weights split over fsdp the
      compiler gathers each layer's weights rather than moving activations
      (FSDP). None: no constraint (one device).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[float, float, float, int] | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  max_seq_len: int = 2048
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: str = "none"
  attention: str = "auto"
  activation_mesh: Any = None
  # Each layer merges its own LoRA weights (`lora.Adapted`) when it runs (`_run_layers`).
  merges_adapters_per_layer: ClassVar[bool] = True

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    _as_dtype(self.param_dtype)
    _as_dtype(self.dtype)
    attention.check_name(self.attention)

  def replace(self, **changes) -> TransformerConfig:
    return dataclasses.replace(self, **changes)

  # The model contract (`lm.CausalLM`): the module's functions, with this config.

  def init(self, rng: jax.Array) -> Params:
    return init(rng, self)

  def apply(self, params: Params, tokens: jax.Array, positions: jax.Array, **kwargs):
    return apply(params, tokens, positions, self, **kwargs)

  def lm_head(self, params: Params, hidden: jax.Array) -> jax.Array:
    return lm_head(params, hidden, self)

  def apply_shared_prefix(self, params: Params, prefix_tokens: jax.Array,
                          prefix_positions: jax.Array, prefix_segments: jax.Array,
                          tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, *,
                          group_size: int, num_positions: int | None = None,
                          keep: jax.Array | None = None):
    """Optional member of the contract (`lm` module docstring): `apply_shared_prefix`."""
    return apply_shared_prefix(params, prefix_tokens, prefix_positions, prefix_segments, tokens,
                               positions, segment_ids, self, group_size=group_size,
                               num_positions=num_positions, keep=keep)

  def decode_step(self, params: Params, tokens: jax.Array, positions: jax.Array, cache,
                  vocab_major: bool = False):
    return decode_step(params, tokens, positions, self, cache, vocab_major=vocab_major)

  def init_cache(self, batch_size: int, max_len: int, dtype: str | None = None):
    return init_cache(self, batch_size, max_len, dtype)

  def loop_params(self, params: Params) -> Params:
    """The per-layer layout `decode_step` indexes (`lm.loop_params`): a stacked
    layout is sliced once, before the decoding loop, not at every token."""
    return unstack_layers(params)

  def decoding_params(self, params: Params, rows: int) -> Params:
    """One row's projections are matrix-vector products, faster over stacked matrices
    (`fuse_projections`); more rows gained nothing from them. Stacking copies the
    weights, so prepare this once, outside repeated calls."""
    return fuse_projections(params) if rows == 1 else params

  @property
  def num_params(self) -> int:
    d, f, dh = self.d_model, self.ffn_dim, self.head_dim
    attn = d * dh * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += dh * (self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.n_layers * per_layer + d + head


class KVCache(NamedTuple):
  """Decoding state. Slots are positions in the buffer, not RoPE positions.

  Attributes:
    k: L arrays f[B, K, Dh, S], keys already rotated, slots last. Heads before
      slots: the attention contracts each head's block directly, where a
      [B, S, K, Dh] buffer made XLA transpose the whole cache at every decode
      step. Slots last: the scores q @ k are then an ordinary [G, Dh] @ [Dh, S]
      product per head, which XLA:CPU ran in 8-14% less time per decode step
      than contracting [S, Dh] blocks on their last axis (SmolLM2, batch 32).
    v: L arrays f[B, K, S, Dh], values.
    valid: bool[B, S] whether a slot holds a real (non-padding) token.
    index: int32[] the next slot to write; every row writes the same slots.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  valid: jax.Array
  index: jax.Array


def init_cache(cfg: TransformerConfig, batch_size: int, max_len: int,
               dtype: str | None = None) -> KVCache:
  """An empty cache of `max_len` slots per row, in the compute dtype by default."""
  k_shape = (batch_size, cfg.n_kv_heads, cfg.head_dim, max_len)
  v_shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
  dt = _as_dtype(dtype or cfg.dtype)
  return KVCache(
      k=tuple(jnp.zeros(k_shape, dt) for _ in range(cfg.n_layers)),
      v=tuple(jnp.zeros(v_shape, dt) for _ in range(cfg.n_layers)),
      valid=jnp.zeros((batch_size, max_len), bool), index=jnp.zeros((), jnp.int32))


def init(rng: jax.Array, cfg: TransformerConfig) -> Params:
  """Random parameters (clipped-normal fan-in init, unit norms)."""
  pdt = _as_dtype(cfg.param_dtype)
  d, f, dh = cfg.d_model, cfg.ffn_dim, cfg.head_dim
  hq, hk = cfg.n_heads * dh, cfg.n_kv_heads * dh
  per_layer = {  # name: ([out, in] shape, fan_in)
      "wq": ((hq, d), d), "wk": ((hk, d), d), "wv": ((hk, d), d), "wo": ((d, hq), hq),
      "w_gate": ((f, d), d), "w_up": ((f, d), d), "w_down": ((d, f), f),
  }
  if cfg.qkv_bias:
    per_layer.update(bq=((hq,), 2500), bk=((hk,), 2500), bv=((hk,), 2500))
  # Embedding std 1/sqrt(D): with a tied head the initial logits have unit scale,
  # so a random model samples from a spread-out distribution.
  shapes = {"embed": ((cfg.vocab_size, d), d)}
  for i in range(cfg.n_layers):
    shapes.update({(i, name): spec for name, spec in per_layer.items()})
  if not cfg.tie_embeddings:
    shapes["lm_head"] = ((cfg.vocab_size, d), d)
  # One draw sliced into every weight: a single RNG kernel compiles in a
  # fraction of the time of one per weight.
  sizes = [math.prod(shape) for shape, _ in shapes.values()]
  noise = jnp.clip(jax.random.normal(rng, (sum(sizes),), jnp.float32), -2.0, 2.0)
  weights, offset = {}, 0
  for (name, (shape, fan_in)), size in zip(shapes.items(), sizes, strict=True):
    weights[name] = (noise[offset:offset + size].reshape(shape) / math.sqrt(fan_in)).astype(pdt)
    offset += size
  layers = []
  for i in range(cfg.n_layers):
    layer = {name: weights[(i, name)] for name in per_layer}
    layer["attn_norm"] = jnp.ones((d,), pdt)
    layer["mlp_norm"] = jnp.ones((d,), pdt)
    layers.append(layer)
  params = {"embed": weights["embed"], "layers": layers, "final_norm": jnp.ones((d,), pdt)}
  if not cfg.tie_embeddings:
    params["lm_head"] = weights["lm_head"]
  return params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axis: int = -1) -> jax.Array:
  """x / rms(x) * scale over the feature `axis`, computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
  shape = [1] * x.ndim
  shape[axis] = -1
  return (y * scale.astype(jnp.float32).reshape(shape)).astype(x.dtype)


def rope_frequencies(cfg: TransformerConfig) -> jax.Array:
  """Inverse frequencies f32[Dh/2], with Llama-3 scaling applied if configured."""
  half = cfg.head_dim // 2
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / cfg.head_dim))
  if cfg.rope_scaling is None:
    return inv_freq
  # "The Llama 3 Herd of Models": long wavelengths are divided by `factor`,
  # short ones kept, and the band between is interpolated smoothly.
  factor, low_ff, high_ff, original_len = cfg.rope_scaling
  low_wavelen = original_len / low_ff
  high_wavelen = original_len / high_ff
  wavelen = 2 * math.pi / inv_freq
  smooth = (original_len / wavelen - low_ff) / (high_ff - low_ff)
  interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_medium, interpolated, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array,
                num_positions: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(sin, cos), each f32[B, T, 1, Dh/2], of the rotation angles at positions int[B, T].

  With `num_positions` (a static bound: every position < num_positions), the
  angles come from a [num_positions, Dh/2] table by gather. The values are the
  same; the point is where XLA:CPU puts the work: computed per token, the
  sines and cosines get fused into every layer's consumers and evaluated again
  per head and per layout copy (~15% of a bf16 batch-32 prefill); a gather
  from the table fuses just as well and costs a load.
  """
  if num_positions is None:
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, Dh/2]
    return jnp.sin(angles), jnp.cos(angles)
  span = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq  # [P, Dh/2]
  table = jnp.concatenate([jnp.sin(span), jnp.cos(span)], axis=-1)[positions][:, :, None, :]
  half = inv_freq.shape[0]
  return table[..., :half], table[..., half:]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               tables: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """Rotates x f[B, T, N, Dh] by positions int[B, T] (HF's half-split layout).

  `tables` are `rope_tables(positions, inv_freq)` when the caller already has them.
  """
  sin, cos = rope_tables(positions, inv_freq) if tables is None else tables
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def constrain_rows(x: jax.Array, cfg: TransformerConfig, axis: int = 0) -> jax.Array:
  """`x` with its rows (dimension `axis`) constrained over the data x fsdp axes of
  `cfg.activation_mesh` (`sharding.BATCH_AXES`); unchanged without a mesh, or when the
  rows do not split evenly (they stay where the compiler puts them)."""
  mesh = cfg.activation_mesh
  if mesh is None:
    return x
  split = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if split == 1 or x.shape[axis] % split:
    return x
  spec = [None] * x.ndim
  spec[axis] = BATCH_AXES
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _dense(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x @ w.T for w f[out, in], inputs in the compute dtype, float32 accumulation."""
  return project(x, w, dtype, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def project(x: jax.Array, w: jax.Array, dtype, out_dtype) -> jax.Array:
  """f[..., out] = x f[..., in] times w f[out, in] transposed: both in `dtype`, float32
  accumulation, the result in `out_dtype`.

  In float32 the einsum's values and gradients exactly. In bfloat16 the backward's
  products run in bf16 too: the output's gradient is rounded to it first (for the LM
  head, whose logits are float32, as torch's autocast does), and the gradients are
  summed in float32 and rounded once, to the inputs' dtypes.

  The weight's gradient contracts the rows with the narrower of x and the output's
  gradient transposed (`_project_bwd`). XLA:CPU's own derivative always transposes the
  output's gradient, and where that gradient comes out of an elementwise fusion
  (SiLU's derivative) it writes it transposed at a fraction of memory speed:
  SmolLM2's MLP (8 x 256 tokens, f32, forward and backward) took 88-90 ms with it and
  67-69 ms this way on a 2-core AMD EPYC (Zen 5), about the time of its matrix
  products alone. In bf16 the transposed operand is materialized row-major
  (`_row_major_transpose`), which keeps the product in bf16. (float16 keeps the
  einsum's derivative: its products in the wider dtype.)
  """
  return _project_fwd(x, w, dtype, out_dtype)[0]


def _project_fwd(x, w, dtype, out_dtype):
  xc, wc = x.astype(dtype), w.astype(dtype)
  y = jnp.einsum("...i,oi->...o", xc, wc, preferred_element_type=jnp.float32)
  # Zero-size arrays carry the inputs' dtypes, which their gradients must have.
  like = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
  return y.astype(out_dtype), (xc, wc, like)


def _project_bwd(dtype, out_dtype, residuals, dy):
  xc, wc, (x_like, w_like) = residuals
  bf16 = jnp.dtype(dtype) == jnp.bfloat16
  # dy has out_dtype; in `dtype` it is exact when the two agree (the forward rounded to
  # it). In bf16 the LM head's float32 logits gradient is rounded here (bf16 has f32's
  # exponent range): its products in f32 took 0.75 s of the 4.3 s bf16 SmolLM2 train
  # step (8 x 256) on a 2-core Zen 5. float16 would flush its smallest entries to zero,
  # so there the products run in the wider dtype, as the einsum's derivative does.
  g = dy.astype(dtype if bf16 else jnp.promote_types(dy.dtype, dtype))
  xc, wc = xc.astype(g.dtype), wc.astype(g.dtype)
  dx = jnp.einsum("...o,oi->...i", g, wc, preferred_element_type=jnp.float32)
  n_in, n_out = wc.shape[1], wc.shape[0]
  # Rows flattened first: contracting [B, T] as two axes gave a bf16 x bf16 -> f32 product
  # that XLA:CPU's plain dot does not implement (UNIMPLEMENTED in the bf16 train step),
  # and f32 ran slower that way (SmolLM2 train step 364 against 393 tok/s).
  x2, g2 = xc.reshape(-1, n_in), g.reshape(-1, n_out)
  transpose = _row_major_transpose if bf16 else jnp.transpose
  if n_in <= n_out:  # transpose x's rows, then the [in, out] product
    dw_t = jnp.einsum("in,no->io", transpose(x2), g2, preferred_element_type=jnp.float32)
    dw = transpose(dw_t.astype(w_like.dtype))
  else:
    dw = jnp.einsum("on,ni->oi", transpose(g2), x2, preferred_element_type=jnp.float32)
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


def _row_major_transpose(a: jax.Array) -> jax.Array:
  """a.T for a 2-d `a`, reaching the next op as a row-major array.

  XLA:CPU receives a plain transpose as a layout change ({0,1}: a.T's bytes are a's).
  Its dot library takes no such operand in bf16, so a bf16 product with one is
  upcast to f32 and run by the generic dot; with its output's transpose folded in it
  fails (UNIMPLEMENTED: BF16 x BF16 = F32). A 3-d view transposed and reshaped back
  arrives row-major. SmolLM2's weight gradients (2048 rows, bf16) took 4-6 ms instead
  of 10-11 ms each this way, the LM head's 0.22 s instead of 0.49 s (2-core Zen 5).
  A workaround for XLA:CPU's layouts: on an accelerator it is an ordinary transpose,
  not measured there.
  """
  m, n = a.shape
  return jnp.moveaxis(a[..., None], 0, 1).reshape(n, m)


project.defvjp(_project_fwd, _project_bwd)


def _project_qkv(layer, h, dense, axis, cfg, dtype):
  """q, k, v (before RoPE) along feature `axis`, from separate or stacked
  (`fuse_projections`) weights; dense(w, h) applies one matrix."""
  def bias(name):
    b = layer[name].astype(dtype)
    return b[:, None] if axis == 0 else b
  if "wqkv" in layer:
    qkv = dense(layer["wqkv"], h)
    if cfg.qkv_bias:
      qkv = qkv + bias("bqkv")
    hq, hk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return jnp.split(qkv, [hq, hq + hk], axis=axis)
  q, k, v = dense(layer["wq"], h), dense(layer["wk"], h), dense(layer["wv"], h)
  if cfg.qkv_bias:
    q, k, v = q + bias("bq"), k + bias("bk"), v + bias("bv")
  return q, k, v


def _project_gate_up(layer, h, dense, axis):
  """The MLP's gate and up projections, from separate or stacked weights."""
  if "w_gate_up" in layer:
    return jnp.split(dense(layer["w_gate_up"], h), 2, axis=axis)
  return dense(layer["w_gate"], h), dense(layer["w_up"], h)


def _mlp(x, layer, dtype):
  gate, up = _project_gate_up(layer, x, lambda w, h: _dense(h, w, dtype), -1)
  return _dense(jax.nn.silu(gate.astype(jnp.float32)).astype(dtype) * up, layer["w_down"], dtype)


def _qkv(h, layer, positions, inv_freq, tables, cfg, dtype):
  b, t, _ = h.shape
  q, k, v = _project_qkv(layer, h, lambda w, x: _dense(x, w, dtype), -1, cfg, dtype)
  q = apply_rope(q.reshape(b, t, cfg.n_heads, cfg.head_dim), positions, inv_freq, tables)
  k = apply_rope(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), positions, inv_freq, tables)
  v = v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  return q, k, v


def lm_head(params: Params, hidden: jax.Array, cfg: TransformerConfig) -> jax.Array:
  """Vocabulary logits f32[..., V] from final hidden states f[..., D]."""
  dtype = _as_dtype(cfg.dtype)
  w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  return project(hidden, w, dtype, jnp.float32)


def is_stacked(params: Params) -> bool:
  """Whether `params` are in the stacked layout ("layers": one dict of f[L, ...])."""
  return isinstance(params["layers"], dict)


def stack_layers(params: Params) -> Params:
  """The stacked layout: the per-layer dicts as one dict of arrays f[L, ...]."""
  if is_stacked(params):
    return params
  layers = params["layers"]
  return {**params, "layers": {k: jnp.stack([layer[k] for layer in layers]) for k in layers[0]}}


def unstack_layers(params: Params) -> Params:
  """The per-layer list layout (the CPU default) of stacked params.

  Split, not indexed: the gradient of `w[i]` is a zero array of the whole stack with
  layer i filled in, one per layer, and XLA kept all of them (a GRPO update of
  SmolLM2 that shares each group's prompt through a cache, so unstacks twice, needed
  25 GB of temporaries instead of 1); the gradient of a split is one concatenation.
  """
  if not is_stacked(params):
    return params
  stacked = params["layers"]
  n = next(iter(stacked.values())).shape[0]
  pieces = {k: [jnp.squeeze(p, 0) for p in jnp.split(v, n)] for k, v in stacked.items()}
  return {**params, "layers": [{k: pieces[k][i] for k in stacked} for i in range(n)]}


# Rematerialization of the stacked layer body in the backward pass.
REMAT_POLICIES = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


def _decoder_layer(x, layer, positions, inv_freq, tables, cfg, dtype, attend):
  """One pre-norm decoder layer. attend(q, k, v) -> f[..., H * Dh] is the layer's
  attention, given its queries, keys and values f[B, T, heads, Dh] after RoPE: the one
  thing the passes (cacheless, cached, shared-prefix) do differently."""
  h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
  q, k, v = _qkv(h, layer, positions, inv_freq, tables, cfg, dtype)
  x = x + _dense(attend(q, k, v), layer["wo"], dtype)
  return x + _mlp(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer, dtype)


def _run_layers(x, layers, layer_fn, remat: str):
  """`x` through every layer, layer_fn(x, layer) each: stacked layers (a dict of
  f[L, ...]) as one `lax.scan` whose body the backward pass rematerializes by `remat`
  (`REMAT_POLICIES`), listed ones in order."""
  layer_fn = lambda x, layer, fn=layer_fn: fn(x, lora.materialize(layer))  # LoRA, per layer
  if isinstance(layers, dict):
    body = lambda x, layer: (layer_fn(x, layer), None)
    if remat != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    return jax.lax.scan(body, x, layers)[0]
  for layer in layers:
    x = layer_fn(x, layer)
  return x


def _check_layers(params: Params, cfg: TransformerConfig) -> None:
  layers = params["layers"]
  n = next(iter(layers.values())).shape[0] if isinstance(layers, dict) else len(layers)
  if n != cfg.n_layers:
    raise ValueError(f"params have {n} layers, config says {cfg.n_layers}")


def apply(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cfg: TransformerConfig,
    *,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
    return_hidden: bool = False,
    new_cache_len: int | None = None,
    cache_dtype: str | None = None,
    num_positions: int | None = None,
    remat: str | None = None,
) -> tuple[jax.Array, KVCache | None]:
  """Runs the decoder.

  Without a cache, attention is causal within each segment: token i sees token
  j iff j <= i, segment_ids[j] == segment_ids[i] and segment_ids[j] != 0
  (segment 0 is padding). This covers plain batches, left/right padding and
  packed sequences.

  With a cache, the T new tokens are written to slots [index, index + T) and
  each attends to every valid slot up to its own. Padding tokens
  (segment_ids == 0) are written but marked invalid, so no later token sees
  them.

  Args:
    params: the parameter pytree (see the module docstring).
    tokens: int[B, T].
    positions: int[B, T] RoPE positions (e.g. cumsum(mask) - 1 for left padding).
    cfg: the architecture.
    segment_ids: int[B, T]; defaults to all ones (no padding).
    cache: a KVCache with room for T more slots, or None.
    return_hidden: return final normalized hidden states f[B, T, D] (for value
      or reward heads, or to compute logits only where needed) instead of
      logits f32[B, T, V].
    new_cache_len: without a cache, also return a new cache of this many slots
      (>= T) holding the T tokens' keys and values in slots [0, T), padding
      marked invalid: a prefill. The same cache as `init_cache` then `apply`
      with it, at less cost: attention spans the T tokens, not all the slots.
    cache_dtype: the new cache's dtype (default: the compute dtype).
    num_positions: optional static bound, every position < num_positions
      (a larger one reads out of range): the rotations then come from a table
      (see `rope_tables`), faster on CPU.
    remat: with stacked params and no cache, what the scanned layer keeps for
      the backward pass (`REMAT_POLICIES`: "none", "full", "dots"); default
      `cfg.remat`.

  Returns:
    (logits or hidden states, the updated cache or None).
  """
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be int[B, T], got shape {tokens.shape}")
  if positions.shape != tokens.shape:
    raise ValueError(f"positions shape {positions.shape} != tokens shape {tokens.shape}")
  if segment_ids is None:
    segment_ids = jnp.ones(tokens.shape, jnp.int32)
  elif segment_ids.shape != tokens.shape:
    raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {tokens.shape}")
  dtype = _as_dtype(cfg.dtype)
  inv_freq = rope_frequencies(cfg)
  tables = rope_tables(positions, inv_freq, num_positions)
  b, t = tokens.shape
  x = constrain_rows(params["embed"][tokens].astype(dtype), cfg)
  token_valid = segment_ids != 0

  remat = cfg.remat if remat is None else remat
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
  if is_stacked(params) and (cache is not None or new_cache_len is not None):
    params = unstack_layers(params)  # cache passes index each layer's buffers
  _check_layers(params, cfg)
  new_k, new_v = [], []

  if cache is None:
    if new_cache_len is not None and new_cache_len < t:
      raise ValueError(f"new_cache_len {new_cache_len} < {t} tokens")
    mask = attention.Mask.segments(segment_ids)
    heads_first = lambda a: a.transpose(0, 2, 1, 3)  # [B, T, K, Dh] -> [B, K, T, Dh]

    def attend(q, k, v):
      keys, values = heads_first(k), heads_first(v)
      if new_cache_len is not None:  # a prefill: listed layers, never inside a scan
        new_k.append(keys)
        new_v.append(values)
      return attention.attend(q, keys, values, mask, implementation=cfg.attention)
  else:
    if new_cache_len is not None:
      raise ValueError("new_cache_len is for a prefill without a cache; got a cache too")
    if cache.valid.shape[0] != b:
      raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {b}")
    start = cache.index
    valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, start))
    mask = attention.Mask.cached(valid, start, t)
    zero = jnp.zeros((), jnp.int32)

    def attend(q, k, v):
      i = len(new_k)  # the layers run in order: the i-th call is layer i
      # Each layer's buffer is its own array, updated in place (donate the cache at
      # the jit boundary, or carry it through a while_loop).
      keys = jax.lax.dynamic_update_slice(
          cache.k[i], k.transpose(0, 2, 3, 1).astype(cache.k[i].dtype), (zero, zero, zero, start))
      values = jax.lax.dynamic_update_slice(
          cache.v[i], v.transpose(0, 2, 1, 3).astype(cache.v[i].dtype), (zero, zero, start, zero))
      new_k.append(keys)
      new_v.append(values)
      # The einsums whatever `cfg.attention` says: the other implementations want the
      # keys slots-second, a copy of the whole cache per layer.
      return attention.attend(q, keys, values, mask, implementation="xla", slots_last=True)

  layer_fn = lambda x, layer: constrain_rows(
      _decoder_layer(x, layer, positions, inv_freq, tables, cfg, dtype, attend), cfg)
  x = _run_layers(x, params["layers"], layer_fn, remat)

  new_cache = None
  if cache is not None:
    new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid, index=start + t)
  elif new_cache_len is not None:
    dt = _as_dtype(cache_dtype or cfg.dtype)
    slots = lambda a: jnp.pad(a.astype(dt), ((0, 0), (0, 0), (0, new_cache_len - t), (0, 0)))
    key_slots = lambda a: slots(a).transpose(0, 1, 3, 2)
    new_cache = KVCache(k=tuple(map(key_slots, new_k)), v=tuple(map(slots, new_v)),
                        valid=jnp.pad(token_valid, ((0, 0), (0, new_cache_len - t))),
                        index=jnp.int32(t))

  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  if return_hidden:
    return x, new_cache
  return lm_head(params, x, cfg), new_cache


def apply_shared_prefix(
    params: Params,
    prefix_tokens: jax.Array,
    prefix_positions: jax.Array,
    prefix_segments: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cfg: TransformerConfig,
    *,
    group_size: int,
    num_positions: int | None = None,
    keep: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Final hidden states of P prefixes and of G continuations of each, in one pass.

  Row b of `tokens` continues prefix b // G: its token i attends to the valid
  tokens of its prefix and to its own valid tokens up to i, exactly what
  `apply` with the prefix's prefill cache repeated G times computes (a
  padding token is a query but never a key). The difference is the program:
  every layer's projections and MLP run once, on the prefixes' and the
  continuations' tokens together, and only the attention is split, so the
  forward and backward have one matrix product per weight where the
  prefill-then-cache pair has two. On XLA:CPU that makes the GRPO update of
  SmolLM2 (2 prompts x 4 replies) compile in about a quarter less time.

  Args:
    params: the parameter pytree (either layout: stacked layers run as one
      `lax.scan`, rematerialized by `cfg.remat`).
    prefix_tokens, prefix_positions, prefix_segments: int[P, Lp] (segment 0 is
      padding, as in `apply`).
    tokens, positions, segment_ids: int[P * G, N], the continuations,
      `group_size` consecutive rows per prefix; positions continue the prefix's.
    cfg: the architecture.
    group_size: G.
    num_positions: as in `apply`.
    keep: int32[M], the continuation tokens to run, as flat indices into the
      B * N tokens (an index >= B * N is an empty slot). The projections and
      MLP then run on these M tokens only (a packed stream: short replies do
      not pay for the longest one's padding); the attention still sees them in
      their rows. Every token a kept token attends to must be kept too: keep
      every valid token (`segment_ids != 0`) whose hidden state is needed, and
      the valid tokens before it.

  Returns:
    (f[P, Lp, D] the prefixes', f[P * G, N, D] the continuations'), normalized
    as `apply(..., return_hidden=True)` returns them; with `keep`, the
    continuations' as f[M, D], in `keep`'s order (an empty slot's is garbage).
  """
  (p, lp), (b, n) = prefix_tokens.shape, tokens.shape
  if group_size < 1:
    raise ValueError(f"group_size must be at least 1, got {group_size}")
  if b != p * group_size:
    raise ValueError(f"{b} continuation rows are not {group_size} for each of {p} prefixes")
  if prefix_positions.shape != prefix_tokens.shape or prefix_segments.shape != prefix_tokens.shape:
    raise ValueError("prefix positions and segments must have the prefix tokens' shape "
                     f"{prefix_tokens.shape}")
  if positions.shape != tokens.shape or segment_ids.shape != tokens.shape:
    raise ValueError(f"positions and segments must have the tokens' shape {tokens.shape}")
  _check_layers(params, cfg)
  dtype = _as_dtype(cfg.dtype)
  inv_freq = rope_frequencies(cfg)
  # One stream of tokens, prefixes first: [P * Lp + B * N, D] (as one row, for RoPE),
  # or [P * Lp + M, D] with only the kept continuation tokens.
  flat = lambda a: a.reshape(1, -1, *a.shape[2:])
  packed = (lambda a: a) if keep is None else (
      lambda a: jnp.take(a, keep, axis=1, mode="fill", fill_value=0))
  all_tokens = jnp.concatenate([flat(prefix_tokens), packed(flat(tokens))], axis=1)
  all_positions = jnp.concatenate([flat(prefix_positions), packed(flat(positions))], axis=1)
  tables = rope_tables(all_positions, inv_freq, num_positions)
  x = params["embed"][all_tokens].astype(dtype)
  prefix_mask = attention.Mask.segments(prefix_segments)
  continuation_mask = attention.Mask.after_prefix(
      jnp.repeat(prefix_segments != 0, group_size, axis=0), segment_ids != 0)
  # The einsums read the continuations' keys slots-last (see `with_prefix`).
  slots_last = attention.resolve(cfg.attention) == "xla"
  heads_first = lambda a: a.transpose(0, 2, 1, 3)  # [., T, K, Dh] -> [., K, T, Dh]

  def split(a):
    """[1, P * Lp + B * N (or + M), ...] -> ([P, Lp, ...], [B, N, ...]): a packed
    stream's tokens go back to their rows, zeros between them."""
    rest = a[0, p * lp:]
    if keep is not None:
      rest = jnp.zeros((b * n, *a.shape[2:]), a.dtype).at[keep].set(rest, mode="drop")
    return a[0, :p * lp].reshape(p, lp, *a.shape[2:]), rest.reshape(b, n, *a.shape[2:])

  def with_prefix(prefix, own):
    """The keys (or values) continuation rows see: their prefix's, then their own, f[B, K,
    Lp + N, Dh]. The keys go to the attention slots-last, as a cache holds them: the
    scoring forward of the GRPO update above ran 0.69 s in the other layout, 0.60 s so."""
    return jnp.concatenate([jnp.repeat(heads_first(prefix), group_size, axis=0),
                            heads_first(own)], axis=2)

  def attend(q, k, v):
    (qp, qc), (kp, kc), (vp, vc) = split(q), split(k), split(v)
    keys = with_prefix(kp, kc)
    return jnp.concatenate([
        flat(attention.attend(qp, heads_first(kp), heads_first(vp), prefix_mask,
                              implementation=cfg.attention)),
        packed(flat(attention.attend(
            qc, keys.transpose(0, 1, 3, 2) if slots_last else keys, with_prefix(vp, vc),
            continuation_mask, implementation=cfg.attention, slots_last=slots_last)))],
        axis=1)

  layer_fn = lambda x, layer: _decoder_layer(x, layer, all_positions, inv_freq, tables, cfg,
                                             dtype, attend)
  x = _run_layers(x, params["layers"], layer_fn, cfg.remat)
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  if keep is not None:
    return x[0, :p * lp].reshape(p, lp, -1), x[0, p * lp:]
  return split(x)


def _dense_fm(w: jax.Array, x: jax.Array, dtype) -> jax.Array:
  """w @ x for w f[out, in] and feature-major x f[in, B]: f[out, B], float32 accumulation."""
  y = jnp.einsum("oi,ib->ob", w.astype(dtype), x.astype(dtype),
                 preferred_element_type=jnp.float32)
  return y.astype(dtype)


def _rope_tables_fm(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sin, cos), each f32[Dh/2, B], of the rotation angles at positions int[B], computed
  once for all the layers of a decode step.

  The barrier makes them buffers: without it XLA:CPU fuses the sine and cosine into
  every layer's query and key fusions and evaluates them again for every output
  element (each head, each layout copy). SmolLM2 at batch 32 (float32, 2-core AMX Xeon,
  `jax.profiler` thread time): the key's cache write 134 -> 95 us a layer, the query's
  transpose 189 -> 168 us, about 3 ms of a ~140 ms step; the same tokens and
  log-probabilities bitwise, whole calls alike within this machine's noise."""
  sin, cos = rope_tables(positions[:, None], inv_freq)  # [B, 1, 1, Dh/2] each
  b = positions.shape[0]
  return jax.lax.optimization_barrier((sin.reshape(b, -1).T, cos.reshape(b, -1).T))


def _rope_fm(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """apply_rope for feature-major x f[N, Dh, B], with `_rope_tables_fm`'s sin and cos."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).astype(x.dtype)


def decode_step(params: Params, tokens: jax.Array, positions: jax.Array,
                cfg: TransformerConfig, cache: KVCache,
                vocab_major: bool = False) -> tuple[jax.Array, KVCache]:
  """One new token per row through the cache: f32[B, V] logits and the updated cache.

  The same function as `apply(params, tokens[:, None], positions[:, None],
  cfg, cache=cache)`, computed with feature-major activations f[D, B]: every
  projection is then w[out, in] @ x[in, B]. With few rows, XLA:CPU ran that
  orientation 1.4-1.8x faster than x[B, in] @ w.T at batches 8 and 32 on an
  AVX2 machine; on an AVX-512 one a whole batch-major step is as fast at
  batches 1 and 32 and ~10% slower at 8 (SmolLM2, float32, 2 cores).

  Args:
    params: the parameter pytree.
    tokens: int[B] the tokens to append.
    positions: int[B] their RoPE positions.
    cfg: the architecture.
    cache: a KVCache with at least one free slot.
    vocab_major: return the logits as f32[V, B], the orientation the head's
      matmul produces. At batch 32 on XLA:CPU, asking that product for [B, V]
      instead costs about 20 ms per step (26 against 6 ms for SmolLM2's head),
      a sixth of the whole decode step; the sampler reads them vocab-major.
  """
  if tokens.ndim != 1 or positions.shape != tokens.shape:
    raise ValueError(f"tokens and positions must be int[B], got {tokens.shape} and "
                     f"{positions.shape}")
  params = unstack_layers(params)  # decoding indexes each layer's buffers
  if len(params["layers"]) != cfg.n_layers:
    raise ValueError(f"params have {len(params['layers'])} layers, config says {cfg.n_layers}")
  b = tokens.shape[0]
  if cache.valid.shape[0] != b:
    raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {b}")
  dtype = _as_dtype(cfg.dtype)
  rope = _rope_tables_fm(positions, rope_frequencies(cfg))
  heads, kv_heads, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  groups = heads // kv_heads
  start = cache.index
  valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((b, 1), bool), (0, start))
  # Every valid slot holds a token written before this one (no caller marks a slot valid
  # ahead of its write), in any slot order: a cache used as a ring (`continuous`) too.
  allowed = valid  # [B, S]
  zero = jnp.zeros((), jnp.int32)
  # Gathered straight into [D, B]: `embed[tokens].T` leaves a transposed
  # layout that XLA:CPU carries into the projections, and a bf16 dot with a
  # transposed operand loses its fast kernel (XLA converts the weights to f32,
  # every step).
  x = constrain_rows(jnp.take(params["embed"].T, tokens, axis=1).astype(dtype), cfg,
                     axis=1)  # [D, B]
  f32 = lambda a: attention.rounded_f32(a, dtype)
  kv_f32 = lambda a: attention.cached_f32(a, dtype)
  new_k, new_v = [], []
  for i, layer in enumerate(params["layers"]):
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps, axis=0)
    dense_fm = lambda w, a: _dense_fm(w, a, dtype)
    q, k, v = _project_qkv(layer, h, dense_fm, 0, cfg, dtype)
    q = _rope_fm(q.reshape(heads, dh, b), *rope)
    k = _rope_fm(k.reshape(kv_heads, dh, b), *rope)
    # Keys [B, K, Dh, S] and values [B, K, S, Dh]; one new slot per row.
    k_slot = k.transpose(2, 0, 1)[:, :, :, None].astype(cache.k[i].dtype)
    v_slot = v.reshape(kv_heads, dh, b).transpose(2, 0, 1)[:, :, None, :]
    keys = jax.lax.dynamic_update_slice(cache.k[i], k_slot, (zero, zero, zero, start))
    values = jax.lax.dynamic_update_slice(
        cache.v[i], v_slot.astype(cache.v[i].dtype), (zero, zero, start, zero))
    new_k.append(keys)
    new_v.append(values)
    q_rows = q.reshape(kv_heads, groups, dh, b).transpose(3, 0, 1, 2)  # [B, K, G, Dh]
    scores = jnp.einsum("bkgd,bkds->bkgs", f32(q_rows), kv_f32(keys)) / math.sqrt(dh)
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkgs,bksd->bkgd", f32(probs), kv_f32(values))
    # Row-major [B, H*Dh] @ wo.T, for the same reason as the embedding gather:
    # wo @ attn.T would feed the dot a transposed operand.
    x = x + _dense(attn.reshape(b, heads * dh), layer["wo"], dtype).T
    h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps, axis=0)
    gate, up = _project_gate_up(layer, h, dense_fm, 0)
    x = x + _dense_fm(layer["w_down"], jax.nn.silu(gate.astype(jnp.float32)).astype(dtype) * up,
                      dtype)
  x = rms_norm(x, params["final_norm"], cfg.norm_eps, axis=0)
  w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  logits = jnp.einsum("vd,db->vb", w.astype(dtype), x, preferred_element_type=jnp.float32)
  if not vocab_major:
    # The barrier keeps XLA from folding the transpose into the head's dot:
    # that form has no bf16 x bf16 -> f32 kernel on XLA:CPU (an UNIMPLEMENTED
    # error at run time).
    logits = jax.lax.optimization_barrier(logits).T
  return logits, KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid, index=start + 1)


def fuse_projections(params: Params) -> Params:
  """An inference layout: each layer's q/k/v and gate/up matrices stacked into one.

  Layers get "wqkv" f[(H + 2K) * Dh, D] (and "bqkv") and "w_gate_up" f[2F, D]
  instead of their parts; `apply` and `decode_step` take either layout and
  compute the same function. With a single row each projection is a
  matrix-vector product, bound by reading the weights, and XLA:CPU read two
  large matrices per layer faster than five smaller ones: a float32 SmolLM2
  decode step at batch 1 took 26.6 instead of 28.1 ms; with more rows it
  gained nothing (bf16 at batch 32 was 2-3% slower, about the noise). Stack
  once, outside the calls (`TransformerConfig.decoding_params`): the copy took
  ~70 ms, about what it saves over 64 tokens. Training keeps the separate
  matrices (the checkpoint layout).
  """
  layers = []
  for layer in unstack_layers(params)["layers"]:
    fused = {k: v for k, v in layer.items()
             if k not in ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")}
    fused["wqkv"] = jnp.concatenate([layer["wq"], layer["wk"], layer["wv"]])
    if "bq" in layer:
      fused["bqkv"] = jnp.concatenate([layer["bq"], layer["bk"], layer["bv"]])
    fused["w_gate_up"] = jnp.concatenate([layer["w_gate"], layer["w_up"]])
    layers.append(fused)
  return {**params, "layers": layers}


def cast_params(params: Params, dtype: str) -> Params:
  """Casts every floating leaf to `dtype`."""
  dt = _as_dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)
