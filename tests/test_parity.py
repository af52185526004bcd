"""Parity with transformers' reference implementation (runs when torch is installed)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import lm, transformer, weights, zoo
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.parity
_apply = jax.jit(transformer.apply, static_argnums=3)

PROMPTS = ["What is 12 + 7?", "Name three primary colors.", "Tell me a joke about cats.",
           "Translate 'good morning' to French.", "List the first five prime numbers."]


def _ours(params, cfg, tokens, mask):
  positions = lm.positions_from_mask(jnp.asarray(mask))
  logits, _ = _apply(params, jnp.asarray(tokens), positions, cfg,
                     segment_ids=jnp.asarray(mask, jnp.int32))
  return np.asarray(logits)


def _theirs(hf_model, tokens, mask):
  mask_t = torch.tensor(mask, dtype=torch.long)
  position_ids = torch.clamp(mask_t.cumsum(-1) - 1, min=0)
  with torch.no_grad():
    return hf_model(torch.tensor(tokens, dtype=torch.long), attention_mask=mask_t,
                    position_ids=position_ids).logits.numpy()


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-llama3"])
def test_tiny_presets_match_transformers(tmp_path, name):
  """Random weights exported to HF format: transformers and our model agree."""
  model = zoo.load(name)
  weights.save_hf_dir(model.params, model.cfg, str(tmp_path), tokenizer=model.tokenizer)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert type(hf).__name__ == ("Qwen2ForCausalLM" if model.cfg.qkv_bias else "LlamaForCausalLM")
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, model.cfg.vocab_size, (3, 40)).astype(np.int32)
  mask = np.ones((3, 40), bool)
  mask[1, :7] = False  # left padding
  mask[2, :25] = False
  ours, theirs = _ours(model.params, model.cfg, tokens, mask), _theirs(hf, tokens, mask)
  assert np.abs(ours - theirs)[mask].max() < 1e-4


@pytest.fixture(scope="module")
def hf_smollm2():
  folder, name = os.path.split(zoo.smollm2_gguf_path())
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return model, tok


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(smollm2, hf_smollm2):
  hf, hf_tok = hf_smollm2
  ids = [hf_tok.encode(hf_tok.apply_chat_template([{"role": "user", "content": p}],
                                                  tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for p in PROMPTS]
  ours_ids = tokenizer_lib.encode_prompts(smollm2.tokenizer, PROMPTS)
  assert ours_ids == ids
  tokens, mask = tokenizer_lib.pad_left(ids, smollm2.tokenizer.pad_token_id)
  ours = _ours(smollm2.params, smollm2.cfg, tokens, mask)
  theirs = _theirs(hf, tokens, mask)
  diff = np.abs(ours - theirs)[mask].max()
  assert diff < 1e-3, diff


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_greedy_continuation_matches(smollm2, hf_smollm2):
  hf, _ = hf_smollm2
  ids = tokenizer_lib.encode_prompts(smollm2.tokenizer, PROMPTS[:3])
  tokens, mask = tokenizer_lib.pad_left(ids, smollm2.tokenizer.pad_token_id)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=24, stop_tokens=(2,), pad_id=0)
  out = sampler_lib.generate(smollm2.params, smollm2.cfg, jnp.asarray(tokens),
                             jnp.asarray(mask), jax.random.key(0), sampling)
  for i, seq in enumerate(ids):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([seq]), attention_mask=torch.ones(1, len(seq)),
                        max_new_tokens=24, do_sample=False)[0, len(seq):].tolist()
    assert np.asarray(out.tokens[i, :int(out.lengths[i])]).tolist() == ref


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, hf_smollm2):
  _, hf_tok = hf_smollm2
  texts = ["Hello, world!", "  leading spaces\tand tabs\n\nnewlines", "12+7=19 ∑ émigré 日本語",
           "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "def f(x):\n    return x**2"]
  for text in texts:
    assert smollm2.tokenizer.encode(text) == hf_tok.encode(text), text
    ids = smollm2.tokenizer.encode(text)
    assert smollm2.tokenizer.decode(ids) == hf_tok.decode(ids)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_export_loads_in_transformers(smollm2, hf_smollm2, tmp_path):
  hf_gguf, _ = hf_smollm2
  weights.save_hf_dir(smollm2.params, smollm2.cfg, str(tmp_path), smollm2.tokenizer)
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                               dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ids = tok.encode(tokenizer_lib.chat_prompt(tok, PROMPTS[0]), add_special_tokens=False)
  tokens, mask = np.asarray([ids]), np.ones((1, len(ids)), bool)
  a, b = _theirs(exported, tokens, mask), _theirs(hf_gguf, tokens, mask)
  assert np.abs(a - b).max() < 1e-4
  assert tok.pad_token == "<|endoftext|>"
