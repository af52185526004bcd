"""The jitted KV-cache sampler against full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer
from jaxrl_agents.rollout import sampler as sampler_lib

_apply = jax.jit(transformer.apply, static_argnums=3)


def _greedy_by_full_forward(params, cfg, prompt, n, width=32):
  """Argmax of a full (uncached) forward pass, one token at a time.

  The sequence is right-padded to a fixed width so every step reuses one program.
  """
  seq = list(prompt)
  for _ in range(n):
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(seq)] = seq
    logits, _ = _apply(params, jnp.asarray(ids), jnp.arange(width)[None], cfg)
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_equals_stepwise_argmax_of_full_forward(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  prompts = [[5, 9, 14, 20, 31], [7, 3]]
  tokens, mask = tokenizer_lib.pad_left(prompts, pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=10, stop_tokens=(), pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(0), sampling)
  for i, prompt in enumerate(prompts):
    assert np.asarray(out.tokens[i]).tolist() == _greedy_by_full_forward(params, cfg, prompt, 10)
  assert np.asarray(out.lengths).tolist() == [10, 10]


def test_stop_token_ends_the_completion(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  prompt = [5, 9, 14]
  reference = _greedy_by_full_forward(params, cfg, prompt, 8)
  stop = reference[3]
  first = reference.index(stop)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=8, stop_tokens=(stop,), pad_id=0)
  tokens, mask = tokenizer_lib.pad_left([prompt], 0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(0), sampling)
  assert int(out.lengths[0]) == first + 1
  assert np.asarray(out.tokens[0, :first + 1]).tolist() == reference[:first + 1]
  assert np.asarray(out.tokens[0, first + 1:]).tolist() == [0] * (8 - first - 1)
  assert np.asarray(out.mask[0]).tolist() == [True] * (first + 1) + [False] * (8 - first - 1)


def test_sampler_wrapper_text_round_trip(tiny_model):
  sampler = sampler_lib.Sampler(tiny_model, chat=True)
  texts, out = sampler(["hello", "a longer prompt here"], max_new_tokens=6)
  assert len(texts) == 2 and out.tokens.shape == (2, 6)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    sampler(["x"], max_new_tokens=0)
