"""The Flax adapter (`flax_lm.FlaxLM`): a linen model without a cache (the recompute path)
and an NNX model with one, each against its own forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agents.models import flax_lm, lm
from jaxrl_agents.rollout import sampler as sampler_lib

V, D, T = 50, 32, 10


class LinenLM(nn.Module):
  """A user's model as Flax's examples write one: learned position embeddings, Flax's own
  attention under the given mask, a separate head. No cache."""

  @nn.compact
  def __call__(self, tokens, positions, attention_mask):
    x = nn.Embed(V, D, name="embed")(tokens) + nn.Embed(64, D, name="pos")(positions)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(
        nn.LayerNorm()(x), mask=attention_mask[:, None])
    x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
    return nn.LayerNorm(name="final_norm")(x)

  @nn.compact
  def logits(self, hidden):
    return nn.Dense(V, name="head")(hidden)


class NnxLM(nnx.Module):
  """A one-layer NNX model under the cached protocol: kv {"k", "v"} f[B, S, D]."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.q, self.k, self.v = (nnx.Linear(D, D, rngs=rngs) for _ in range(3))
    self.out = nnx.Linear(D, D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, positions, attention_mask, kv=None, write_index=None):
    angle = positions[..., None] / 10.0 ** (jnp.arange(D) / D)
    x = self.embed(tokens) + jnp.sin(angle)  # positions enter through the embedding
    k, v = self.k(x), self.v(x)
    if kv is not None:
      k = jax.lax.dynamic_update_slice(kv["k"], k, (0, write_index, 0))
      v = jax.lax.dynamic_update_slice(kv["v"], v, (0, write_index, 0))
      kv = {"k": k, "v": v}
    scores = jnp.einsum("btd,bsd->bts", self.q(x), k) / jnp.sqrt(D)
    probs = jax.nn.softmax(jnp.where(attention_mask, scores, -1e30), axis=-1)
    return x + self.out(jnp.einsum("bts,bsd->btd", probs, v)), kv

  def logits(self, hidden):
    return self.head(hidden)

  def init_kv(self, batch_size, max_len, dtype):
    return {"k": jnp.zeros((batch_size, max_len, D), dtype),
            "v": jnp.zeros((batch_size, max_len, D), dtype)}


def make_nnx(rngs):
  return NnxLM(rngs)


def _inputs():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, V, (3, T)), jnp.int32)
  valid = np.ones((3, T), bool)
  valid[1, :4] = False  # left padding
  valid = jnp.asarray(valid)
  return tokens, valid, lm.positions_from_mask(valid)


def _linen():
  cfg = flax_lm.FlaxLM.linen(LinenLM(), vocab_size=V, d_model=D, n_layers=1, max_seq_len=64,
                             cached=False)
  return cfg, cfg.init(jax.random.key(1))


def _nnx():
  return flax_lm.FlaxLM.nnx(make_nnx, vocab_size=V, d_model=D, n_layers=1, max_seq_len=64)


def _hand_mask(valid):
  """Query i sees key j iff j <= i and j is a real token (and a padding query itself)."""
  v = np.asarray(valid)
  mask = np.zeros((v.shape[0], T, T), bool)
  for b in range(v.shape[0]):
    for i in range(T):
      for j in range(i + 1):
        mask[b, i, j] = v[b, j] or i == j
  return jnp.asarray(mask)


def _own_forward_linen(params, tokens, valid, positions):
  mask = _hand_mask(valid)
  module = LinenLM()
  hidden = module.apply({"params": params}, tokens, positions, mask)
  return module.apply({"params": params}, hidden, method="logits")


def _own_forward_nnx(params, tokens, valid, positions):
  model = nnx.merge(nnx.split(make_nnx(nnx.Rngs(0)))[0], params)
  mask = _hand_mask(valid)
  return model.logits(model(tokens, positions, mask)[0])


@pytest.mark.parametrize("make,own", [(_linen, _own_forward_linen), (_nnx, _own_forward_nnx)],
                         ids=["linen-recompute", "nnx-cached"])
def test_adapter_matches_the_models_own_forward_with_and_without_cache(make, own):
  cfg, params = make()
  lm.check_definition(cfg)
  tokens, valid, positions = _inputs()
  segments = valid.astype(jnp.int32)
  want = np.asarray(own(params, tokens, valid, positions))
  got, _ = cfg.apply(params, tokens, positions, segment_ids=segments)
  np.testing.assert_allclose(np.asarray(got)[valid], want[np.asarray(valid)], atol=1e-5)
  # Prefill then extend equals one pass; then one token at a time through decode_step.
  _, cache = cfg.apply(params, tokens[:, :4], positions[:, :4], segment_ids=segments[:, :4],
                       new_cache_len=T)
  ext, cache = cfg.apply(params, tokens[:, 4:7], positions[:, 4:7], segment_ids=segments[:, 4:7],
                         cache=cache)
  np.testing.assert_allclose(np.asarray(ext), want[:, 4:7], atol=1e-5)
  for i in range(7, T):
    step, cache = cfg.decode_step(params, tokens[:, i], positions[:, i], cache)
    np.testing.assert_allclose(np.asarray(step), want[:, i], atol=1e-5)
  assert int(cache.index) == T


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen-recompute", "nnx-cached"])
def test_adapter_samples_and_differentiates_under_jit(make):
  cfg, params = make()
  tokens, valid, positions = _inputs()
  sampling = sampler_lib.SamplingConfig(max_new_tokens=5, temperature=1.0, pad_id=0)
  out = sampler_lib.generate(params, cfg, tokens, valid, jax.random.key(0), sampling,
                             samples_per_prompt=2)
  assert out.tokens.shape == (6, 5) and np.all(np.asarray(out.lengths) == 5)
  # The sampler's recorded log-probabilities are the model's: rescore the first token.
  logits, _ = cfg.apply(params, tokens, positions, segment_ids=valid.astype(jnp.int32))
  first = jax.nn.log_softmax(logits[:, -1])
  want = jnp.take_along_axis(jnp.repeat(first, 2, axis=0), out.tokens[:, :1], axis=1)[:, 0]
  np.testing.assert_allclose(np.asarray(out.logprobs[:, 0]), np.asarray(want), atol=1e-5)

  def loss(p):
    lg, _ = cfg.apply(p, tokens, positions, segment_ids=valid.astype(jnp.int32))
    return jnp.mean(jax.nn.log_softmax(lg)[..., 0])

  grads = jax.jit(jax.grad(loss))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0


class DropoutLM(NnxLM):
  def __init__(self, rngs: nnx.Rngs):
    super().__init__(rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)  # stores an RNG stream: state that is not params


def make_dropout(rngs):
  return DropoutLM(rngs)


def test_definitions_are_static_and_compare_by_value():
  from jaxrl_agents.models import gemma

  a, _ = _linen()
  b, _ = _linen()
  assert a == b and hash(a) == hash(b)  # jit reuses the compiled program
  assert _nnx()[0] == _nnx()[0] and hash(_nnx()[0]) == hash(_nnx()[0])
  # However a definition comes to a dtype, equal definitions hash alike and type the module.
  g = gemma.definition(gemma.TINY_GEMMA3)
  assert g.replace(dtype="float32") == g and hash(g.replace(dtype="float32")) == hash(g)
  bf16 = gemma.definition(gemma.TINY_GEMMA3, dtype="bfloat16")
  assert g.replace(dtype="bfloat16") == bf16 and hash(g.replace(dtype="bfloat16")) == hash(bf16)
  assert bf16.module.dtype == jnp.bfloat16 and bf16 != g
  params = g.replace(param_dtype="bfloat16").init(jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  with pytest.raises(ValueError, match="not nnx.Param"):
    flax_lm.FlaxLM.nnx(make_dropout, vocab_size=V, d_model=D, n_layers=1)
  with pytest.raises(ValueError, match="NNX model computes"):
    _nnx()[0].replace(dtype="bfloat16")
  with pytest.raises(TypeError, match="cached=False"):
    flax_lm.FlaxLM.linen(LinenLM(), vocab_size=V, d_model=D, n_layers=1)  # has no init_kv
  with pytest.raises(TypeError, match="lacks"):
    lm.check_definition(object())
  with pytest.raises(ValueError, match="dtype"):
    flax_lm.FlaxLM.linen(LinenLM(), vocab_size=V, d_model=D, n_layers=1, dtype="float8")
