"""Load and save Llama-family weights: Hugging Face directories and GGUF files.

Every loader returns `(params, TransformerConfig)` with params laid out as in
`transformer.py` (numpy float32 arrays; `jax.device_put` or the sharding code
moves them). `save_hf_dir` writes the reverse: a directory transformers (and
vLLM) load as a LlamaForCausalLM or Qwen2ForCausalLM.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxrl_agents.models.transformer import TransformerConfig, unstack_layers

# Our per-layer names -> the Hugging Face module path under model.layers.{i}.
_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}

# Our per-layer names -> the GGUF tensor name under blk.{i}.
_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}

_SUPPORTED_HF_TYPES = ("llama", "qwen2", "mistral")


def _layer_keys(cfg: TransformerConfig) -> list[str]:
  keys = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
  if cfg.qkv_bias:
    keys += ["bq", "bk", "bv"]
  return keys


# ----------------------------------------------------------------------------
# Hugging Face directories.


_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size")


def _check_modelled(hf: dict[str, Any], model_type: str) -> None:
  """Refuses, by name, what the transformer does not compute: loading such a model would
  silently drop part of it (biases, another activation)."""
  missing = [k for k in _REQUIRED_HF_KEYS if not isinstance(hf.get(k), int) or hf[k] < 1]
  if missing:
    raise ValueError(f"config.json: {', '.join(missing)} missing or not a positive integer")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act {act!r} is not supported (the transformer's "
                     "MLP is SwiGLU: silu)")
  if hf.get("mlp_bias"):
    raise ValueError("config.json mlp_bias: the MLP's biases are not supported")
  if hf.get("attention_bias") and model_type != "qwen2":
    # Llama's attention_bias puts a bias on o_proj too; the transformer has q, k, v biases
    # only (Qwen2's layout).
    raise ValueError("config.json attention_bias: biases on the attention projections "
                     "(o_proj's included) are not supported; Qwen2's q/k/v biases are")


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
  """A TransformerConfig from a Hugging Face config.json dict (Llama/Qwen2/Mistral)."""
  model_type = hf.get("model_type")
  if model_type not in _SUPPORTED_HF_TYPES:
    raise ValueError(
        f"config.json model_type {model_type!r} is not supported; expected one of "
        f"{_SUPPORTED_HF_TYPES}")
  # transformers 5 moved rope settings into `rope_parameters`; older files keep
  # `rope_theta` and `rope_scaling` at the top level.
  rope = dict(hf.get("rope_parameters") or {})
  if hf.get("rope_scaling"):
    rope = {**hf["rope_scaling"], **rope}
  theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = None
  if rope_type == "llama3":
    scaling = (float(rope["factor"]), float(rope["low_freq_factor"]),
               float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
  elif rope_type not in ("default", None):
    raise ValueError(f"rope type {rope_type!r} is not supported (only default and llama3)")
  _check_modelled(hf, model_type)
  n_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  qkv_bias = model_type == "qwen2"
  return TransformerConfig(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"],
      n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=head_dim,
      ffn_dim=hf["intermediate_size"],
      rope_theta=float(theta),
      rope_scaling=scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
  )


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
  """The config.json dict transformers needs to rebuild this architecture."""
  model_type = "qwen2" if cfg.qkv_bias else "llama"
  arch = "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"
  rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    factor, low, high, original = cfg.rope_scaling
    rope_parameters.update(rope_type="llama3", factor=factor, low_freq_factor=low,
                           high_freq_factor=high, original_max_position_embeddings=original)
  hf = {
      "architectures": [arch],
      "model_type": model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.ffn_dim,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": rope_parameters,
      "torch_dtype": "float32",
  }
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
  if model_type == "llama":
    hf["attention_bias"] = False
    hf["mlp_bias"] = False
  return hf


def _collect_layers(get, cfg: TransformerConfig, names: dict[str, str], prefix: str) -> list:
  """Per-layer dicts; both formats store matrices [out, in], as the params do."""
  return [{key: get(prefix.format(i=i) + names[key]) for key in _layer_keys(cfg)}
          for i in range(cfg.n_layers)]


def check_params(params: dict, cfg: TransformerConfig, source: str = "params") -> None:
  """Raises ValueError naming `source`, the weight and both shapes on any mismatch with `cfg`
  (stacked params are checked layer by layer)."""
  import jax

  from jaxrl_agents.models import transformer

  params = unstack_layers(params)
  expected = jax.eval_shape(lambda: transformer.init(jax.random.key(0), cfg))
  if len(params.get("layers", [])) != cfg.n_layers:
    raise ValueError(f"{source}: {len(params.get('layers', []))} layers, but the config has "
                     f"{cfg.n_layers}")
  flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected))
  flat_actual = dict(jax.tree_util.tree_leaves_with_path(params))
  for path, want in flat_expected.items():
    name = jax.tree_util.keystr(path)
    if path not in flat_actual:
      raise ValueError(f"{source}: weight {name} is missing")
    got = tuple(np.shape(flat_actual[path]))
    if got != tuple(want.shape):
      raise ValueError(f"{source}: weight {name} has shape {got}, but the config implies "
                       f"{tuple(want.shape)}")


def read_safetensors_dir(path: str):
  """`get(name)` -> the float32 array of one weight of the *.safetensors files in `path`
  (a KeyError naming the directory for a missing one), and the set of names."""
  from safetensors.numpy import load_file

  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    try:
      loaded = load_file(os.path.join(path, name))
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
      raise ValueError(f"cannot read {os.path.join(path, name)!r}: {e}") from e
    tensors.update(loaded)

  def get(name):
    if name not in tensors:
      raise KeyError(f"weight {name!r} missing from the safetensors files in {path!r}")
    return _to_float32(tensors[name])

  return get, set(tensors)


def load_hf_dir(path: str) -> tuple[dict, TransformerConfig]:
  """Loads config.json and *.safetensors from a Hugging Face model directory."""
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{path!r} is not a Hugging Face model directory: no config.json")
  try:
    with open(config_path, "rb") as f:
      hf = json.loads(f.read())
  except (OSError, ValueError) as e:
    raise ValueError(f"{config_path}: not a readable JSON config ({e})") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{config_path}: expected a JSON object")
  cfg = config_from_hf(hf)
  get, names = read_safetensors_dir(path)
  used = set()

  def tracked(name):
    used.add(name)
    return get(name)

  params, cfg = _assemble(tracked, cfg, path, embed="model.embed_tokens.weight",
                          layer_names=_HF_LAYER_NAMES, layer_prefix="model.layers.{i}.",
                          final_norm="model.norm.weight", lm_head="lm_head.weight")
  _check_all_used(names - used, get, params, cfg, path)
  return params, cfg


def _check_all_used(unused: set[str], get, params: dict, cfg: TransformerConfig,
                    path: str) -> None:
  """Every tensor in the files is a weight the model computes with: anything else (a
  bias, an extra layer) would be dropped silently. Rotary tables are derived; a tied
  model's saved lm_head is fine when it equals the embedding."""
  unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
  if cfg.tie_embeddings and "lm_head.weight" in unused:
    if not np.array_equal(get("lm_head.weight"), params["embed"]):
      raise ValueError(f"{path}: tie_word_embeddings is set but lm_head.weight differs from "
                       "the embedding")
    unused.discard("lm_head.weight")
  if unused:
    raise ValueError(f"{path}: {len(unused)} weights in the files are not part of the model "
                     f"its config.json describes ({', '.join(sorted(unused)[:4])}); loading "
                     "would drop them")


def _assemble(get, cfg: TransformerConfig, path: str, *, embed: str, layer_names,
              layer_prefix: str, final_norm: str, lm_head: str) -> tuple[dict, TransformerConfig]:
  """The params tree from a file format's tensor names (`get(name)` -> f32 array), checked
  against `cfg`: the one assembly of Hugging Face and GGUF checkpoints."""
  params = {
      "embed": get(embed),
      "layers": _collect_layers(get, cfg, layer_names, layer_prefix),
      "final_norm": get(final_norm),
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = get(lm_head)
  check_params(params, cfg, path)
  return params, cfg


def _to_float32(x: np.ndarray) -> np.ndarray:
  if x.dtype == np.uint16:  # bf16 as read by safetensors.numpy without ml_dtypes
    return (x.astype(np.uint32) << 16).view(np.float32)
  return np.asarray(x, dtype=np.float32)


def save_hf_dir(params: dict, cfg: TransformerConfig, out_dir: str, tokenizer=None) -> None:
  """Writes config.json, model.safetensors (float32) and, if given, tokenizer files."""
  host = _to_numpy(unstack_layers(params))
  tensors = {
      "model.embed_tokens.weight": host["embed"],
      "model.norm.weight": host["final_norm"],
  }
  for i, layer in enumerate(host["layers"]):
    for key in _layer_keys(cfg):
      tensors[f"model.layers.{i}.{_HF_LAYER_NAMES[key]}"] = layer[key]
  if not cfg.tie_embeddings:
    tensors["lm_head.weight"] = host["lm_head"]
  write_hf_dir(out_dir, tensors, config_to_hf(cfg), tokenizer)


def save_peft_adapters(adapters: dict, cfg: TransformerConfig, out_dir: str, *, rank: int,
                       alpha: float, base_model: str) -> None:
  """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) of the
  project's transformer's adapters (`models/lora.py`, list or stacked layout), for
  `peft.PeftModel.from_pretrained(<the base as a Hugging Face model>, out_dir)`."""
  import jax
  from safetensors.numpy import save_file

  layers = adapters.get("layers", [])
  if isinstance(layers, dict):  # stacked: [L, ...] leaves
    n = cfg.n_layers
    layers = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)]
  unknown = sorted(set(adapters) - {"layers"})
  if unknown:
    raise ValueError(f"PEFT adapters cover the layers' projections; these adapted weights "
                     f"have no PEFT name: {unknown}")
  tensors, modules = {}, set()
  for i, layer in enumerate(layers):
    for key, ab in layer.items():
      module = _HF_LAYER_NAMES[key].removesuffix(".weight")
      modules.add(module.rsplit(".", 1)[-1])
      prefix = f"base_model.model.model.layers.{i}.{module}"
      tensors[f"{prefix}.lora_A.weight"] = np.asarray(ab["a"], np.float32)  # [r, in]
      tensors[f"{prefix}.lora_B.weight"] = np.asarray(ab["b"], np.float32)  # [out, r]
  os.makedirs(out_dir, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(modules), "base_model_name_or_path": base_model,
            "inference_mode": True, "use_rslora": False, "init_lora_weights": True}
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def write_hf_dir(out_dir: str, tensors: dict[str, np.ndarray], config: dict[str, Any],
                 tokenizer=None) -> None:
  """A Hugging Face directory: model.safetensors (float32), config.json and, with a
  tokenizer, its files and generation_config.json."""
  from safetensors.numpy import save_file

  os.makedirs(out_dir, exist_ok=True)
  tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  if tokenizer is not None:
    from jaxrl_agents.models import tokenizer as tokenizer_lib

    tokenizer.save_pretrained(out_dir)
    # Every stop token (Gemma's instruct models end a turn with <end_of_turn> and the text
    # with <eos>), as transformers' and vLLM's generation read them.
    stops = list(tokenizer_lib.stop_token_ids(tokenizer))
    generation = {"bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": stops[0] if len(stops) == 1 else stops,
                  "pad_token_id": tokenizer.pad_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump(generation, f, indent=2)


def _to_numpy(params: dict) -> dict:
  import jax
  return jax.tree.map(lambda x: np.asarray(x, dtype=np.float32), params)


# ----------------------------------------------------------------------------
# GGUF files.


def unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation on an [out, in] projection.

  llama.cpp's converter reorders each head's rows from HF's half-split rotary
  layout (first half, second half) to interleaved pairs:
  `w.reshape(n_heads, 2, Dh/2, in).swapaxes(1, 2)`. This inverts it.
  """
  out_dim = w.shape[0]
  head_dim = out_dim // n_heads
  return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def read_gguf_metadata(reader) -> dict[str, Any]:
  """Scalar and string fields of a GGUFReader (token lists are left out: they are big)."""
  meta = {}
  for key, field in reader.fields.items():
    if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores"):
      continue
    meta[key] = field.contents()
  return meta


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> TransformerConfig:
  arch = meta.get("general.architecture")
  if arch not in ("llama", "qwen2"):
    raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
  n_heads = int(meta[f"{arch}.attention.head_count"])
  d_model = int(meta[f"{arch}.embedding_length"])
  head_dim = int(meta.get(f"{arch}.rope.dimension_count", d_model // n_heads))
  vocab = meta.get(f"{arch}.vocab_size")
  if vocab is None:
    raise ValueError("GGUF file has no vocab_size")
  return TransformerConfig(
      vocab_size=int(vocab),
      d_model=d_model,
      n_layers=int(meta[f"{arch}.block_count"]),
      n_heads=n_heads,
      n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      ffn_dim=int(meta[f"{arch}.feed_forward_length"]),
      rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
      norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
      tie_embeddings="output.weight" not in tensor_names,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
  )


def load_gguf(path: str) -> tuple[dict, TransformerConfig]:
  """Loads and dequantizes a llama/qwen2 GGUF file into float32 params."""
  import gguf

  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path!r}")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
    raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
  tensors = {t.name: t for t in reader.tensors}
  meta = read_gguf_metadata(reader)
  if meta.get("general.architecture") == "llama" and "llama.vocab_size" not in meta:
    meta["llama.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
  cfg = config_from_gguf(meta, set(tensors))
  arch = meta["general.architecture"]

  def get(name):
    if name not in tensors:
      raise KeyError(f"tensor {name!r} missing from GGUF file {path!r}")
    t = tensors[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    # GGUF lists dims fastest-first; numpy data comes out [out, in].
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    # Only llama's converter permutes q/k; qwen2's keeps HF's layout.
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
      w = unpermute_gguf_qk(w, cfg.n_heads)
    elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
      w = unpermute_gguf_qk(w, cfg.n_kv_heads)
    return w

  return _assemble(get, cfg, path, embed="token_embd.weight", layer_names=_GGUF_LAYER_NAMES,
                   layer_prefix="blk.{i}.", final_norm="output_norm.weight",
                   lm_head="output.weight")
