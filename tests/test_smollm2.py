"""The embedded SmolLM2-135M-Instruct against a committed transformers fixture (no torch)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer, weights, zoo
from jaxrl_agents.rollout import sampler as sampler_lib

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden",
                                     "smollm2_golden.json")))["cases"]
_apply = jax.jit(transformer.apply, static_argnums=3)


def test_config_matches_published_architecture(smollm2):
  cfg = smollm2.cfg
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
      30, 576, 9, 3, 64)
  assert (cfg.vocab_size, cfg.ffn_dim, cfg.rope_theta, cfg.tie_embeddings) == (
      49152, 1536, 1e5, True)
  assert abs(cfg.num_params - 134_515_008) < 1000


def test_tokenizer_matches_fixture_and_pads_safely(smollm2):
  tok = smollm2.tokenizer
  for case in GOLDEN:
    assert tokenizer_lib.chat_prompt(tok, case["prompt"]) == case["text"]
    assert tok.encode(case["text"], add_special_tokens=False) == case["ids"]
  assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
  assert tok.eos_token == "<|im_end|>"
  assert tok.pad_token not in tok.chat_template
  assert set(tokenizer_lib.stop_token_ids(tok)) == {0, 2}


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: c["prompt"][:12])
def test_logits_match_transformers_fixture(smollm2, case):
  ids = jnp.asarray([case["ids"]], jnp.int32)
  logits, _ = _apply(smollm2.params, ids, jnp.arange(ids.shape[1])[None], smollm2.cfg)
  logits = np.asarray(logits[0])
  for pos, top_ids, top_logits in zip(case["positions"], case["top_ids"], case["top_logits"],
                                      strict=True):
    np.testing.assert_allclose(logits[pos, top_ids], top_logits, atol=1e-3)
    assert int(np.argmax(logits[pos])) == top_ids[0]


def test_greedy_generation_matches_transformers_fixture(smollm2):
  tok = smollm2.tokenizer
  seqs = [c["ids"] for c in GOLDEN]
  tokens, mask = tokenizer_lib.pad_left(seqs, tok.pad_token_id)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=16, stop_tokens=(2,), pad_id=0)
  out = sampler_lib.generate(smollm2.params, smollm2.cfg, jnp.asarray(tokens),
                             jnp.asarray(mask), jax.random.key(0), sampling)
  for i, case in enumerate(GOLDEN):
    n = int(out.lengths[i])
    assert np.asarray(out.tokens[i, :n]).tolist() == case["greedy"]


def test_gguf_and_hf_directory_agree(smollm2):
  """The cached HF directory and a direct GGUF load give the same weights."""
  params, cfg = weights.load_gguf(zoo.smollm2_gguf_path())
  assert cfg == smollm2.cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(smollm2.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tok = tokenizer_lib.tokenizer_from_gguf(zoo.smollm2_gguf_path())
  text = GOLDEN[0]["text"] + " 19<|im_end|>\n<|endoftext|>"
  assert tok.encode(text) == smollm2.tokenizer.encode(text)
  assert tok.chat_template == smollm2.tokenizer.chat_template
