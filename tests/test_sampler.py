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
  # One prompt alone decodes with stacked projections: the same greedy text.
  alone, alone_out = sampler(["hello"], max_new_tokens=6)
  assert alone == texts[:1]
  np.testing.assert_allclose(alone_out.logprobs, out.logprobs[:1], atol=1e-5)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    sampler(["x"], max_new_tokens=0)


def _first_token_logits(params, cfg, prompt):
  logits, _ = _apply(params, jnp.asarray([prompt], jnp.int32), jnp.arange(len(prompt))[None], cfg)
  return np.asarray(logits[0, -1], np.float64)


def _sample_first_tokens(model, prompt, n, sampling, seed=0):
  tokens = jnp.asarray(np.tile(np.asarray(prompt, np.int32), (n, 1)))
  mask = jnp.ones(tokens.shape, bool)
  out = sampler_lib.generate(model.params, model.cfg, tokens, mask, jax.random.key(seed), sampling)
  return np.asarray(out.tokens[:, 0]), out


def test_sampled_frequencies_match_softmax(tiny_model):
  """Chi-square goodness of fit of 4000 temperature-0.7 draws against softmax(logits / 0.7)."""
  from scipy import stats
  prompt = [5, 9, 14, 20]
  temperature = 0.7
  logits = _first_token_logits(tiny_model.params, tiny_model.cfg, prompt) / temperature
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  n = 4000
  sampling = sampler_lib.SamplingConfig(max_new_tokens=1, temperature=temperature)
  draws, _ = _sample_first_tokens(tiny_model, prompt, n, sampling)
  counts = np.bincount(draws, minlength=len(probs))
  big = probs * n >= 5  # chi-square needs expected counts >= 5: pool the rest
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(probs[big] * n, probs[~big].sum() * n)
  assert big.sum() >= 10  # a real multi-token distribution, not a near-point mass
  p_value = stats.chisquare(observed, expected).pvalue
  assert p_value > 1e-3, p_value
  # And the test has power: the same draws reject the temperature-1 distribution.
  wrong = np.exp(logits * temperature - (logits * temperature).max())
  wrong /= wrong.sum()
  wrong_expected = np.append(wrong[big] * n, wrong[~big].sum() * n)
  assert stats.chisquare(observed, wrong_expected * n / wrong_expected.sum()).pvalue < 1e-6


def _allowed(logits, top_k=0, top_p=1.0, min_p=0.0):
  """Independent numpy statement of which tokens each filter keeps."""
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  keep = np.ones_like(probs, bool)
  if top_k:
    keep &= logits >= np.sort(logits)[-top_k]
  if min_p:
    keep &= probs >= min_p * probs.max()
  if top_p < 1.0:
    p = np.where(keep, probs, 0.0)
    p /= p.sum()
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    n_keep = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix reaching top_p
    nucleus = np.zeros_like(keep)
    nucleus[order[:n_keep]] = True
    keep &= nucleus
  return keep


@pytest.mark.parametrize("filters", [{"top_k": 5}, {"top_p": 0.6}, {"min_p": 0.2},
                                     {"top_k": 8, "top_p": 0.8, "min_p": 0.05}])
def test_truncation_never_samples_outside_the_allowed_set(tiny_model, filters):
  prompt = [7, 3, 11]
  logits = _first_token_logits(tiny_model.params, tiny_model.cfg, prompt)
  keep = _allowed(logits, **filters)
  assert 1 < keep.sum() < len(keep)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=1, temperature=1.0, **filters)
  draws, out = _sample_first_tokens(tiny_model, prompt, 2000, sampling, seed=1)
  assert keep[draws].all()
  assert len(set(draws.tolist())) > 1
  # The sampling logprob is the renormalized probability within the allowed set.
  p = np.where(keep, np.exp(logits - logits.max()), 0.0)
  p /= p.sum()
  np.testing.assert_allclose(np.asarray(out.sampling_logprobs[:, 0]), np.log(p[draws]),
                             atol=1e-4)


def test_logprobs_equal_full_forward_logprobs(tiny_model):
  params, cfg = tiny_model.params, tiny_model.cfg
  prompts = [[5, 9, 14, 20, 31], [7, 3]]
  tokens, mask = tokenizer_lib.pad_left(prompts, pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=12, temperature=1.0, stop_tokens=(),
                                        pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(3), sampling)
  np.testing.assert_array_equal(out.logprobs, out.sampling_logprobs)  # plain sampling
  for i, prompt in enumerate(prompts):
    completion = np.asarray(out.tokens[i]).tolist()
    seq = prompt + completion
    logits, _ = _apply(params, jnp.asarray([seq]), jnp.arange(len(seq))[None], cfg)
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    expected = [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion)]
    np.testing.assert_allclose(np.asarray(out.logprobs[i]), expected, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_batch_equals_each_prompt_alone(tiny_model, dtype):
  """In bfloat16 a prompt alone takes its own path (decoded beside a copy of itself)."""
  cfg = tiny_model.cfg.replace(dtype=dtype, param_dtype=dtype)
  params = transformer.cast_params(tiny_model.params, dtype)
  prompts = [[5, 9, 14, 20, 31, 40, 41], [7, 3], [100, 101, 102, 103]]
  sampling = sampler_lib.SamplingConfig(max_new_tokens=8, stop_tokens=(), pad_id=0)
  tokens, mask = tokenizer_lib.pad_left(prompts, pad_id=0, length=16)
  batch = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                               jax.random.key(0), sampling)
  for i, prompt in enumerate(prompts):
    t, m = tokenizer_lib.pad_left([prompt], pad_id=0)
    alone = sampler_lib.generate(params, cfg, jnp.asarray(t), jnp.asarray(m), jax.random.key(0),
                                 sampling)
    assert alone.tokens.shape == (1, 8)
    assert np.asarray(batch.tokens[i]).tolist() == np.asarray(alone.tokens[0]).tolist()
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(batch.logprobs[i], alone.logprobs[0], atol=tol)


def test_samples_per_prompt_equals_repeating_each_prompt(tiny_model):
  """One prefill per prompt, repeated G times, samples what G copies of the prompt would."""
  params, cfg = tiny_model.params, tiny_model.cfg
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=8, temperature=1.0, stop_tokens=(4,),
                                        pad_id=0)
  shared = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                                jax.random.key(5), sampling, samples_per_prompt=3)
  copies = sampler_lib.generate(params, cfg, jnp.repeat(tokens, 3, 0), jnp.repeat(mask, 3, 0),
                                jax.random.key(5), sampling)
  assert shared.tokens.shape == (6, 8)
  np.testing.assert_array_equal(shared.tokens, copies.tokens)
  np.testing.assert_array_equal(shared.lengths, copies.lengths)
  np.testing.assert_allclose(shared.logprobs, copies.logprobs, atol=2e-5)
  # The samples of one prompt differ from each other (each row has its own noise).
  assert len({tuple(row) for row in np.asarray(shared.tokens[:3]).tolist()}) > 1


def test_deterministic_given_the_key(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=6, temperature=1.0)
  _, a = _sample_first_tokens(tiny_model, [5, 6, 7], 4, sampling, seed=11)
  _, b = _sample_first_tokens(tiny_model, [5, 6, 7], 4, sampling, seed=11)
  _, c = _sample_first_tokens(tiny_model, [5, 6, 7], 4, sampling, seed=12)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_same_bucket_does_not_recompile(tiny_model):
  sampler = sampler_lib.Sampler(tiny_model, chat=True)
  sampler(["first prompt", "second"], max_new_tokens=5)
  compiled = sampler_lib.generate._cache_size()
  sampler(["a different prompt", "and another one"], max_new_tokens=7)  # same buckets
  assert sampler_lib.generate._cache_size() == compiled
  sampler(["x" * 100], max_new_tokens=5)  # a longer prompt bucket compiles once more
  assert sampler_lib.generate._cache_size() == compiled + 1


def test_inverse_cdf_draws_follow_the_distribution_and_skip_removed_tokens():
  probs = np.array([0.0, 0.5, 0.0, 0.3, 0.2, 0.0], np.float32)
  with np.errstate(divide="ignore"):
    log_probs = jnp.asarray(np.tile(np.log(probs), (20000, 1)))
  draws = np.asarray(sampler_lib.sample_inverse_cdf(jax.random.key(0), log_probs))
  counts = np.bincount(draws, minlength=len(probs)) / len(draws)
  assert counts[probs == 0].sum() == 0
  # Three standard errors of a frequency near 0.5 over 20000 draws is about 0.011.
  np.testing.assert_allclose(counts, probs, atol=0.011)


def test_argmax_vocab_major_equals_argmax_and_takes_the_first_of_ties():
  logits = np.random.default_rng(0).normal(size=(300, 7)).astype(np.float32)
  logits[[4, 9, 250], 3] = 10.0  # a three-way tie in column 3: argmax takes the first
  got = np.asarray(sampler_lib.argmax_vocab_major(jnp.asarray(logits)))
  np.testing.assert_array_equal(got, np.argmax(logits, axis=0))
  assert got[3] == 4


def test_inverse_cdf_vocab_major_draws_the_same_tokens():
  log_probs = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (16, 50)) * 2, axis=-1)
  rng = jax.random.key(4)
  np.testing.assert_array_equal(
      np.asarray(sampler_lib.sample_inverse_cdf(rng, log_probs)),
      np.asarray(sampler_lib.sample_inverse_cdf(rng, log_probs.T, axis=0)))


def test_shared_prefix_generates_what_the_whole_prompts_would(tiny_model):
  """The prefix prefilled once and shared: same tokens and logprobs as full prompts."""
  params, cfg = tiny_model.params, tiny_model.cfg
  prefix = [11, 12, 13, 14, 15, 16, 17, 18]
  suffixes = [[5, 9, 14, 20, 31], [7, 3], [100, 101, 102]]
  sampling = sampler_lib.SamplingConfig(max_new_tokens=8, temperature=1.0, stop_tokens=(),
                                        pad_id=0)
  full_t, full_m = tokenizer_lib.pad_left([prefix + s for s in suffixes], pad_id=0, length=16)
  suf_t, suf_m = tokenizer_lib.pad_left(suffixes, pad_id=0, length=8)
  whole = sampler_lib.generate(params, cfg, jnp.asarray(full_t), jnp.asarray(full_m),
                               jax.random.key(3), sampling)
  shared = sampler_lib.generate(params, cfg, jnp.asarray(suf_t), jnp.asarray(suf_m),
                                jax.random.key(3), sampling,
                                prefix_tokens=jnp.asarray(prefix, jnp.int32))
  np.testing.assert_array_equal(shared.tokens, whole.tokens)
  np.testing.assert_allclose(shared.logprobs, whole.logprobs, atol=1e-4)
  # And with G samples per prompt on top of the shared prefix.
  grouped = sampler_lib.generate(params, cfg, jnp.asarray(suf_t), jnp.asarray(suf_m),
                                 jax.random.key(3), sampling, samples_per_prompt=2,
                                 prefix_tokens=jnp.asarray(prefix, jnp.int32))
  copies = sampler_lib.generate(params, cfg, jnp.repeat(full_t, 2, 0), jnp.repeat(full_m, 2, 0),
                                jax.random.key(3), sampling)
  np.testing.assert_array_equal(grouped.tokens, copies.tokens)


def test_split_shared_prefix():
  split = sampler_lib.split_shared_prefix
  ids = [list(range(20)) + [50, 51], list(range(20)) + [60], list(range(19)) + [70, 71]]
  prefix, suffixes = split(ids)  # 19 tokens in common, rounded down to 16
  assert prefix == list(range(16))
  assert [prefix + s for s in suffixes] == ids
  prefix, suffixes = split([[1, 2, 3] * 8, [1, 2, 3] * 8])  # identical prompts
  assert len(prefix) == 16 and all(len(s) == 8 for s in suffixes)
  assert split([[1] * 8, [1] * 8])[0] == []  # a suffix keeps at least one token
  assert split([[1, 2], [3, 4]]) == ([], [[1, 2], [3, 4]])
  assert split([list(range(20))]) == ([], [list(range(20))])  # one prompt shares nothing
  with pytest.raises(ValueError, match="at least one token"):
    split([[1, 2], []])


def test_stacked_layers_sample_what_the_list_layout_samples(tiny_model):
  """The stacked layout is sliced into layers once before the decoding loop
  (`lm.loop_params`); the samples and their log-probabilities are the list layout's."""
  from jaxrl_agents.models import lm

  params, cfg = tiny_model.params, tiny_model.cfg
  stacked = transformer.stack_layers(params)
  prepared = lm.loop_params(cfg, stacked)
  assert isinstance(prepared["layers"], list) and len(prepared["layers"]) == cfg.n_layers
  for got, want in zip(jax.tree.leaves(prepared), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert lm.loop_params(cfg, params)["layers"] is params["layers"]  # nothing to do
  assert lm.loop_params(object(), stacked) is stacked  # a model without loop_params

  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=10, temperature=1.0, stop_tokens=(),
                                        pad_id=0)
  outs = [sampler_lib.generate(p, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                               jax.random.key(3), sampling, samples_per_prompt=2)
          for p in (params, stacked)]
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                             atol=1e-5)


def test_compaction_sizes_halve_down_to_the_floor():
  sizes = sampler_lib.compaction_sizes
  assert sizes(64, 8) == [64, 32, 16, 8]
  assert sizes(64, 0) == [64]  # off
  assert sizes(48, 8) == [48, 24, 12]  # 6 is under the floor
  assert sizes(6, 8) == [6]
  assert sizes(40, 2) == [40, 20, 10, 5]  # an odd count is not halved
  with pytest.raises(ValueError, match="compact_min_rows"):
    sampler_lib.SamplingConfig(compact_min_rows=-1)
  with pytest.raises(ValueError, match="compact_min_rows"):
    sampler_lib.SamplingConfig(compact_min_rows=2.0)
  with pytest.raises(ValueError, match="compact_min_rows"):
    sampler_lib.SamplingConfig(compact_min_rows=1)  # a single bfloat16 row is slow


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compacted_decoding_samples_what_the_whole_batch_samples(tiny_model, temperature):
  """Decoding on with only the unfinished rows (at 16, 8, 4 rows) gives every row the
  tokens, lengths and log-probabilities it gets when all 16 rows run to the end."""
  params, cfg = tiny_model.params, tiny_model.cfg
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3], [100, 101], [60]],
                                        pad_id=0, length=8)
  # An eighth of the vocabulary stops a reply, so the rows finish at varied steps; the
  # inactive rows (finished from the start) make the batch shrink from the first step.
  stops = tuple(range(1, cfg.vocab_size, 8))
  active = jnp.asarray([True] * 12 + [False] * 4)
  outs = []
  for compact in (0, 4):
    sampling = sampler_lib.SamplingConfig(max_new_tokens=24, temperature=temperature,
                                          stop_tokens=stops, pad_id=0,
                                          compact_min_rows=compact)

    @jax.jit
    def run(params, tokens, mask, sampling=sampling):
      context = sampler_lib.prefill(params, cfg, tokens, mask, cache_len=32,
                                    samples_per_prompt=4)
      return sampler_lib.decode(params, cfg, context, jax.random.key(7), sampling,
                                active=active)[0]

    jaxpr = str(jax.make_jaxpr(run)(params, jnp.asarray(tokens), jnp.asarray(mask)))
    assert jaxpr.count("while[") == (3 if compact else 1)  # one loop per row count
    outs.append(jax.device_get(run(params, jnp.asarray(tokens), jnp.asarray(mask))))
  whole, compacted = outs
  lengths = whole.lengths.tolist()
  assert lengths[12:] == [0] * 4
  # Every loop decoded a step: the 16-row loop hands over once at most 8 rows are live
  # (the 9th-longest reply has ended), the 8-row loop runs while more than 4 are (the
  # 5th-longest is longer), the 4-row loop while one is (the longest is longer still).
  longest_first = sorted(lengths[:12], reverse=True)
  assert longest_first[0] > longest_first[4] > longest_first[8]
  np.testing.assert_array_equal(compacted.tokens, whole.tokens)
  np.testing.assert_array_equal(compacted.lengths, whole.lengths)
  np.testing.assert_array_equal(compacted.mask, whole.mask)
  np.testing.assert_allclose(compacted.logprobs, whole.logprobs, atol=1e-5)
  np.testing.assert_allclose(compacted.sampling_logprobs, whole.sampling_logprobs, atol=1e-5)
