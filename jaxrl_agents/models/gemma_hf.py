"""Gemma 3 text models as Hugging Face directories: read them, write them.

A Hugging Face Gemma 3 directory (config.json with model_type "gemma3_text",
or a multimodal "gemma3" one whose language model is read, *.safetensors,
tokenizer.json) loads into `models/gemma.py`'s parameter tree, and a trained
Gemma exports back to one that transformers (`Gemma3ForCausalLM`) and vLLM
load. The names map one to one; only the layouts differ:

| gemma (this project, Google's library) | Hugging Face |
|---|---|
| `embedder/input_embedding` [V, D] | `model.embed_tokens.weight` [V, D] |
| `layer_i/attn/q_einsum/w` [N, D, H] | `self_attn.q_proj.weight` [N*H, D] |
| `layer_i/attn/kv_einsum/w` [2, K, D, H] | `self_attn.{k,v}_proj.weight` [K*H, D] |
| `layer_i/attn/attn_vec_einsum/w` [N, H, D] | `self_attn.o_proj.weight` [D, N*H] |
| `layer_i/mlp/gating_einsum` [2, F, D] | `mlp.{gate,up}_proj.weight` [F, D] |
| `layer_i/mlp/linear` [F, D] | `mlp.down_proj.weight` [D, F] |
| norms' `scale` (applied as 1 + scale) | norms' `weight` (applied as 1 + weight) |
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxrl_agents.models import gemma, weights

MODEL_TYPES = ("gemma3_text", "gemma3")
_NORMS = {  # gemma name -> Hugging Face name, per layer
    "pre_attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TYPES = {gemma.LOCAL: "sliding_attention", gemma.GLOBAL: "full_attention"}


def is_gemma_dir(path: str) -> bool:
  """Whether `path` is a Hugging Face Gemma 3 directory (raises on other Gemma versions)."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      model_type = json.load(f).get("model_type")
  except (OSError, ValueError):
    return False
  if model_type in ("gemma", "gemma2", "gemma3n"):
    raise ValueError(f"{path!r} is a {model_type} directory: Hugging Face Gemma directories load "
                     "for Gemma 3 (gemma3_text, gemma3); Gemma 2 loads as a checkpoint of the "
                     "gemma library")
  return model_type in MODEL_TYPES


def _rope(hf: dict, layer_type: str, legacy_theta: str, default_theta: float):
  """(base frequency, linear scale factor) of one layer type, from either config style."""
  params = (hf.get("rope_parameters") or {}).get(layer_type)
  if params is None:  # transformers 4.x: rope_theta / rope_local_base_freq and rope_scaling
    scaling = hf.get("rope_scaling") if layer_type == "full_attention" else None
    params = {"rope_theta": hf.get(legacy_theta, default_theta), **(scaling or {})}
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ("default", "linear"):
    raise ValueError(f"rope type {kind!r} of {layer_type} layers is not supported "
                     "(Gemma 3 uses 'default' and 'linear')")
  return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def config_from_hf(hf: dict[str, Any]) -> gemma.GemmaConfig:
  """A GemmaConfig from a Hugging Face Gemma 3 config.json (text, or a multimodal one's)."""
  if hf.get("model_type") == "gemma3":
    hf = hf["text_config"]
  layer_types = hf.get("layer_types")
  if layer_types is None:  # older configs: every sliding_window_pattern-th layer is global
    pattern = hf.get("sliding_window_pattern", 6)
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                   for i in range(hf["num_hidden_layers"])]
  by_hf = {v: k for k, v in _LAYER_TYPES.items()}
  local_base, local_scale = _rope(hf, "sliding_attention", "rope_local_base_freq", 10_000.0)
  global_base, global_scale = _rope(hf, "full_attention", "rope_theta", 1_000_000.0)
  if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise ValueError(f"hidden_activation {hf['hidden_activation']!r}: Gemma uses gelu_pytorch_tanh")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("a bidirectional Gemma (an embedding model) is not a causal LM")
  head_dim = hf["head_dim"]
  scalar = hf.get("query_pre_attn_scalar", 256)  # transformers' default
  return gemma.GemmaConfig(
      num_embed=hf["vocab_size"], embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=head_dim,
      num_kv_heads=hf["num_key_value_heads"],
      attention_types=tuple(by_hf[t] for t in layer_types),
      sliding_window_size=hf.get("sliding_window", 4096), use_post_attn_norm=True,
      use_post_ffw_norm=True, use_qk_norm=True,
      attn_logits_soft_cap=hf.get("attn_logit_softcapping"),
      final_logit_softcap=hf.get("final_logit_softcapping"),
      query_scale=None if scalar == head_dim else float(scalar) ** -0.5,
      local_base_frequency=local_base, global_base_frequency=global_base,
      local_scale_factor=local_scale, global_scale_factor=global_scale,
      max_seq_len=hf.get("max_position_embeddings", 131_072))


def config_to_hf(cfg: gemma.GemmaConfig, tokenizer=None) -> dict[str, Any]:
  """config.json for `Gemma3ForCausalLM` (the rope keys in the style transformers 4.x and 5.x
  both read)."""
  if not (cfg.use_qk_norm and cfg.use_post_attn_norm and cfg.use_post_ffw_norm
          and cfg.transpose_gating_einsum):
    raise ValueError("only Gemma 3's layout (qk-norm, post norms) exports as gemma3_text")
  scalar = cfg.head_dim if cfg.query_scale is None else cfg.query_scale ** -2
  if cfg.local_scale_factor != 1.0:
    raise ValueError("Hugging Face's Gemma 3 has no rope scaling for sliding-window layers")
  out = {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "vocab_size": cfg.num_embed, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "layer_types": [_LAYER_TYPES[t] for t in cfg.attention_types],
      "sliding_window": cfg.sliding_window_size, "query_pre_attn_scalar": scalar,
      "rope_theta": cfg.global_base_frequency, "rope_local_base_freq": cfg.local_base_frequency,
      "rope_scaling": (None if cfg.global_scale_factor == 1.0 else
                       {"rope_type": "linear", "factor": cfg.global_scale_factor}),
      "attn_logit_softcapping": cfg.attn_logits_soft_cap,
      "final_logit_softcapping": cfg.final_logit_softcap,
      "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
      "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": True,
      "torch_dtype": "float32",
  }
  if tokenizer is not None:
    out.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
  return out


def params_from_hf(get, cfg: gemma.GemmaConfig, prefix: str = "model.") -> dict:
  """The gemma parameter tree from Hugging Face tensors (`get(name)` -> f32 array)."""
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim
  heads = lambda w, count: w.reshape(count, h, d).transpose(0, 2, 1)  # [C*H, D] -> [C, D, H]
  params = {"embedder": {"input_embedding": get(prefix + "embed_tokens.weight")},
            "final_norm": {"scale": get(prefix + "norm.weight")}}
  for i in range(cfg.num_layers):
    p = f"{prefix}layers.{i}."
    attn = {"attn_vec_einsum": {"w": get(p + "self_attn.o_proj.weight").T.reshape(n, h, d)},
            "_query_norm": {"scale": get(p + "self_attn.q_norm.weight")},
            "_key_norm": {"scale": get(p + "self_attn.k_norm.weight")}}
    q = heads(get(p + "self_attn.q_proj.weight"), n)
    kv = np.stack([heads(get(p + "self_attn.k_proj.weight"), k),
                   heads(get(p + "self_attn.v_proj.weight"), k)])
    if n == k:
      attn["qkv_einsum"] = {"w": np.concatenate([q[None], kv])}
    else:
      attn.update(q_einsum={"w": q}, kv_einsum={"w": kv})
    layer = {"attn": attn, "mlp": {
        "gating_einsum": np.stack([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
        "linear": get(p + "mlp.down_proj.weight").T}}
    layer.update({ours: {"scale": get(p + theirs + ".weight")} for ours, theirs in _NORMS.items()})
    params[f"layer_{i}"] = layer
  return params


def params_to_hf(params: dict, cfg: gemma.GemmaConfig) -> dict[str, np.ndarray]:
  """Hugging Face tensors (`Gemma3ForCausalLM` names, float32) from the gemma parameter tree."""
  import jax

  from jaxrl_agents.parallel import distributed

  host = jax.tree.map(lambda x: np.asarray(distributed.to_host(x), np.float32), params)
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim
  flat = lambda w, count: w.transpose(0, 2, 1).reshape(count * h, d)  # [C, D, H] -> [C*H, D]
  out = {"model.embed_tokens.weight": host["embedder"]["input_embedding"],
         "model.norm.weight": host["final_norm"]["scale"]}
  for i in range(cfg.num_layers):
    layer, p = host[f"layer_{i}"], f"model.layers.{i}."
    attn = layer["attn"]
    if "qkv_einsum" in attn:
      q, key, value = attn["qkv_einsum"]["w"]
    else:
      q, (key, value) = attn["q_einsum"]["w"], attn["kv_einsum"]["w"]
    gate, up = layer["mlp"]["gating_einsum"]
    out.update({
        p + "self_attn.q_proj.weight": flat(q, n), p + "self_attn.k_proj.weight": flat(key, k),
        p + "self_attn.v_proj.weight": flat(value, k),
        p + "self_attn.o_proj.weight": attn["attn_vec_einsum"]["w"].reshape(n * h, d).T,
        p + "self_attn.q_norm.weight": attn["_query_norm"]["scale"],
        p + "self_attn.k_norm.weight": attn["_key_norm"]["scale"],
        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": layer["mlp"]["linear"].T})
    out.update({p + theirs + ".weight": layer[ours]["scale"] for ours, theirs in _NORMS.items()})
  return out


def load_hf_dir(path: str) -> tuple[dict, gemma.GemmaConfig]:
  """(params, config) of a Hugging Face Gemma 3 directory."""
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  get, names = weights.read_safetensors_dir(path)
  prefix = next((p for p in ("model.", "language_model.model.", "model.language_model.")
                 if p + "embed_tokens.weight" in names), "model.")
  return params_from_hf(get, cfg, prefix), cfg


def save_hf_dir(params: dict, cfg: gemma.GemmaConfig, out_dir: str, tokenizer=None) -> None:
  """Writes config.json, model.safetensors (float32) and the tokenizer files."""
  weights.write_hf_dir(out_dir, params_to_hf(params, cfg), config_to_hf(cfg, tokenizer), tokenizer)
