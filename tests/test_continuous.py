"""Continuous batching against the static sampler and against each sequence alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import continuous
from jaxrl_agents.rollout import sampler as sampler_lib

# Prompts of different lengths; budgets from 1 to the longest reply, so slots refill at
# different steps and the ring's write index wraps several times.
PROMPTS = [[5, 9, 14, 20, 31], [7, 3], [100, 101, 102, 103], [8], [40, 41, 42, 43, 44, 45],
           [60, 61], [70, 71, 72], [90, 91, 92, 93, 94]]
BUDGETS = [12, 3, 7, 1, 12, 5, 9, 2]
WIDTH = 12


def _encoded():
  tokens, mask = tokenizer_lib.pad_left(PROMPTS, pad_id=0, length=8)
  return jnp.asarray(tokens), jnp.asarray(mask)


def _continuous(model, sampling, slots, budgets=BUDGETS, keys=None):
  tokens, mask = _encoded()
  keys = jax.random.split(jax.random.key(7), len(PROMPTS)) if keys is None else keys
  return continuous.generate(model.params, model.cfg, tokens, mask, keys, sampling,
                             slots=slots, max_new_tokens=jnp.asarray(budgets, jnp.int32))


def test_greedy_equals_the_static_batch_cut_at_each_budget(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  static = sampler_lib.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                                jax.random.key(0), sampling)
  for slots in (3, len(PROMPTS)):
    out = _continuous(tiny_model, sampling, slots)
    assert np.asarray(out.lengths).tolist() == BUDGETS, slots
    for i, n in enumerate(BUDGETS):
      got, want = np.asarray(out.tokens[i]), np.asarray(static.tokens[i])
      assert got[:n].tolist() == want[:n].tolist(), (slots, i)
      assert (got[n:] == 0).all()  # padding after the budget
      np.testing.assert_allclose(np.asarray(out.logprobs[i, :n]),
                                 np.asarray(static.logprobs[i, :n]), atol=2e-5)
      assert np.asarray(out.mask[i]).sum() == n


def test_a_stop_token_ends_a_sequence_and_its_slot_takes_the_next(tiny_model):
  # The static batch's greedy tokens; make the 3rd token of prompt 0 a stop token.
  free = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  static = np.asarray(sampler_lib.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                                           jax.random.key(0), free).tokens)
  stop = int(static[0, 2])
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(stop,), pad_id=0)
  out = _continuous(tiny_model, sampling, slots=2, budgets=[WIDTH] * len(PROMPTS))
  for i in range(len(PROMPTS)):
    row = static[i].tolist()
    n = row.index(stop) + 1 if stop in row else WIDTH  # up to and with the stop token
    assert int(out.lengths[i]) == n, i
    assert np.asarray(out.tokens[i, :n]).tolist() == row[:n], i


def test_sampled_sequences_do_not_depend_on_their_slot_or_neighbours(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, temperature=1.0, stop_tokens=(),
                                        pad_id=0)
  alone = _continuous(tiny_model, sampling, slots=1)
  for slots in (3, len(PROMPTS)):
    out = _continuous(tiny_model, sampling, slots)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(alone.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(alone.logprobs), atol=2e-5)
  # Each sequence's own key decides its tokens: another key, other samples.
  other = _continuous(tiny_model, sampling, slots=3,
                      keys=jax.random.split(jax.random.key(8), len(PROMPTS)))
  assert (np.asarray(other.tokens) != np.asarray(alone.tokens)).any()


def test_bad_arguments_are_refused_clearly(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=4, stop_tokens=(), pad_id=0)
  with pytest.raises(ValueError, match=r"slots must be in \[1, 8\]"):
    _continuous(tiny_model, sampling, slots=9)
  compact = sampler_lib.SamplingConfig(max_new_tokens=4, stop_tokens=(), pad_id=0,
                                       compact_min_rows=2)
  with pytest.raises(ValueError, match="compact_min_rows is the static batch's"):
    _continuous(tiny_model, compact, slots=2)
