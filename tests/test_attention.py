"""Attention implementations against the plain softmax over a materialized mask, and the
masks against the ones `lm` materializes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import attention, lm, transformer, zoo
from jaxrl_agents.models.attention import Mask

CPU_IMPLEMENTATIONS = ("xla", "chunked")

# Left padding, right padding, two packed segments with a hole, one all-padding row.
SEGMENTS = np.array([
    [0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 1, 2, 2, 0, 2, 2],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
], np.int32)


def _qkv(rng, b, t, s, heads=4, kv_heads=2, dh=8):
  q = rng.normal(size=(b, t, heads, dh)).astype(np.float32)
  k = rng.normal(size=(b, s, kv_heads, dh)).astype(np.float32)
  v = rng.normal(size=(b, s, kv_heads, dh)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _run(implementation, q, k, v, mask):
  """attend on [B, S, K, Dh] keys and values, the layout `reference` takes."""
  heads_first = lambda a: a.transpose(0, 2, 1, 3)
  return attention.attend(q, heads_first(k), heads_first(v), mask,
                          implementation=implementation)


def test_segment_mask_is_the_materialized_one():
  seg = jnp.asarray(SEGMENTS)
  np.testing.assert_array_equal(np.asarray(Mask.segments(seg).as_bool(seg.shape[1])),
                                np.asarray(lm.attention_allowed(seg)))


def test_segment_mask_starts_each_segment_by_hand():
  """Row 2: segment 1 at slots 0-2 and 4 (slot 3 a hole), segment 2 from slot 5."""
  k_start = np.asarray(Mask.segments(jnp.asarray(SEGMENTS)).k_start)
  np.testing.assert_array_equal(k_start[2], [0, 0, 0, 0, 0, 5, 5, 5, 5, 5])
  np.testing.assert_array_equal(k_start[0, 3:], [3] * 7)


def test_cached_mask_is_the_materialized_one():
  valid = jnp.asarray([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 1, 0, 0]], bool)
  got = Mask.cached(valid, jnp.int32(3), 3).as_bool(3)
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(lm.cached_attention_allowed(valid, jnp.int32(3), 3)))


def test_after_prefix_mask_by_hand():
  prefix_valid = jnp.asarray([[0, 1, 1], [0, 0, 0]], bool)
  own_valid = jnp.asarray([[1, 1, 0, 1], [0, 1, 1, 0]], bool)
  got = np.asarray(Mask.after_prefix(prefix_valid, own_valid).as_bool(4))
  own = np.tril(np.ones((4, 4), bool))[None] & np.asarray(own_valid)[:, None, :]
  want = np.concatenate([np.broadcast_to(np.asarray(prefix_valid)[:, None, :], (2, 4, 3)),
                         own], -1)
  np.testing.assert_array_equal(got, want)
  # Row 1's first token sees nothing (no prefix, itself padding): it attends not at all.
  assert not got[1, 0].any()


def _masks(rng):
  """(name, mask, q, k, v) for each kind of pass, keys [B, S, K, Dh]."""
  b, t = SEGMENTS.shape
  seg = Mask.segments(jnp.asarray(SEGMENTS))
  valid = jnp.asarray(rng.random((2, 16)) < 0.7)
  cached = Mask.cached(valid, jnp.int32(9), 4)
  after = Mask.after_prefix(jnp.asarray(rng.random((3, 6)) < 0.6),
                            jnp.asarray(rng.random((3, 5)) < 0.8))
  return [("segments", seg, *_qkv(rng, b, t, t)),
          ("cached", cached, *_qkv(rng, 2, 4, 16)),
          ("after_prefix", after, *_qkv(rng, 3, 5, 11))]


def _weighted_grads(f, q, k, v, mask, w):
  return jax.grad(lambda q, k, v: (f(q, k, v, mask) * w).sum(), (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS)
def test_implementations_equal_the_reference_forward_and_backward(implementation):
  rng = np.random.default_rng(0)
  for name, mask, q, k, v in _masks(rng):
    np.testing.assert_allclose(np.asarray(_run(implementation, q, k, v, mask)),
                               np.asarray(attention.reference(q, k, v, mask)),
                               atol=1e-5, rtol=1e-5, err_msg=name)
    w = jnp.asarray(rng.normal(size=(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])),
                    jnp.float32)
    got = _weighted_grads(lambda *a: _run(implementation, *a), q, k, v, mask, w)
    want = _weighted_grads(attention.reference, q, k, v, mask, w)
    for g, r, arg in zip(got, want, "qkv", strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4,
                                 err_msg=f"{name}: d{arg}")


def test_a_query_that_sees_no_key_gets_zeros():
  rng = np.random.default_rng(1)
  seg = Mask.segments(jnp.asarray(SEGMENTS))
  q, k, v = _qkv(rng, *SEGMENTS.shape, SEGMENTS.shape[1])
  for implementation in CPU_IMPLEMENTATIONS:
    out = np.asarray(_run(implementation, q, k, v, seg))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[3], 0.0)  # the all-padding row
    np.testing.assert_array_equal(out[0, :3], 0.0)  # left padding


def test_chunked_over_several_chunks_equals_the_reference():
  """Rows longer than both chunk sizes, not a multiple of either, packed and padded."""
  t = attention.CHUNK[1] + 77
  rng = np.random.default_rng(2)
  seg = np.ones((2, t), np.int32)
  seg[0, :40] = 0
  seg[1, 300:] = 2
  seg[1, -13:] = 0
  mask = Mask.segments(jnp.asarray(seg))
  q, k, v = _qkv(rng, 2, t, t, heads=2, kv_heads=1, dh=4)
  np.testing.assert_allclose(np.asarray(_run("chunked", q, k, v, mask)),
                             np.asarray(attention.reference(q, k, v, mask)),
                             atol=1e-5, rtol=1e-5)


def test_padding_to_even_lengths_changes_nothing():
  # cuDNN's path pads odd query and key counts (its backward refuses them); the padding
  # is checked here through "chunked", the same tokamax call, against the reference.
  rng = np.random.default_rng(3)
  odd = Mask.segments(jnp.asarray(SEGMENTS[:, :9]))
  cases = [("segments, T = S = 9", odd, *_qkv(rng, 4, 9, 9))] + [
      c for c in _masks(rng) if c[0] == "after_prefix"]  # T = 5, S = 11
  ops, tokamax_mask = attention._tokamax_ops()
  for name, mask, q, k, v in cases:
    qp, kp, vp, padded, t = attention.pad_to_even(q, k, v, mask)
    assert qp.shape[1] % 2 == 0 and kp.shape[1] % 2 == 0 and t == q.shape[1], name

    def padded_attention(q, k, v, mask=mask):
      qp, kp, vp, padded, t = attention.pad_to_even(q, k, v, mask)
      out = attention._tokamax_op(ops["chunked"], tokamax_mask, qp, kp, vp, padded)
      return out[:, :t].reshape(q.shape[0], t, -1)
    np.testing.assert_allclose(np.asarray(padded_attention(q, k, v)),
                               np.asarray(attention.reference(q, k, v, mask)),
                               atol=1e-5, rtol=1e-5, err_msg=name)
    w = jnp.asarray(rng.normal(size=(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])),
                    jnp.float32)
    got = _weighted_grads(lambda q, k, v, _: padded_attention(q, k, v), q, k, v, mask, w)
    want = _weighted_grads(attention.reference, q, k, v, mask, w)
    for g, r, arg in zip(got, want, "qkv", strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4,
                                 err_msg=f"{name}: d{arg}")


def _grad_temp_bytes(implementation: str, t: int) -> int:
  """XLA's compiled temporaries of attention's gradient at T = S = t (shapes only)."""
  q = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
  loss = lambda q, k, v, seg: _run(implementation, q, k, v, Mask.segments(seg)).sum()
  grad = jax.jit(jax.grad(loss, (0, 1, 2)))
  return grad.lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly_where_the_einsums_grow_quadratically():
  # 4x the row: "chunked" keeps each chunk's scores only (about 4x the temporaries),
  # "xla" every causal block's against all earlier keys (about 16x).
  chunked = _grad_temp_bytes("chunked", 4096) / _grad_temp_bytes("chunked", 1024)
  xla = _grad_temp_bytes("xla", 4096) / _grad_temp_bytes("xla", 1024)
  assert chunked < 5.0, chunked
  assert xla > 10.0, xla


def test_bf16_inputs_stay_near_the_float32_reference():
  rng = np.random.default_rng(3)
  _, mask, q, k, v = _masks(rng)[0]
  want = np.asarray(attention.reference(q, k, v, mask))
  bf = lambda a: a.astype(jnp.bfloat16)
  for implementation in CPU_IMPLEMENTATIONS:
    got = _run(implementation, bf(q), bf(k), bf(v), mask)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2, rtol=5e-2)


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def test_the_transformer_gives_the_same_logits_and_gradients_under_chunked(tiny):
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(3, tiny.cfg.vocab_size, size=SEGMENTS.shape), jnp.int32)
  seg = jnp.asarray(SEGMENTS)
  positions = lm.positions_from_mask(seg != 0)

  def loss(params, cfg):
    logits, _ = transformer.apply(params, tokens, positions, cfg, segment_ids=seg)
    return (jax.nn.log_softmax(logits) * (seg != 0)[..., None]).sum() * -1e-3, logits

  results = {name: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
      tiny.params, tiny.cfg.replace(attention=name)) for name in CPU_IMPLEMENTATIONS}
  (l_x, logits_x), g_x = results["xla"]
  (l_c, logits_c), g_c = results["chunked"]
  np.testing.assert_allclose(np.asarray(logits_c), np.asarray(logits_x), atol=2e-5, rtol=1e-5)
  assert float(l_c) == pytest.approx(float(l_x), rel=1e-6)
  for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_x), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_shared_prefix_pass_is_the_same_under_chunked(tiny):
  rng = np.random.default_rng(5)
  v = tiny.cfg.vocab_size
  prefix_valid = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)
  own_valid = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
  prefix = jnp.asarray(rng.integers(3, v, size=prefix_valid.shape), jnp.int32)
  tokens = jnp.asarray(rng.integers(3, v, size=own_valid.shape), jnp.int32)
  prefix_positions = lm.positions_from_mask(jnp.asarray(prefix_valid))
  positions = (jnp.repeat(prefix_positions[:, -1:], 2, axis=0) + 1
               + lm.positions_from_mask(jnp.asarray(own_valid)))
  run = lambda cfg: transformer.apply_shared_prefix(
      tiny.params, prefix, prefix_positions, jnp.asarray(prefix_valid, jnp.int32), tokens,
      positions, jnp.asarray(own_valid, jnp.int32), cfg, group_size=2)
  want = run(tiny.cfg.replace(attention="xla"))
  got = run(tiny.cfg.replace(attention="chunked"))
  for g, w, valid in zip(got, want, (prefix_valid, own_valid), strict=True):
    np.testing.assert_allclose(np.asarray(g)[valid], np.asarray(w)[valid], atol=2e-5, rtol=1e-5)


def test_an_unknown_implementation_is_refused_naming_the_choices(tiny):
  with pytest.raises(ValueError, match="attention must be one of .*'chunked'.*got 'flash'"):
    tiny.cfg.replace(attention="flash")


def test_an_accelerator_kernel_on_cpu_is_refused_clearly():
  if jax.default_backend() != "cpu":
    pytest.skip("the refusal is for CPU")
  rng = np.random.default_rng(6)
  _, mask, q, k, v = _masks(rng)[0]
  with pytest.raises(ValueError, match="accelerator kernel; on CPU use 'xla' or 'chunked'"):
    _run("cudnn", q, k, v, mask)


def test_auto_is_the_einsums_on_cpu_cudnn_for_half_precision_on_gpu_chunked_else():
  bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
  assert attention.resolve("auto", bf16, backend="cpu") == "xla"
  assert attention.resolve("auto", bf16, backend="gpu") == "cudnn"
  assert attention.resolve("auto", f16, backend="gpu") == "cudnn"
  assert attention.resolve("auto", f32, backend="gpu") == "chunked"  # cuDNN refuses f32
  assert attention.resolve("auto", None, backend="gpu") == "chunked"
  assert attention.resolve("auto", bf16, backend="tpu") == "chunked"
  assert attention.resolve("triton", f32, backend="cpu") == "triton"  # asked for: as is
  want = "xla" if jax.default_backend() == "cpu" else "chunked"
  assert attention.resolve("auto") == want
