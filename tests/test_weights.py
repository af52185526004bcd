"""Checkpoint I/O: HF directories, GGUF files (with llama.cpp's q/k permutation), export."""

import json
import os
import shutil

import gguf
import jax
import numpy as np
import pytest

from jaxrl_agents.models import transformer, weights, zoo


def _llama_cpp_permute(w, n_heads):
  """llama.cpp convert_hf_to_gguf's q/k row permutation, written out independently."""
  return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _assert_trees_close(a, b, atol=0.0):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
  permuted = _llama_cpp_permute(w, n_heads=3)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(weights.unpermute_gguf_qk(permuted, 3), w)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-llama3"])
def test_hf_dir_round_trip(tmp_path, name):
  model = zoo.load(name)
  weights.save_hf_dir(model.params, model.cfg, str(tmp_path), tokenizer=model.tokenizer)
  params, cfg = weights.load_hf_dir(str(tmp_path))
  assert cfg == model.cfg
  _assert_trees_close(params, model.params)
  reloaded = zoo.load(str(tmp_path))
  assert reloaded.tokenizer.encode("hi there") == model.tokenizer.encode("hi there")
  assert reloaded.tokenizer.pad_token == "<|endoftext|>"


def test_hf_config_variants():
  base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "rms_norm_eps": 1e-6}
  legacy = weights.config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})
  modern = weights.config_from_hf({**base, "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
  assert legacy == modern
  assert legacy.rope_scaling == (8.0, 1.0, 4.0, 8192) and legacy.rope_theta == 5e5
  assert legacy.head_dim == 4 and not legacy.tie_embeddings
  assert weights.config_from_hf({**base, "model_type": "qwen2"}).qkv_bias
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    weights.config_from_hf({**base, "model_type": "gpt2"})
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    weights.config_from_hf({**base, "rope_parameters": {"rope_type": "yarn"}})


def test_missing_files_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    weights.load_hf_dir(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(weights.config_to_hf(zoo.TINY)))
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    weights.load_hf_dir(str(tmp_path))
  with pytest.raises(ValueError, match="unknown model 'nope'"):
    zoo.load("nope")


def _write_gguf(path, params, cfg, arch="llama", quantize_ffn=False):
  """Writes params as llama.cpp would: [out, in] tensors, q/k rows permuted for llama."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.n_layers)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.d_model)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_rope_dimension_count(cfg.head_dim)
  p = jax.tree.map(np.asarray, params)
  w.add_tensor("token_embd.weight", p["embed"])
  w.add_tensor("output_norm.weight", p["final_norm"])
  if not cfg.tie_embeddings:
    w.add_tensor("output.weight", p["lm_head"])
  names = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
           "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
           "w_down": "ffn_down"}
  for i in range(cfg.n_layers):
    for ours, theirs in names.items():
      t = p["layers"][i][ours]
      if arch == "llama" and ours == "wq":
        t = _llama_cpp_permute(t, cfg.n_heads)
      if arch == "llama" and ours == "wk":
        t = _llama_cpp_permute(t, cfg.n_kv_heads)
      t = np.ascontiguousarray(t, np.float32)
      if quantize_ffn and ours.startswith("w_"):
        q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.{theirs}.weight", q, raw_shape=q.shape,
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
      else:
        w.add_tensor(f"blk.{i}.{theirs}.weight", t)
    if cfg.qkv_bias:
      for ours, theirs in (("bq", "attn_q"), ("bk", "attn_k"), ("bv", "attn_v")):
        w.add_tensor(f"blk.{i}.{theirs}.bias", p["layers"][i][ours])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("name,arch", [("tiny", "llama"), ("tiny-qwen2", "qwen2")])
def test_gguf_loading_recovers_params(tmp_path, name, arch):
  model = zoo.load(name)
  path = tmp_path / "model.gguf"
  _write_gguf(path, model.params, model.cfg, arch=arch)
  params, cfg = weights.load_gguf(str(path))
  assert cfg.norm_eps == pytest.approx(model.cfg.norm_eps, rel=1e-6)  # stored as float32
  assert cfg.replace(norm_eps=model.cfg.norm_eps) == model.cfg
  _assert_trees_close(params, model.params)


def test_gguf_quantized_tensors_are_dequantized(tmp_path):
  model = zoo.load("tiny")
  path = tmp_path / "q8.gguf"
  _write_gguf(path, model.params, model.cfg, quantize_ffn=True)
  params, _ = weights.load_gguf(str(path))
  w = np.asarray(model.params["layers"][0]["w_up"])
  err = np.abs(params["layers"][0]["w_up"] - w).max()
  assert 0 < err < 0.01 * np.abs(w).max()  # Q8_0: lossy but close
  tokens = np.arange(3, 20, dtype=np.int32)[None]
  pos = np.arange(17)[None]
  a, _ = transformer.apply(model.params, tokens, pos, model.cfg)
  b, _ = transformer.apply(jax.tree.map(np.asarray, params), tokens, pos, model.cfg)
  diff = np.abs(np.asarray(a) - np.asarray(b)).max()
  assert diff < 0.02 * np.abs(np.asarray(a)).max(), diff


def test_export_cli_round_trip(tmp_path):
  from jaxrl_agents.tools import export
  out = tmp_path / "hf"
  assert export.main(["--model", "tiny-llama3", "--out", str(out)]) == 0
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  with pytest.raises(SystemExit, match="not empty"):
    export.main(["--model", "tiny", "--out", str(out)])
  params, cfg = weights.load_hf_dir(str(out))
  assert cfg == zoo.TINY_LLAMA3
  _assert_trees_close(params, zoo.load("tiny-llama3").params)


def test_bad_weights_name_the_file_and_the_problem(tmp_path, tiny_model):
  good = tmp_path / "good"
  weights.save_hf_dir(tiny_model.params, tiny_model.cfg, str(good),
                          tokenizer=tiny_model.tokenizer)
  # A config whose hidden size disagrees with the weights.
  bad = tmp_path / "bad_shape"
  shutil.copytree(good, bad)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["intermediate_size"] = cfg["intermediate_size"] * 2
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"bad_shape: weight .*w_(gate|up|down).* has shape"):
    zoo.load(str(bad))
  # A truncated safetensors file.
  corrupt = tmp_path / "corrupt"
  shutil.copytree(good, corrupt)
  safetensors_file = corrupt / "model.safetensors"
  safetensors_file.write_bytes(safetensors_file.read_bytes()[:100])
  with pytest.raises(ValueError, match=r"cannot read .*model.safetensors"):
    zoo.load(str(corrupt))
  gguf_file = tmp_path / "broken.gguf"
  gguf_file.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match=r"cannot read GGUF file .*broken.gguf"):
    weights.load_gguf(str(gguf_file))
