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
