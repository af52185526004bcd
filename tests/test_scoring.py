"""Training-time log-probs of sampled completions against the sampler's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout.scoring import SequenceBatch, completion_logprobs, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_matches_the_sampling_distribution(tiny_model, temperature):
  """The update's log pi_T(y) equals what the sampler drew y with (no truncation)."""
  params, cfg = tiny_model.params, tiny_model.cfg
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3], [40]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=10, temperature=temperature,
                                        stop_tokens=(4,), pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(1), sampling)
  batch = SequenceBatch(jnp.asarray(tokens), jnp.asarray(mask), out.tokens, out.mask)
  logp, entropy = completion_logprobs(params, cfg, batch, temperature=temperature,
                                      with_entropy=True)
  expected = np.where(np.asarray(out.mask), np.asarray(out.sampling_logprobs), 0.0)
  np.testing.assert_allclose(np.asarray(logp), expected, atol=3e-5)
  assert np.all(np.asarray(logp)[~np.asarray(out.mask)] == 0)
  assert entropy.shape == logp.shape and np.all(np.asarray(entropy) > 0)


def test_temperature_scales_logits_before_the_softmax():
  logits = jnp.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
  tokens = jnp.array([[0, 2]])
  mask = jnp.array([[True, True]])
  logp, entropy = token_logprobs(logits, tokens, mask, temperature=0.5, with_entropy=True)
  z = np.array([[4.0, 0.0, -2.0], [1.0, 1.0, 0.0]])
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  np.testing.assert_allclose(logp[0], np.log([p[0, 0], p[1, 2]]), rtol=1e-6)
  np.testing.assert_allclose(entropy[0], -(p * np.log(p)).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("group_size", [2, 3])
def test_shared_prompt_scoring_equals_the_full_forward(tiny_model, group_size):
  """One prompt pass per group gives the full forward's log-probs, entropies and gradient."""
  params, cfg = tiny_model.params, tiny_model.cfg
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=9, temperature=1.0, stop_tokens=(4, 11),
                                        pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(3), sampling, samples_per_prompt=group_size)
  # Completions of different lengths (ended early, padding after), as stop tokens would.
  lengths = np.arange(out.tokens.shape[0]) % 9 + 1
  m = np.arange(9)[None, :] < lengths[:, None]
  completion = jnp.where(m, out.tokens, 0)
  batch = SequenceBatch(jnp.repeat(tokens, group_size, 0), jnp.repeat(mask, group_size, 0),
                        completion, jnp.asarray(m))
  full_logp, full_ent = completion_logprobs(params, cfg, batch, with_entropy=True)
  shared_logp, shared_ent = completion_logprobs(params, cfg, batch, with_entropy=True,
                                                group_size=group_size)
  np.testing.assert_allclose(shared_logp, full_logp, atol=2e-5)
  np.testing.assert_allclose(np.asarray(shared_ent)[m], np.asarray(full_ent)[m], atol=2e-5)
  # And the sampler's own record of the same tokens.
  np.testing.assert_allclose(shared_logp, np.where(m, out.logprobs, 0.0), atol=3e-5)

  weights = jax.random.normal(jax.random.key(0), m.shape)

  def objective(p, g):
    logp, _ = completion_logprobs(p, cfg, batch, group_size=g)
    return jnp.sum(logp * weights)

  full_grad = jax.grad(objective)(params, 1)
  shared_grad = jax.grad(objective)(params, group_size)
  for a, b in zip(jax.tree.leaves(full_grad), jax.tree.leaves(shared_grad), strict=True):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(shared_grad)) > 1e-3


def test_shared_prompt_scoring_rejects_a_partial_group(tiny_model):
  tokens, mask = tokenizer_lib.pad_left([[5, 9], [7, 3], [1, 2]], pad_id=0, length=4)
  batch = SequenceBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.ones((3, 2), jnp.int32),
                        jnp.ones((3, 2), bool))
  with pytest.raises(ValueError, match="not a whole number of groups of 2"):
    completion_logprobs(tiny_model.params, tiny_model.cfg, batch, group_size=2)
