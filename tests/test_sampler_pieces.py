"""prefill / extend / decode with the cache passed in and out, against whole-history prefills."""

import jax
import jax.numpy as jnp
import numpy as np
from sampler_steps import decode as _decode
from sampler_steps import extend as _extend
from sampler_steps import prefill as _prefill

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib

# Row 0 has a long history and a short block, row 1 the reverse; row 2's block is empty.
HISTORY = [[5, 9, 14, 20, 31, 8], [7, 3], [11, 12, 13]]
BLOCK = [[40, 41], [42, 43, 44, 45], []]


def _left_padded(rows, width):
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, row in enumerate(rows):
    if row:
      tokens[i, width - len(row):] = row
      mask[i, width - len(row):] = True
  return jnp.asarray(tokens), jnp.asarray(mask)


def _full_prefill(model, rows, cache_len):
  tokens, mask = tokenizer_lib.pad_left(rows, pad_id=0, length=max(map(len, rows)))
  return _prefill(model.params, cfg=model.cfg, prompt_tokens=jnp.asarray(tokens),
                  prompt_mask=jnp.asarray(mask), cache_len=cache_len)


def test_prefill_then_extend_equals_prefill_of_the_concatenation(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  history, history_mask = _left_padded(HISTORY, 8)
  block, block_mask = _left_padded(BLOCK, 4)
  context = _prefill(params, cfg=cfg, prompt_tokens=history, prompt_mask=history_mask,
                     cache_len=32)
  extended = _extend(params, cfg, context, block, block_mask)
  whole = _full_prefill(tiny_model, [h + b for h, b in zip(HISTORY, BLOCK, strict=True)], 32)
  np.testing.assert_allclose(extended.logits, whole.logits, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(extended.next_position, whole.next_position)
  np.testing.assert_array_equal(extended.next_position, [8, 6, 3])
  assert int(extended.cache.index) == 12
  # The empty block leaves row 2 where it was.
  np.testing.assert_array_equal(extended.logits[:, 2], context.logits[:, 2])


def test_greedy_decoding_after_extend_equals_decoding_after_the_full_prefill(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  sampling = sampler_lib.SamplingConfig(max_new_tokens=8, stop_tokens=(), pad_id=0)
  history, history_mask = _left_padded(HISTORY, 8)
  block, block_mask = _left_padded(BLOCK, 4)
  context = _prefill(params, cfg=cfg, prompt_tokens=history, prompt_mask=history_mask,
                     cache_len=8 + 4 + 8)
  after_extend, _ = _decode(params, cfg, _extend(params, cfg, context, block, block_mask),
                            jax.random.key(0), sampling)
  whole = _full_prefill(tiny_model, [h + b for h, b in zip(HISTORY, BLOCK, strict=True)], 8 + 8)
  after_prefill, _ = _decode(params, cfg, whole, jax.random.key(0), sampling)
  np.testing.assert_array_equal(after_extend.tokens, after_prefill.tokens)
  np.testing.assert_allclose(after_extend.logprobs, after_prefill.logprobs, atol=1e-5)


def test_a_second_turn_continues_the_first_turns_cache(tiny_model):
  """decode(keep_cache) -> extend(observation) -> decode equals one prefill of the whole history.

  Row 1 stops early on a stop token, so its completion block holds padding
  that must stay invisible to the second turn.
  """
  params, cfg = tiny_model.params, tiny_model.cfg
  free = sampler_lib.SamplingConfig(max_new_tokens=6, stop_tokens=(), pad_id=0)
  history, history_mask = _left_padded(HISTORY, 8)
  context = _prefill(params, cfg=cfg, prompt_tokens=history, prompt_mask=history_mask,
                     cache_len=8 + 6 + 4 + 6)
  probe, _ = _decode(params, cfg, context, jax.random.key(0), free)
  stop = int(probe.tokens[1, 2])  # row 1 stops at its third token (or earlier)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=6, stop_tokens=(stop,), pad_id=0)
  first, after_first = _decode(params, cfg, context, jax.random.key(0), sampling,
                               keep_cache=True)
  lengths = np.asarray(first.lengths)
  assert lengths[1] <= 3 and lengths.max() > lengths[1]
  assert int(after_first.cache.index) == 8 + 6
  block, block_mask = _left_padded(BLOCK, 4)
  second, _ = _decode(params, cfg, _extend(params, cfg, after_first, block, block_mask),
                      jax.random.key(1), sampling)

  replies = [np.asarray(first.tokens[i, :n]).tolist() for i, n in enumerate(lengths)]
  rows = [h + r + b for h, r, b in zip(HISTORY, replies, BLOCK, strict=True)]
  whole = _full_prefill(tiny_model, rows, max(map(len, rows)) + 6)
  reference, _ = _decode(params, cfg, whole, jax.random.key(1), sampling)
  np.testing.assert_array_equal(second.tokens, reference.tokens)
  np.testing.assert_array_equal(second.lengths, reference.lengths)
  np.testing.assert_array_equal(
      _extend(params, cfg, after_first, block, block_mask).next_position, whole.next_position)


def test_inactive_rows_sample_nothing(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  sampling = sampler_lib.SamplingConfig(max_new_tokens=5, stop_tokens=(), pad_id=0)
  history, history_mask = _left_padded(HISTORY, 8)
  context = _prefill(params, cfg=cfg, prompt_tokens=history, prompt_mask=history_mask,
                     cache_len=13)
  out, after = _decode(params, cfg, context, jax.random.key(0), sampling,
                       active=jnp.asarray([True, False, True]), keep_cache=True)
  np.testing.assert_array_equal(out.lengths, [5, 0, 5])
  assert not np.asarray(out.mask[1]).any()
  np.testing.assert_array_equal(after.next_position, np.asarray(context.next_position) + [5, 0, 5])
  assert not np.asarray(after.cache.valid[1, 8:]).any()


def test_generate_is_prefill_then_decode(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  sampling = sampler_lib.SamplingConfig(max_new_tokens=6, temperature=1.0, pad_id=0)
  tokens, mask = _left_padded(HISTORY, 8)
  out = sampler_lib.generate(params, cfg, tokens, mask, jax.random.key(3), sampling,
                             samples_per_prompt=2)
  context = _prefill(params, cfg=cfg, prompt_tokens=tokens, prompt_mask=mask, cache_len=14,
                     samples_per_prompt=2)
  pieces, _ = _decode(params, cfg, context, jax.random.key(3), sampling)
  for a, b in zip(out, pieces, strict=True):
    np.testing.assert_array_equal(a, b)


