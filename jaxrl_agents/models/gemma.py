"""Gemma (2 and 3, text) as a Flax linen module, with the parameters of Google's `gemma` library.

The equations are those of `gemma.gm.nn` (checked against it in
tests/test_gemma.py, f32 to 1e-5): embeddings scaled by sqrt(D); RMSNorm as
x * rsqrt(mean(x^2) + 1e-6) * (1 + scale); queries and keys through their own
RMSNorm (Gemma 3), rotary embeddings with one base frequency for sliding-window
layers and another for global ones, queries scaled by head_dim^-1/2; grouped-query
attention, optionally soft-capped (Gemma 2); local layers see the keys whose
position is within `sliding_window_size` of the query's; norms after attention
and after the MLP; a GELU(tanh)-gated MLP; the LM head is the embedding,
logits optionally soft-capped.

The parameter names and shapes are the library's, so its checkpoints load
unchanged (`load_params`) and its modules run on these params:

```
{"embedder": {"input_embedding": f[V, D]},
 "layer_0": {"pre_attention_norm": {"scale": f[D]},
             "attn": {"q_einsum": {"w": f[N, D, H]}, "kv_einsum": {"w": f[2, K, D, H]},
                      (or "qkv_einsum": {"w": f[3, N, D, H]} when K == N)
                      "attn_vec_einsum": {"w": f[N, H, D]},
                      "_query_norm": {"scale": f[H]}, "_key_norm": {"scale": f[H]}},
             "post_attention_norm": ..., "pre_ffw_norm": ..., "post_ffw_norm": ...,
             "mlp": {"gating_einsum": f[2, F, D], "linear": f[F, D]}},
 ...,
 "final_norm": {"scale": f[D]}}
```

The module follows the `flax_lm` protocol: `__call__(tokens, positions,
attention_mask, kv=None, write_index=None)` returns (final hidden states, kv),
`logits(hidden)` the head, `init_kv(batch, max_len, dtype)` an empty cache:
per layer keys and values f[B, S, K, H], and the RoPE position of every slot
(the sliding window compares positions, not slots).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

LOCAL, GLOBAL = "local", "global"
GEMMA3_PATTERN = (LOCAL,) * 5 + (GLOBAL,)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """A Gemma architecture. Field names follow `gemma.gm.nn.config.TransformerConfig`."""

  num_embed: int
  embed_dim: int
  hidden_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int
  attention_types: tuple[str, ...]  # LOCAL or GLOBAL per layer
  sliding_window_size: int | None = None
  use_post_attn_norm: bool = True
  use_post_ffw_norm: bool = True
  use_qk_norm: bool = True
  attn_logits_soft_cap: float | None = None
  final_logit_softcap: float | None = None
  # The factor on the queries before attention; None: head_dim ** -0.5. (Hugging Face's
  # `query_pre_attn_scalar` is S with the factor S ** -0.5: 256 there is 1/16 here.)
  query_scale: float | None = None
  local_base_frequency: float = 10_000.0
  global_base_frequency: float = 1_000_000.0
  local_scale_factor: float = 1.0
  global_scale_factor: float = 1.0
  transpose_gating_einsum: bool = True
  max_seq_len: int = 32_768  # the context Gemma 3 270M and 1B were trained for (4B: 128K)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    unknown = set(self.attention_types) - {LOCAL, GLOBAL}
    if unknown:
      raise ValueError(f"attention_types must be {LOCAL!r} or {GLOBAL!r}, got {sorted(unknown)}")
    if LOCAL in self.attention_types and not self.sliding_window_size:
      raise ValueError("local (sliding-window) layers need sliding_window_size")
    if self.query_scale is not None and not 0 < self.query_scale < 1:
      raise ValueError(f"query_scale multiplies the queries (head_dim ** -0.5 by default), got "
                       f"{self.query_scale}; Hugging Face's query_pre_attn_scalar S is "
                       "query_scale = S ** -0.5")

  @property
  def num_layers(self) -> int:
    return len(self.attention_types)


def gemma3_layers(num_layers: int) -> tuple[str, ...]:
  """Gemma 3's layer pattern: five sliding-window layers, then a global one, repeated."""
  return tuple(GEMMA3_PATTERN[i % len(GEMMA3_PATTERN)] for i in range(num_layers))


# The published text configurations (`gemma.gm.nn.Gemma3_*`).
GEMMA3_270M = GemmaConfig(num_embed=262_144, embed_dim=640, hidden_dim=2048, num_heads=4,
                          head_dim=256, num_kv_heads=1, attention_types=gemma3_layers(18),
                          sliding_window_size=512)
GEMMA3_1B = GemmaConfig(num_embed=262_144, embed_dim=1152, hidden_dim=6 * 1152, num_heads=4,
                        head_dim=256, num_kv_heads=1, attention_types=gemma3_layers(26),
                        sliding_window_size=512)
GEMMA3_4B = GemmaConfig(num_embed=262_144, embed_dim=2560, hidden_dim=2560 * 4, num_heads=8,
                        head_dim=256, num_kv_heads=4, attention_types=gemma3_layers(34),
                        sliding_window_size=1024, global_scale_factor=8.0, max_seq_len=131_072)
# Tests: every Gemma 3 feature (qk-norm, post norms, local and global layers,
# grouped-query attention) at a size that builds in a second.
TINY_GEMMA3 = GemmaConfig(num_embed=320, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                          num_kv_heads=2, attention_types=(LOCAL, GLOBAL), sliding_window_size=8,
                          max_seq_len=512)
# Tests of the other paths, against the library too: Gemma 2's soft caps and no qk-norm,
# one query head per key head (the library's fused qkv weight), the untransposed gating
# weight, a query scale other than head_dim^-1/2, rope scaling on the global layers.
TINY_GEMMA2 = GemmaConfig(num_embed=320, embed_dim=64, hidden_dim=96, num_heads=2, head_dim=16,
                          num_kv_heads=2, attention_types=(GLOBAL, LOCAL), sliding_window_size=6,
                          use_qk_norm=False, attn_logits_soft_cap=50.0, final_logit_softcap=30.0,
                          query_scale=32 ** -0.5, local_base_frequency=10_000.0,
                          global_base_frequency=10_000.0, global_scale_factor=8.0,
                          transpose_gating_einsum=False, max_seq_len=512)
VARIANTS = {"gemma3-270m": GEMMA3_270M, "gemma3-1b": GEMMA3_1B, "gemma3-4b": GEMMA3_4B,
            "tiny-gemma3": TINY_GEMMA3}


def definition(cfg: GemmaConfig, dtype: str = "float32", param_dtype: str = "float32"):
  """The model definition (`lm.CausalLM`) of a Gemma: this module behind `flax_lm.FlaxLM`."""
  from jaxrl_agents.models import flax_lm

  module = Gemma(cfg, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype))
  return flax_lm.FlaxLM.linen(module, vocab_size=cfg.num_embed, d_model=cfg.embed_dim,
                              n_layers=cfg.num_layers, max_seq_len=cfg.max_seq_len, dtype=dtype,
                              param_dtype=param_dtype)


class RMSNorm(nn.Module):
  """Gemma's RMSNorm: the scale starts at zero and multiplies by (1 + scale)."""

  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return (normed * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float, scale: float) -> jax.Array:
  """Rotates halves of x f[B, T, N, H] by positions int[B, T] (Gemma's rotate-half RoPE)."""
  h = x.shape[-1]
  timescale = base ** ((2.0 / h) * jnp.arange(h // 2, dtype=jnp.float32))
  angles = (positions[..., None] / timescale)[..., None, :] / scale
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x.dtype)


def _weight(module: nn.Module, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
  """A weight under `name/w`, the library's Einsum scope."""
  return module.param(name, lambda rng: {"w": nn.initializers.normal()(rng, shape, dtype)})["w"]


class Attention(nn.Module):
  cfg: GemmaConfig
  attn_type: str
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, positions, mask, key_positions, kv, write_index):
    c, dt = self.cfg, self.dtype
    n, k, h, d = c.num_heads, c.num_kv_heads, c.head_dim, c.embed_dim
    x = x.astype(dt)
    if n == k:
      qkv = _weight(self, "qkv_einsum", (3, n, d, h), self.param_dtype).astype(dt)
      q, key, value = jnp.einsum("BTD,SNDH->SBTNH", x, qkv)
    else:
      q = jnp.einsum("BTD,NDH->BTNH", x,
                     _weight(self, "q_einsum", (n, d, h), self.param_dtype).astype(dt))
      key, value = jnp.einsum("BSD,CKDH->CBSKH", x,
                              _weight(self, "kv_einsum", (2, k, d, h), self.param_dtype).astype(dt))
    if c.use_qk_norm:
      q = RMSNorm(self.param_dtype, name="_query_norm")(q)
      key = RMSNorm(self.param_dtype, name="_key_norm")(key)
    local = self.attn_type == LOCAL
    base = c.local_base_frequency if local else c.global_base_frequency
    scale = c.local_scale_factor if local else c.global_scale_factor
    q = apply_rope(q, positions, base, scale)
    q = q * (c.query_scale if c.query_scale is not None else h ** -0.5)
    key = apply_rope(key, positions, base, scale)
    if kv is not None:  # write the T new keys and values at write_index
      zero = jnp.zeros((), jnp.int32)
      at = (zero, write_index, zero, zero)
      key = jax.lax.dynamic_update_slice(kv["k"], key.astype(kv["k"].dtype), at)
      value = jax.lax.dynamic_update_slice(kv["v"], value.astype(kv["v"].dtype), at)
      kv = {"k": key, "v": value}
    b, t = x.shape[:2]
    qg = q.reshape(b, t, k, n // k, h)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", qg, key.astype(dt),
                        preferred_element_type=jnp.float32)
    if c.attn_logits_soft_cap is not None:
      logits = jnp.tanh(logits / c.attn_logits_soft_cap) * c.attn_logits_soft_cap
    if local:
      q_pos, k_pos = positions[:, :, None], key_positions[:, None, :]
      mask = (mask & (k_pos > q_pos - c.sliding_window_size)
              & (k_pos < q_pos + c.sliding_window_size))
    logits = jnp.where(mask[:, :, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value.astype(dt)).reshape(b, t, n, h)
    w = _weight(self, "attn_vec_einsum", (n, h, d), self.param_dtype).astype(dt)
    return jnp.einsum("BTNH,NHD->BTD", out, w), kv


class FeedForward(nn.Module):
  cfg: GemmaConfig
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    c, dt = self.cfg, self.dtype
    # The MLP's weights are plain arrays in the library's tree (no "w" level).
    normal = nn.initializers.normal()
    if c.transpose_gating_einsum:
      gating = self.param("gating_einsum", normal, (2, c.hidden_dim, c.embed_dim),
                          self.param_dtype)
      gate = jnp.einsum("...F,NHF->...NH", x.astype(dt), gating.astype(dt))
    else:
      gating = self.param("gating_einsum", normal, (2, c.embed_dim, c.hidden_dim),
                          self.param_dtype)
      gate = jnp.einsum("...F,NFH->...NH", x.astype(dt), gating.astype(dt))
    hidden = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    w = self.param("linear", normal, (c.hidden_dim, c.embed_dim), self.param_dtype).astype(dt)
    return jnp.einsum("...H,HF->...F", hidden, w)


class Block(nn.Module):
  cfg: GemmaConfig
  attn_type: str
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, positions, mask, key_positions, kv, write_index):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    norm = lambda name: RMSNorm(self.param_dtype, name=name)  # noqa: E731
    attn, kv = Attention(self.cfg, self.attn_type, name="attn", **kw)(
        norm("pre_attention_norm")(x), positions, mask, key_positions, kv, write_index)
    if self.cfg.use_post_attn_norm:
      attn = norm("post_attention_norm")(attn)
    x = x + attn
    ffw = FeedForward(self.cfg, name="mlp", **kw)(norm("pre_ffw_norm")(x))
    if self.cfg.use_post_ffw_norm:
      ffw = norm("post_ffw_norm")(ffw)
    return x + ffw, kv


class Gemma(nn.Module):
  """Gemma's decoder under the `flax_lm` protocol (see the module docstring)."""

  cfg: GemmaConfig
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def setup(self):
    self.embedder = Embedder(self.cfg.num_embed, self.cfg.embed_dim, self.param_dtype,
                             name="embedder")
    self.blocks = [Block(self.cfg, attn_type, self.dtype, self.param_dtype, name=f"layer_{i}")
                   for i, attn_type in enumerate(self.cfg.attention_types)]
    self.final_norm = RMSNorm(self.param_dtype)

  def __call__(self, tokens, positions, attention_mask, kv=None, write_index=None):
    """(final hidden states f[B, T, D], the updated kv or None); attention_mask is
    bool[B, T, S]: S == T without kv, the kv's slots with it."""
    x = self.embedder.encode(tokens).astype(self.dtype)
    if kv is None:
      key_positions, new_kv = positions, None
    else:
      key_positions = jax.lax.dynamic_update_slice(kv["positions"], positions, (0, write_index))
      new_kv = {"positions": key_positions}
    for i, block in enumerate(self.blocks):
      name = f"layer_{i}"
      x, layer_kv = block(x, positions, attention_mask, key_positions,
                          None if kv is None else kv[name], write_index)
      if kv is not None:
        new_kv[name] = layer_kv
    return self.final_norm(x), new_kv

  def logits(self, hidden):
    """f32[..., V]: the embedding as the head, soft-capped when the config says so."""
    logits = self.embedder.decode(hidden.astype(self.dtype))
    cap = self.cfg.final_logit_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap

  def init_kv(self, batch_size: int, max_len: int, dtype=jnp.float32):
    """An empty cache: per layer keys and values f[B, S, K, H], and each slot's position."""
    c = self.cfg
    shape = (batch_size, max_len, c.num_kv_heads, c.head_dim)
    kv = {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
          for i in range(c.num_layers)}
    kv["positions"] = jnp.zeros((batch_size, max_len), jnp.int32)
    return kv


class Embedder(nn.Module):
  num_embed: int
  embed_dim: int
  param_dtype: Any = jnp.float32

  def setup(self):
    self.input_embedding = self.param("input_embedding", nn.initializers.normal(),
                                      (self.num_embed, self.embed_dim), self.param_dtype)

  def encode(self, tokens):
    x = self.input_embedding[tokens]
    return x * jnp.sqrt(self.embed_dim).astype(x.dtype)

  def decode(self, hidden):
    return jnp.einsum("...D,VD->...V", hidden, self.input_embedding.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def load_checkpoint(path: str) -> dict:
  """The text model's params from a checkpoint of Google's `gemma` library (orbax).

  Reads the library's layouts: the nested tree `gm.ckpts.save_params` writes (the
  model's `init` params), the flat legacy one of the published checkpoints (keys
  "transformer/layer_0/attn/q_einsum", MLP weights under a "w"), and a Kauldron
  training checkpoint (its "params"; its whole state is read first, optimizer
  moments too, so that one needs about three times the params' memory).
  Multimodal weights are left out.
  """
  import orbax.checkpoint as ocp

  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no Gemma checkpoint directory at {path!r}")
  if os.path.isdir(os.path.join(path, "default")) and not os.path.exists(
      os.path.join(path, "_METADATA")):
    path = os.path.join(path, "default")  # a Kauldron checkpoint keeps its state one level down
  tree = ocp.StandardCheckpointer().restore(path)
  if set(tree) == {"collections", "opt_state", "params", "step"}:
    tree = tree["params"]
  if any(k.startswith("transformer/stacked_layers") for k in tree):
    raise ValueError(f"{path!r} holds the library's stacked layout; save it nested "
                     "(gm.ckpts.load_params then gm.ckpts.save_params) and load that")
  if tree and all(k.startswith(("transformer/", "SigLiPFromPatches_0/")) for k in tree):
    nested: dict = {}
    for key, value in tree.items():
      if not key.startswith("transformer/"):
        continue
      parts = key.split("/")[1:]
      if "mlp" in parts[:-1]:  # "layer_0/mlp/linear": {"w": x} -> "layer_0/mlp/linear": x
        value = value["w"]
      node = nested
      for part in parts[:-1]:
        node = node.setdefault(part, {})
      node[parts[-1]] = value
    tree = nested
  tree = {k: v for k, v in tree.items() if k != "vision_encoder"}
  if "embedder" in tree:
    tree["embedder"] = {"input_embedding": tree["embedder"]["input_embedding"]}
  return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
