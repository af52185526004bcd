"""The project's Flax Gemma against Google's `gemma` library (its outputs recorded in
tests/golden/gemma_tiny.npz by tests/golden/make_gemma_golden.py), and the tiny Gemma
through the sampler."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import gemma, lm, zoo
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def _golden_module():
  spec = importlib.util.spec_from_file_location(
      "make_gemma_golden", os.path.join(GOLDEN_DIR, "make_gemma_golden.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MAKE = _golden_module()
GOLDEN = np.load(os.path.join(GOLDEN_DIR, "gemma_tiny.npz"))


@pytest.fixture(scope="module")
def golden_model():
  """TINY_GEMMA3 with the weights the library ran on."""
  cfg = gemma.definition(gemma.TINY_GEMMA3)
  shapes = jax.tree.map(lambda s: s.shape, jax.eval_shape(cfg.init, jax.random.key(0)))
  return cfg, jax.tree.map(jnp.asarray, MAKE.golden_params(shapes))


def test_tiny_config_is_the_one_the_library_ran():
  fields = {f.name: getattr(gemma.TINY_GEMMA3, f.name)
            for f in dataclasses.fields(gemma.GemmaConfig)}
  for name, value in MAKE.CONFIG.items():
    assert fields[name] == value, name
  assert gemma.TINY_GEMMA3.attention_types == (gemma.LOCAL, gemma.GLOBAL)
  assert gemma.TINY_GEMMA3.use_qk_norm and gemma.TINY_GEMMA3.use_post_ffw_norm


def test_logits_match_the_gemma_library(golden_model):
  cfg, params = golden_model
  tokens, valid, positions = MAKE.golden_inputs()
  # The window (8) is shorter than the 12 tokens: the local layer's mask matters.
  assert tokens.shape[1] > gemma.TINY_GEMMA3.sliding_window_size
  logits, _ = jax.jit(lambda p, t, x, s: cfg.apply(p, t, x, segment_ids=s))(
      params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid, jnp.int32))
  want = GOLDEN["logits"]
  np.testing.assert_allclose(np.asarray(logits)[valid], want[valid], atol=1e-5, rtol=1e-5)
  assert np.abs(want[valid]).max() > 1e-2  # not a trivially small comparison


def test_greedy_decoding_matches_the_gemma_library(golden_model):
  """The project's sampler (prefill + cached decode steps) on the library's weights picks the
  library's greedy tokens, which its own cache produced."""
  cfg, params = golden_model
  tokens, _, _ = MAKE.golden_inputs()
  prompt = jnp.asarray(tokens[:1, :6])
  steps = len(GOLDEN["greedy"])
  sampling = sampler_lib.SamplingConfig(max_new_tokens=steps, temperature=0.0, stop_tokens=(),
                                        pad_id=0)
  out = sampler_lib.generate(params, cfg, prompt, jnp.ones_like(prompt, bool), jax.random.key(0),
                             sampling)
  np.testing.assert_array_equal(np.asarray(out.tokens[0]), GOLDEN["greedy"])
  assert len(set(GOLDEN["greedy"].tolist())) > 2  # a varied continuation, not one token repeated


def test_cache_continuation_equals_one_prefill(golden_model):
  cfg, params = golden_model
  tokens, valid, positions = (jnp.asarray(a) for a in MAKE.golden_inputs())
  segments = valid.astype(jnp.int32)
  full, _ = cfg.apply(params, tokens, positions, segment_ids=segments)
  _, cache = cfg.apply(params, tokens[:, :5], positions[:, :5], segment_ids=segments[:, :5],
                       new_cache_len=12)
  ext, cache = cfg.apply(params, tokens[:, 5:9], positions[:, 5:9],
                         segment_ids=segments[:, 5:9], cache=cache)
  np.testing.assert_allclose(np.asarray(ext), np.asarray(full[:, 5:9]), atol=1e-5)
  for i in range(9, 12):  # then one token at a time
    step, cache = cfg.decode_step(params, tokens[:, i], positions[:, i], cache)
    np.testing.assert_allclose(np.asarray(step), np.asarray(full[:, i]), atol=1e-5)


def test_tokenizer_writes_gemmas_chat_template_and_stops_at_end_of_turn():
  tok = tokenizer_lib.gemma_byte_tokenizer()
  text = tokenizer_lib.chat_prompt(tok, "What is 2+2?", system="Be brief.")
  assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
                  "<start_of_turn>model\n")
  vocab = tok.get_vocab()
  assert set(tokenizer_lib.stop_token_ids(tok)) == {vocab["<end_of_turn>"], vocab["<eos>"]}
  # Data that spells a control token stays text.
  ids, _ = tokenizer_lib.encode_chat(tok, "hi<end_of_turn>")
  assert ids.count(vocab["<end_of_turn>"]) == 1  # only the template's own


def test_tiny_gemma_preset_samples_through_the_sampler():
  model = zoo.load("tiny-gemma")
  lm.check_definition(model.cfg)
  out = sampler_lib.Sampler(model)(["What is 2+2?", "hello"], rng=jax.random.key(0),
                                   max_new_tokens=6, temperature=1.0)
  texts, sample = out
  assert len(texts) == 2 and sample.tokens.shape == (2, 6)
