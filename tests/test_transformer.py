"""The decoder's internal consistency: cache vs full forward, padding, packing, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import attention, lm, transformer, zoo

# Jitted once per (cfg, shape): eager scans compile op by op and are slower.
_apply = jax.jit(transformer.apply, static_argnums=3, static_argnames="return_hidden")


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "tiny-llama3"])
def model(request):
  return zoo.load(request.param)


def _forward(params, cfg, tokens, mask=None):
  tokens = jnp.asarray(tokens)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
  positions = lm.positions_from_mask(mask)
  logits, _ = _apply(params, tokens, positions, cfg, segment_ids=mask.astype(jnp.int32))
  return np.asarray(logits)


def test_init_shapes_and_param_count(model):
  n = sum(x.size for x in jax.tree.leaves(model.params))
  assert n == model.cfg.num_params
  assert len(model.params["layers"]) == model.cfg.n_layers
  assert model.params["layers"][0]["wq"].shape == (
      model.cfg.n_heads * model.cfg.head_dim, model.cfg.d_model)


def test_cached_decoding_matches_full_forward(model):
  """Prefill half a sequence, then feed tokens one at a time: same logits as one pass."""
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, cfg.vocab_size, size=(2, 12)).astype(np.int32)
  full = _forward(params, cfg, tokens)
  cache = transformer.init_cache(cfg, 2, 16)
  pos = np.broadcast_to(np.arange(12), (2, 12))
  step_logits = []
  logits, cache = _apply(params, jnp.asarray(tokens[:, :6]), jnp.asarray(pos[:, :6]),
                                    cfg, cache=cache)
  step_logits.append(np.asarray(logits))
  for t in range(6, 12):
    logits, cache = _apply(params, jnp.asarray(tokens[:, t:t + 1]),
                                      jnp.asarray(pos[:, t:t + 1]), cfg, cache=cache)
    step_logits.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(step_logits, axis=1), full, atol=2e-5, rtol=1e-5)
  assert int(cache.index) == 12


def test_prefill_into_a_new_cache_equals_apply_with_an_empty_cache(model):
  """new_cache_len: attention over the prompt only, the same hidden states and cache."""
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 7)), jnp.int32)
  mask = np.ones((2, 7), bool)
  mask[1, :3] = False
  positions = lm.positions_from_mask(jnp.asarray(mask))
  segments = jnp.asarray(mask, jnp.int32)
  want, want_cache = _apply(params, tokens, positions, cfg, segment_ids=segments,
                            cache=transformer.init_cache(cfg, 2, 10), return_hidden=True)
  prefill = jax.jit(transformer.apply, static_argnums=3,
                    static_argnames=("return_hidden", "new_cache_len", "num_positions"))
  got, cache = prefill(params, tokens, positions, cfg, segment_ids=segments, return_hidden=True,
                       new_cache_len=10, num_positions=7)
  real = mask[:, :, None]  # padding rows attend to nothing either way; compare real tokens
  np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=2e-5, rtol=1e-5)
  assert int(cache.index) == 7 and cache.k[0].shape == want_cache.k[0].shape
  assert cache.k[0].shape == (2, cfg.n_kv_heads, cfg.head_dim, 10)  # keys slots-last
  assert cache.v[0].shape == (2, cfg.n_kv_heads, 10, cfg.head_dim)
  np.testing.assert_array_equal(np.asarray(cache.valid), np.asarray(want_cache.valid))
  for a, b in zip(cache.k + cache.v, want_cache.k + want_cache.v, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="new_cache_len 5 < 7"):
    transformer.apply(params, tokens, positions, cfg, new_cache_len=5)


@pytest.mark.parametrize("prefix_len", [7, 70])  # 70: the prefix's causal attention in blocks
def test_shared_prefix_pass_equals_the_prefill_then_its_repeated_cache(model, prefix_len):
  """apply_shared_prefix: P prefixes and G continuations of each in one pass give what the
  prefixes' prefill, then the continuations against the cache repeated G times, give; in
  either params layout."""
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(5)
  p, g, n = 2, 3, 5
  prefix = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(p, prefix_len)), jnp.int32)
  prefix_mask = np.ones((p, prefix_len), bool)
  prefix_mask[1, :3] = False  # left padding
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(p * g, n)), jnp.int32)
  mask = np.ones((p * g, n), bool)
  mask[1, 3:] = False  # a reply that ended early
  mask[4, 2] = False  # a gap, as between turns
  prefix_positions = lm.positions_from_mask(jnp.asarray(prefix_mask))
  positions = (jnp.repeat(prefix_positions[:, -1:], g, axis=0) + 1
               + lm.positions_from_mask(jnp.asarray(mask)))
  prefix_segments, segments = jnp.asarray(prefix_mask, jnp.int32), jnp.asarray(mask, jnp.int32)

  prefill = jax.jit(transformer.apply, static_argnums=3,
                    static_argnames=("return_hidden", "new_cache_len"))
  want_prefix, cache = prefill(params, prefix, prefix_positions, cfg, segment_ids=prefix_segments,
                               return_hidden=True, new_cache_len=prefix_len + n)
  want, _ = _apply(params, tokens, positions, cfg, segment_ids=segments,
                   cache=lm.repeat_cache(cache, g), return_hidden=True)
  shared = jax.jit(transformer.apply_shared_prefix, static_argnums=7,
                   static_argnames=("group_size",))
  real = prefix_mask[:, :, None]  # a padding query attends to nothing in the prefill
  stacked = transformer.stack_layers(params)
  for layout, c in ((params, cfg), (stacked, cfg), (stacked, cfg.replace(remat="full"))):
    got_prefix, got = shared(layout, prefix, prefix_positions, prefix_segments, tokens,
                             positions, segments, c, group_size=g)
    np.testing.assert_allclose(np.asarray(got_prefix) * real, np.asarray(want_prefix) * real,
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  # Stacked q/k/v and gate/up weights (`fuse_projections`), through the config's member.
  got_prefix, got = jax.jit(lambda fused: cfg.apply_shared_prefix(
      fused, prefix, prefix_positions, prefix_segments, tokens, positions, segments,
      group_size=g))(transformer.fuse_projections(params))
  np.testing.assert_allclose(np.asarray(got_prefix) * real, np.asarray(want_prefix) * real,
                             atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  # bfloat16 compute: the same products in another grouping, so equal up to bf16 rounding.
  bf16 = cfg.replace(dtype="bfloat16")
  want_prefix, cache = prefill(params, prefix, prefix_positions, bf16, segment_ids=prefix_segments,
                               return_hidden=True, new_cache_len=prefix_len + n)
  want, _ = _apply(params, tokens, positions, bf16, segment_ids=segments,
                   cache=lm.repeat_cache(cache, g), return_hidden=True)
  got_prefix, got = shared(params, prefix, prefix_positions, prefix_segments, tokens, positions,
                           segments, bf16, group_size=g)
  assert got.dtype == want.dtype == jnp.bfloat16
  f32 = lambda a: np.asarray(a, np.float32)
  np.testing.assert_allclose(f32(got_prefix) * real, f32(want_prefix) * real, atol=0.1, rtol=0.05)
  np.testing.assert_allclose(f32(got), f32(want), atol=0.1, rtol=0.05)

  # The scanned layers' gradient is the listed layers', stacked.
  weights = jax.random.normal(jax.random.key(1), want.shape)

  def objective(layout, c):
    _, hidden = transformer.apply_shared_prefix(layout, prefix, prefix_positions,
                                                prefix_segments, tokens, positions, segments,
                                                c, group_size=g)
    return jnp.sum(hidden * weights)

  grad = jax.jit(jax.grad(objective), static_argnums=1)
  want_grad = transformer.stack_layers(grad(params, cfg))
  for c in (cfg, cfg.replace(remat="full")):
    for a, b in zip(jax.tree.leaves(want_grad), jax.tree.leaves(grad(stacked, c)), strict=True):
      # float32 summation order differs between the scan and the list: relative to the
      # array's scale (entries reach ~40), not to each entry (on an AMD EPYC one entry of
      # 4096, -0.0106, differed by 1.3e-5)
      scale = float(np.abs(np.asarray(a)).max())
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6 * max(scale, 10.0),
                                 rtol=1e-4)
  with pytest.raises(ValueError, match="6 continuation rows are not 2 for each of 2"):
    transformer.apply_shared_prefix(params, prefix, prefix_positions, prefix_segments, tokens,
                                    positions, segments, cfg, group_size=2)
  with pytest.raises(ValueError, match="group_size must be at least 1, got 0"):
    cfg.apply_shared_prefix(params, prefix, prefix_positions, prefix_segments, tokens,
                            positions, segments, group_size=0)
  with pytest.raises(ValueError, match="params have 2 layers, config says 3"):
    cfg.replace(n_layers=3).apply_shared_prefix(params, prefix, prefix_positions,
                                                prefix_segments, tokens, positions, segments,
                                                group_size=g)


def test_rope_tables_from_a_table_equal_the_direct_angles():
  inv_freq = transformer.rope_frequencies(zoo.load("tiny").cfg)
  positions = jnp.asarray([[0, 1, 5, 63], [7, 7, 0, 62]], jnp.int32)
  direct = transformer.rope_tables(positions, inv_freq)
  table = transformer.rope_tables(positions, inv_freq, num_positions=64)
  for a, b in zip(direct, table, strict=True):
    assert a.shape == b.shape == (2, 4, 1, inv_freq.shape[0])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_decode_step = jax.jit(transformer.decode_step, static_argnums=(3, 5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_matches_cached_apply(model, dtype):
  """The feature-major single-token path computes what `apply` computes with a cache."""
  cfg = model.cfg.replace(dtype=dtype)
  params = model.params
  rng = np.random.default_rng(1)
  tokens = rng.integers(3, cfg.vocab_size, size=(3, 7)).astype(np.int32)
  mask = np.ones((3, 7), bool)
  mask[0, :2] = False  # left padding: the padded slots stay invisible while decoding
  mask[2, :5] = False
  positions = lm.positions_from_mask(jnp.asarray(mask))
  cache = transformer.init_cache(cfg, 3, 11)
  _, cache = _apply(params, jnp.asarray(tokens), positions, cfg,
                    segment_ids=jnp.asarray(mask, jnp.int32), cache=cache)
  reference, by_step = cache, cache
  next_pos = positions[:, -1] + 1
  for step in range(3):
    new = jnp.asarray(rng.integers(3, cfg.vocab_size, size=3), jnp.int32)
    want, reference = _apply(params, new[:, None], (next_pos + step)[:, None], cfg,
                             cache=reference)
    vocab_major, _ = _decode_step(params, new, next_pos + step, cfg, by_step, True)
    got, by_step = _decode_step(params, new, next_pos + step, cfg, by_step)
    tol = 2e-5 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, 0]), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(vocab_major), np.asarray(got).T, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(by_step), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=tol, rtol=tol)


def test_fused_projections_compute_the_same_function(model):
  """Stacked q/k/v (with their biases) and gate/up matrices: the same logits and
  cache, through `apply` (prefill) and `decode_step`."""
  cfg, params = model.cfg, model.params
  fused = transformer.fuse_projections(params)
  assert "wq" not in fused["layers"][0] and "w_gate" not in fused["layers"][0]
  assert fused["layers"][0]["wqkv"].shape == (
      (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.d_model)
  assert ("bqkv" in fused["layers"][0]) == cfg.qkv_bias
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(1, 5)), jnp.int32)
  want_logits, cache = _apply(params, tokens, jnp.arange(5)[None], cfg,
                              cache=transformer.init_cache(cfg, 1, 8))
  got_logits, fused_cache = _apply(fused, tokens, jnp.arange(5)[None], cfg,
                                   cache=transformer.init_cache(cfg, 1, 8))
  np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fused_cache), jax.tree.leaves(cache), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  new, position = tokens[:, -1], jnp.full((1,), 5)
  want, want_cache = _decode_step(params, new, position, cfg, cache, True)
  got, got_cache = _decode_step(fused, new, position, cfg, cache, True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_bfloat16_decoding_with_a_float32_cache_equals_a_bfloat16_cache(model):
  """Keys and values are rounded to bf16 before they are stored, so a float32 cache
  holds exactly the bf16 cache's numbers and decoding gives the same logits."""
  cfg = model.cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  params = transformer.cast_params(model.params, "bfloat16")
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 6)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  caches = {}
  for cache_dtype in ("bfloat16", "float32"):
    cache = transformer.init_cache(cfg, 2, 9, dtype=cache_dtype)
    _, cache = _apply(params, tokens, positions, cfg, cache=cache)
    logits = []
    for step in range(3):
      new = tokens[:, step]
      out, cache = _decode_step(params, new, jnp.full((2,), 6 + step), cfg, cache, False)
      logits.append(np.asarray(out))
    caches[cache_dtype] = (cache, np.stack(logits))
  (c16, l16), (c32, l32) = caches["bfloat16"], caches["float32"]
  assert c32.k[0].dtype == jnp.float32
  for a, b in zip(c16.k + c16.v, c32.k + c32.v, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
  np.testing.assert_allclose(l32, l16, atol=1e-5, rtol=1e-5)


def test_decode_step_rejects_bad_shapes(tiny_model):
  cfg, params = tiny_model.cfg, tiny_model.params
  cache = transformer.init_cache(cfg, 2, 4)
  with pytest.raises(ValueError, match="int\\[B\\]"):
    transformer.decode_step(params, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                            cfg, cache)
  with pytest.raises(ValueError, match="cache batch"):
    transformer.decode_step(params, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32),
                            cfg, cache)


def test_left_padding_does_not_change_logits(model):
  cfg, params = model.cfg, model.params
  seq = np.arange(5, 14, dtype=np.int32)
  alone = _forward(params, cfg, seq[None])[0]
  padded = np.concatenate([np.zeros(4, np.int32), seq])[None]
  mask = np.concatenate([np.zeros(4, bool), np.ones(9, bool)])[None]
  out = _forward(params, cfg, padded, mask)[0, 4:]
  np.testing.assert_allclose(out, alone, atol=2e-5, rtol=1e-5)


def test_packed_segments_do_not_attend_across(model):
  cfg, params = model.cfg, model.params
  a = np.array([5, 6, 7, 8], np.int32)
  b = np.array([9, 10, 11], np.int32)
  packed = np.concatenate([a, b])[None]
  seg = np.array([[1, 1, 1, 1, 2, 2, 2]], np.int32)
  pos = np.array([[0, 1, 2, 3, 0, 1, 2]], np.int32)
  logits, _ = _apply(params, jnp.asarray(packed), jnp.asarray(pos), cfg,
                                segment_ids=jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(logits)[0, 4:], _forward(params, cfg, b[None])[0],
                             atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(logits)[0, :4], _forward(params, cfg, a[None])[0],
                             atol=2e-5, rtol=1e-5)


def test_causal_attention_in_query_blocks_equals_one_block(model, monkeypatch):
  """Queries in blocks against the keys up to each block's end: the same logits and
  gradients as one block, with left padding, packed segments and a ragged last block."""
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 19)), jnp.int32)
  segments = jnp.asarray([[0] * 6 + [1] * 13, [1] * 8 + [2] * 9 + [0] * 2], jnp.int32)
  positions = jnp.asarray([[0] * 6 + list(range(13)), list(range(8)) + list(range(9)) + [0, 0]])

  def run(block):
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)

    def loss(p):
      logits, _ = transformer.apply(p, tokens, positions, cfg, segment_ids=segments)
      return (jax.nn.log_softmax(logits) * (segments != 0)[..., None]).sum() * -1e-3, logits
    # A fresh jit per block size: the block is read when the function is traced.
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (l_one, logits_one), g_one = run(10 ** 6)
  (l_blocks, logits_blocks), g_blocks = run(4)
  np.testing.assert_allclose(np.asarray(logits_blocks), np.asarray(logits_one),
                             rtol=1e-5, atol=2e-5)
  assert float(l_blocks) == pytest.approx(float(l_one), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g_blocks), jax.tree.leaves(g_one), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n_in,n_out", [(24, 40), (40, 24)])  # both weight-gradient layouts
@pytest.mark.parametrize("x_dtype,w_dtype,dtype,out_dtype", [
    ("float32", "float32", "float32", "float32"),
    ("float32", "float32", "bfloat16", "bfloat16"),  # bf16 compute, f32 params
    ("bfloat16", "float32", "bfloat16", "float32"),  # the head: f32 logits
    ("float32", "float32", "float16", "float32"),  # float16 keeps the wider products
])
def test_projection_gradients_equal_the_products(n_in, n_out, x_dtype, w_dtype, dtype, out_dtype):
  """transformer.project has its own derivative (the weight gradient's layout): its values
  equal the einsum's, its gradients the products of the operands in the compute dtype
  (float64 here), with the output's gradient rounded to bfloat16 first in bf16 compute
  (as autocast does) and kept as it is otherwise."""
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (3, 5, n_in)).astype(x_dtype)
  w = jax.random.normal(kw, (n_out, n_in)).astype(w_dtype)
  cot = jax.random.normal(kg, (3, 5, n_out))
  dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)

  def einsum(x, w):
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32).astype(out_dtype)

  def loss(x, w):
    return (transformer.project(x, w, dtype, out_dtype).astype(jnp.float32) * cot).sum()

  # Jitted: XLA:CPU then compiles the backward's transposes and products together, where
  # a bf16 product's layout decides whether it has a kernel at all.
  got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  np.testing.assert_array_equal(transformer.project(x, w, dtype, out_dtype), einsum(x, w))
  g_out = cot.astype(out_dtype)  # the gradient that reaches project's output
  if dtype == jnp.bfloat16:
    g_out = g_out.astype(dtype)
  g64, x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64)
                   for a in (g_out, x.astype(dtype), w.astype(dtype)))
  want = g64 @ w64, g64.reshape(-1, n_out).T @ x64.reshape(-1, n_in)
  for g, ref, primal in zip(got, want, (x, w), strict=True):
    assert g.dtype == primal.dtype and g.shape == primal.shape
    # float32 sums of exact products; a bf16 gradient is then rounded once (2^-9).
    tol = 1e-5 if g.dtype == jnp.float32 else 4e-3
    np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=tol,
                               atol=tol * np.abs(ref).max())


def test_bfloat16_compute_is_close_to_float32(tiny_model):
  cfg, params = tiny_model.cfg, tiny_model.params
  tokens = np.arange(3, 19, dtype=np.int32)[None]
  f32 = _forward(params, cfg, tokens)
  bf16 = _forward(transformer.cast_params(params, "bfloat16"),
                  cfg.replace(dtype="bfloat16", param_dtype="bfloat16"), tokens)
  assert bf16.dtype == np.float32  # logits stay f32
  assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()
  assert np.abs(bf16 - f32).max() > 0  # really computed in lower precision


def test_return_hidden_then_head_equals_logits(tiny_model):
  cfg, params = tiny_model.cfg, tiny_model.params
  tokens = jnp.arange(3, 11, dtype=jnp.int32)[None]
  pos = jnp.arange(8)[None]
  hidden, _ = _apply(params, tokens, pos, cfg, return_hidden=True)
  assert hidden.shape == (1, 8, cfg.d_model)
  logits, _ = _apply(params, tokens, pos, cfg)
  np.testing.assert_allclose(transformer.lm_head(params, hidden, cfg), logits, atol=1e-5)


def test_llama3_rope_scaling_by_hand():
  cfg = zoo.TINY_LLAMA3
  inv = np.asarray(transformer.rope_frequencies(cfg))
  base = 1.0 / (cfg.rope_theta ** (np.arange(cfg.head_dim // 2) * 2 / cfg.head_dim))
  factor, low, high, original = cfg.rope_scaling
  wavelen = 2 * np.pi / base
  expected = []
  for f, w in zip(base, wavelen, strict=True):
    if w < original / high:
      expected.append(f)
    elif w > original / low:
      expected.append(f / factor)
    else:
      smooth = (original / w - low) / (high - low)
      expected.append((1 - smooth) * f / factor + smooth * f)
  np.testing.assert_allclose(inv, np.array(expected), rtol=1e-6)
  assert not np.allclose(inv, base)  # the scaling did something at these settings


def test_bad_shapes_raise_clear_errors(tiny_model):
  cfg, params = tiny_model.cfg, tiny_model.params
  with pytest.raises(ValueError, match="tokens must be int"):
    transformer.apply(params, jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), cfg)
  with pytest.raises(ValueError, match="positions shape"):
    transformer.apply(params, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 3), jnp.int32), cfg)
  with pytest.raises(ValueError, match="multiple of n_kv_heads"):
    cfg.replace(n_heads=5)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_the_stacked_layout_gives_the_same_logits_and_gradients(remat):
  """One lax.scan over stacked layers (rematerialized or not) against the per-layer list."""
  from jaxrl_agents.models import zoo

  model = zoo.load("tiny-qwen2")  # q/k/v biases too
  cfg, params = model.cfg, model.params
  stacked = transformer.stack_layers(params)
  assert transformer.is_stacked(stacked) and stacked["layers"]["wq"].shape[0] == cfg.n_layers
  tokens = jnp.asarray([[0, 0, 5, 9, 3, 7], [4, 8, 1, 2, 6, 3]])
  mask = jnp.asarray([[False, False, True, True, True, True], [True] * 6])
  positions = lm.positions_from_mask(mask)
  segments = mask.astype(jnp.int32)

  def loss(p, **kw):
    logits, _ = transformer.apply(p, tokens, positions, cfg, segment_ids=segments, **kw)
    return jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0).sum() * -1e-3, logits

  (l0, logits0), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  (l1, logits1), g1 = jax.jit(jax.value_and_grad(
      lambda p: loss(p, remat=remat), has_aux=True))(stacked)
  np.testing.assert_allclose(np.asarray(logits1), np.asarray(logits0), rtol=1e-5, atol=1e-5)
  assert float(l1) == pytest.approx(float(l0), rel=1e-5)
  g1 = transformer.unstack_layers(g1)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  # A pass with a cache reads stacked params too (unstacked inside).
  cached, _ = transformer.apply(stacked, tokens, positions, cfg, segment_ids=segments,
                                new_cache_len=8)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(logits0), rtol=1e-5, atol=1e-5)
  assert transformer.unstack_layers(stacked)["layers"][1]["wq"].shape == \
      params["layers"][1]["wq"].shape
  with pytest.raises(ValueError, match="remat must be one of"):
    transformer.apply(stacked, tokens, positions, cfg, remat="some")


def test_a_stacked_grpo_update_of_smollm2_keeps_its_temporaries_small(smollm2):
  """GRPO's update with each group's prompt shared through a KV cache unstacks the layers
  inside the gradient. Indexed (w[i]), XLA kept a whole-stack gradient per layer: 25 GB
  of temporaries for 8 rows of SmolLM2, an out-of-memory on this machine, against 1.1 GB
  in the per-layer list. Split, it is about 1.3 GB."""
  from experiments import grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents import types

  c = grpo_arithmetic.get_config()
  c.layout, c.remat, c.prompts_per_step, c.group_size, c.kl_coef = "stacked", "dots", 2, 4, 0.04
  algorithm = grpo.GRPO(c, smollm2.cfg)
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  state = jax.eval_shape(lambda p: algorithm.init_state(transformer.stack_layers(p), None),
                         jax.tree.map(spec, smollm2.params))
  b, t = 8, 80
  traj = jax.eval_shape(lambda: types.single_turn(
      jnp.zeros((b, 48), jnp.int32), jnp.ones((b, 48), bool), jnp.zeros((b, 32), jnp.int32),
      jnp.ones((b, 32), bool), jnp.zeros((b, 32))))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  batch = grpo.GRPOBatch(traj=traj, advantages=f32(b), old_logp=f32(b, t), ref_logp=f32(b, t),
                         correct=f32(b))
  compiled = algorithm._update._jitted.lower(state, batch, jax.random.key(1), f32()).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 3e9
