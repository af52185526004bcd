"""Sampler and train step on a GPU: the project against transformers + torch on the same card.

  python benchmarks/gpu.py                          # SmolLM2-135M-Instruct's weights
  python benchmarks/gpu.py --random-weights DIR     # DIR's config.json and tokenizer,
                                                    # random weights (same shapes)
  python benchmarks/gpu.py --skip-sampler --layouts list,stacked-full,stacked-dots
                                                    # the train step in several layer layouts
  python benchmarks/gpu.py --random-weights DIR --skip-sampler --layouts stacked-full \
      --attentions xla,chunked,cudnn               # ... under each attention implementation
  python benchmarks/gpu.py --shape qwen2.5-1.5b --train-shapes 16x2048 --dtypes bfloat16 \
      --layouts stacked-full --attentions cudnn     # a larger architecture, random weights
                                                    # drawn in JAX (no sampler, no torch)

The attention kernels themselves (agreement with the reference, speed at 1k-8k tokens,
scoring's gradient) are benchmarks/attention_kernels.py's.

On a card both sides run in one process, one after the other: JAX is told to
take at most `--jax-memory-fraction` of the card's memory so torch has the rest.

- Sampler: `benchmarks/sampler.py`'s measurement (greedy decoding of 64 new
  tokens, stop tokens disabled, chat-templated arithmetic questions; best of
  `--repeats` calls after a warm-up, the systems interleaved) at larger batch
  sizes, against transformers' `generate` on the card (its default dynamic
  cache, eager).
- Train step: `benchmarks/train_step.py`'s step (forward + backward + AdamW,
  token-mean cross entropy over every token, float32 parameters and moments;
  bfloat16 = bfloat16 matmul inputs) at 8 x 256 tokens and a larger batch,
  against LlamaForCausalLM + torch.optim.AdamW (bfloat16 under `autocast`).
  The project's loss is `experiments.sft.sft_loss`'s two calls, written out
  here so this script imports only the model, sampler and optimizer (a bare
  GPU image lacks the data pipeline's packages).

float32 matmuls: XLA on NVIDIA GPUs uses TF32 tensor cores by default; torch's
default is full float32 matmuls, so torch is set to TF32 too
(`torch.set_float32_matmul_precision("high")`) for a like-for-like float32 row.

Random weights decode and train at the speed of the real ones (stop tokens are
disabled, so every call generates exactly 64 tokens; the train step's cost
does not depend on values). Both sides use the same weights. The last line of
output is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, NamedTuple


def parse_args():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--random-weights", metavar="DIR",
                 help="a Hugging Face Llama directory's config.json and tokenizer files; the "
                      "weights are drawn at random (nothing else is read from DIR)")
  p.add_argument("--sampler-batch-sizes", default="1,32,256")
  p.add_argument("--train-shapes", default="8x256,32x1024",
                 help="comma-separated BATCHxSEQ train-step shapes")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--layouts", default="list",
                 help="comma-separated layer layouts of the project's train step: list (one "
                      "program per layer, the CPU's default), stacked (one lax.scan, nothing "
                      "rematerialized), stacked-full or stacked-dots (the scanned layer "
                      "rematerialized by transformer.REMAT_POLICIES)")
  p.add_argument("--attentions", default="auto",
                 help="comma-separated attention implementations of the project's train step "
                      "(models/attention.py: auto, xla, chunked, cudnn, triton, mosaic)")
  p.add_argument("--skip-torch", action="store_true", help="the train step's torch side")
  p.add_argument("--shape", choices=sorted(SHAPES),
                 help="the train step of a larger architecture with random weights, drawn "
                      "in JAX (the project's side only: no sampler, no torch)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--skip-sampler", action="store_true")
  p.add_argument("--skip-train", action="store_true")
  p.add_argument("--jax-memory-fraction", type=float, default=0.45)
  args = p.parse_args()
  unknown = sorted(set(args.layouts.split(",")) - set(LAYOUTS))
  if unknown:
    p.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
  return args


# Architectures for `--shape` (public config.json figures; no weights are read).
SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                         n_kv_heads=2, head_dim=128, ffn_dim=8960, rope_theta=1000000.0,
                         tie_embeddings=True, qkv_bias=True, max_seq_len=32768),
}
# The train step's layer layouts: the per-layer list, or the stacked layers with the
# scanned layer rematerialized by a `transformer.REMAT_POLICIES` name ("stacked": none).
LAYOUTS = ("list", "stacked", "stacked-full", "stacked-dots")
ARGS = parse_args()
# Before JAX starts: leave the rest of the card to torch.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(ARGS.jax_memory_fraction))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sampler import bench_interleaved, hf_runner, load_hf, make_questions  # noqa: E402
from sampler import ours_runner as ours_sampler_runner  # noqa: E402

import cpu_info  # noqa: E402
from jaxrl_agents.models import tokenizer as tokenizer_lib  # noqa: E402
from jaxrl_agents.models import transformer, zoo  # noqa: E402
from jaxrl_agents.objectives import losses  # noqa: E402
from jaxrl_agents.rollout import scoring  # noqa: E402
from jaxrl_agents.train import optim as optim_lib  # noqa: E402

NEW_TOKENS = 64
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "special_tokens_map.json")


def random_weights_dir(src: str) -> str:
  """A Hugging Face directory with src's config and tokenizer and random weights."""
  from transformers import AutoConfig, AutoModelForCausalLM

  out = tempfile.mkdtemp(prefix="random_weights_")
  for name in HF_FILES:
    if os.path.exists(os.path.join(src, name)):
      shutil.copy(os.path.join(src, name), out)
  torch.manual_seed(0)
  AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
  return out


def device_info(torch_device: str) -> dict:
  info = {"jax_backend": jax.default_backend(), "jax_device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "torch": torch.__version__, "host": cpu_info.describe()}
  if torch_device == "cuda":
    info["torch_device"] = torch.cuda.get_device_name()
  return info


def matmul_tflop_s(n: int = 8192, repeats: int = 10) -> dict:
  """JAX's dense matmul throughput on the card, the ceiling both sides' MFU is quoted
  against (torch's own is not measured)."""
  out = {}
  for dtype in ("float32", "bfloat16"):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
      r = mm(a)
    r.block_until_ready()
    out[f"jax_{dtype}"] = 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12
  return out


def sync(torch_device: str):
  if torch_device == "cuda":
    torch.cuda.synchronize()


def bench_sampler(model, hf_dir: str, torch_device: str, batch_sizes, dtypes, repeats) -> dict:
  questions = make_questions(max(batch_sizes))
  texts = [tokenizer_lib.chat_prompt(model.tokenizer, q) for q in questions]
  ids = [model.tokenizer.encode(t, add_special_tokens=False) for t in texts]
  pad = model.tokenizer.pad_token_id
  result = {"tok_s": {"ours": {}, "hf": {}}, "compile_s": {}}
  for dtype in dtypes:
    hf_model = load_hf(hf_dir, dtype).to(torch_device)
    for bs in batch_sizes:
      runners = {"ours": ours_sampler_runner(model, ids, dtype, bs),
                 "hf": hf_runner(hf_model, ids, pad, bs, device=torch_device)}
      key = f"{dtype}_bs{bs}"
      for system, (first, best) in bench_interleaved(runners, repeats).items():
        result["tok_s"][system][key] = bs * NEW_TOKENS / best
        if system == "ours":
          result["compile_s"][key] = max(first - best, 0.0)
        print(f"sampler {system:5s} {dtype:8s} bs={bs:3d}: {bs * NEW_TOKENS / best:8.1f} tok/s "
              f"(best {best:.3f} s, first {first:.1f} s)", flush=True)
    del hf_model
    torch.cuda.empty_cache() if torch_device == "cuda" else None
  result["ratio_vs_hf"] = {k: v / result["tok_s"]["hf"][k]
                           for k, v in result["tok_s"]["ours"].items()}
  return result


class TrainState(NamedTuple):
  """`optim.update_state`'s state (`experiments.sft.SFTState`'s fields)."""
  params: Any
  opt_state: Any
  updates: jax.Array


class TrainBatch(NamedTuple):
  """`experiments.sft.SFTBatch`'s fields: tokens, mask, reply mask."""
  tokens: jax.Array
  mask: jax.Array
  reply: jax.Array


def layout_params(model, layout: str):
  """(params, cfg) of `layout` (`--layouts`), as `experiments.common.load_model` sets them
  from `config.layout` and `config.remat`."""
  if layout == "list":
    return model.params, model.cfg
  remat = layout.partition("-")[2] or "none"
  return transformer.stack_layers(model.params), model.cfg.replace(remat=remat)


def ours_train_step(model, tokens: np.ndarray, dtype: str, layout: str = "list",
                    attention: str = "auto"):
  """(step, close) of the project's SFT update on every token of `tokens`: jitted, the
  state donated (`experiments.sft.make_update`)."""
  params, cfg = layout_params(model, layout)
  cfg = cfg.replace(dtype=dtype, attention=attention)
  optimizer = optim_lib.make_optimizer(learning_rate=1e-5, total_updates=1000, grad_clip=None)

  def loss(params, batch: TrainBatch):
    logp = scoring.reply_logprobs(params, batch.tokens, batch.mask, batch.reply, cfg=cfg)
    return losses.sft_nll(logp, batch.reply, aggregation="token-mean")

  update = jax.jit(functools.partial(optim_lib.update_state, optimizer, loss, epochs=1,
                                     minibatches=1), donate_argnums=0)
  params = jax.tree.map(jnp.copy, params)
  box = [TrainState(params, optimizer.tx.init(params), jnp.zeros((), jnp.int32))]
  ones = jnp.ones(tokens.shape, bool)
  batch = TrainBatch(jnp.asarray(tokens), ones, ones)
  rng = jax.random.key(0)

  def step():
    box[0], metrics = update(box[0], batch, rng, jnp.float32(0.0))
    jax.block_until_ready((box[0], metrics))

  def close():
    for leaf in jax.tree.leaves(box.pop()):
      leaf.delete()
  return step, close


def torch_train_step(hf_dir: str, tokens: np.ndarray, dtype: str, device: str):
  """(step, close) of `benchmarks/torch_train_step.py`'s step on `device`."""
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
  ids = torch.tensor(tokens, dtype=torch.long, device=device)

  def step():
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
      out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)

  def close():
    nonlocal model, opt
    del model, opt
    if device == "cuda":
      torch.cuda.empty_cache()
  return step, close


def is_out_of_memory(e: Exception) -> bool:
  """XLA's RESOURCE_EXHAUSTED or torch's OutOfMemoryError."""
  return "RESOURCE_EXHAUSTED" in str(e) or isinstance(e, torch.OutOfMemoryError)


def time_steps(step, repeats: int) -> tuple[float, float]:
  """(first call s, best of `repeats` later calls)."""
  start = time.perf_counter()
  step()
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    step()
    best = min(best, time.perf_counter() - start)
  return first, best


def bench_train(model, hf_dir: str, torch_device: str, shapes, dtypes, repeats,
                peak: dict, layouts=("list",), with_torch: bool = True,
                attentions=("auto",)) -> dict:
  """Each (shape, dtype, system) alone: its state is freed before the next starts. The
  project's rows are keyed by layout and attention too where more than one is asked
  for; a row that runs out of the card's memory is recorded as such and the run goes
  on."""
  result = {"tok_s": {"ours": {}, "torch": {}}, "compile_s": {}, "mfu": {"ours": {}, "torch": {}},
            "out_of_memory": [], "errors": {}}
  base = {}
  for batch, seq in shapes:
    tokens = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (batch, seq),
                                                dtype=np.int32)
    flops_per_token = 6 * model.cfg.num_params + 12 * model.cfg.n_layers * seq * (
        model.cfg.n_heads * model.cfg.head_dim)
    for dtype in dtypes:
      runs = [("ours", (layout, attn)) for layout in layouts for attn in attentions] + (
          [("torch", ("", ""))] if with_torch else [])
      for system, (layout, attn) in runs:
        key = (f"{dtype}_{batch}x{seq}" + (f"_{layout}" if len(layouts) > 1 and layout else "")
               + (f"_{attn}" if len(attentions) > 1 and attn else ""))
        base[key] = f"{dtype}_{batch}x{seq}"  # the torch row an ours row compares with
        try:
          step, close = (ours_train_step(model, tokens, dtype, layout, attn)
                         if system == "ours" else
                         torch_train_step(hf_dir, tokens, dtype, torch_device))
          try:
            first, best = time_steps(step, repeats)
          finally:
            close()
        except Exception as e:  # noqa: BLE001 - out of memory, or a kernel that refuses, is a result
          if is_out_of_memory(e):
            result["out_of_memory"].append(f"{system} {key}")
            print(f"train   {system:5s} {key:18s}: out of memory ({type(e).__name__})",
                  flush=True)
          elif system == "ours" and attn not in ("auto", "xla"):
            result["errors"][f"{system} {key}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"train   {system:5s} {key:18s}: {type(e).__name__}", flush=True)
          else:
            raise
          continue
        tok_s = batch * seq / best
        result["tok_s"][system][key] = tok_s
        result["mfu"][system][key] = tok_s * flops_per_token / (peak[f"jax_{dtype}"] * 1e12)
        if system == "ours":
          result["compile_s"][key] = max(first - best, 0.0)
        print(f"train   {system:5s} {key:18s}: {tok_s:9.0f} tok/s, step {best * 1e3:7.1f} ms "
              f"(first {first:.1f} s), MFU {result['mfu'][system][key]:.3f}", flush=True)
  result["ratio_vs_torch"] = {k: v / result["tok_s"]["torch"][base[k]]
                              for k, v in result["tok_s"]["ours"].items()
                              if base[k] in result["tok_s"]["torch"]}
  return result


def main():
  torch_device = "cuda" if torch.cuda.is_available() else "cpu"
  if torch_device == "cuda":
    torch.set_float32_matmul_precision("high")  # TF32, as XLA's default on the card
  if jax.default_backend() == "cpu":
    print("note: JAX runs on the CPU here; the figures are not a GPU's", flush=True)
  if ARGS.shape:
    model = zoo.random_model(transformer.TransformerConfig(**SHAPES[ARGS.shape]), ARGS.shape)
    hf_dir = None
    ARGS.skip_sampler = ARGS.skip_torch = True
  elif ARGS.random_weights:
    hf_dir = random_weights_dir(ARGS.random_weights)
    model = zoo.load(hf_dir)
  else:
    model = zoo.load(zoo.DEFAULT_MODEL)
    hf_dir = zoo.smollm2_dir()
  info = device_info(torch_device)
  peak = matmul_tflop_s(n=8192 if jax.default_backend() != "cpu" else 1024)
  print("device:", json.dumps(info), "matmul TFLOP/s:", json.dumps(peak), flush=True)
  dtypes = ARGS.dtypes.split(",")
  result = {"device": info, "matmul_tflop_s": peak, "shape": ARGS.shape,
            "random_weights": bool(ARGS.random_weights or ARGS.shape),
            "new_tokens": NEW_TOKENS}
  if not ARGS.skip_sampler:
    sizes = [int(b) for b in ARGS.sampler_batch_sizes.split(",")]
    result["sampler"] = bench_sampler(model, hf_dir, torch_device, sizes, dtypes, ARGS.repeats)
  if not ARGS.skip_train:
    shapes = [tuple(int(x) for x in s.split("x")) for s in ARGS.train_shapes.split(",")]
    result["train_step"] = bench_train(model, hf_dir, torch_device, shapes, dtypes,
                                       ARGS.repeats, peak, ARGS.layouts.split(","),
                                       with_torch=not ARGS.skip_torch,
                                       attentions=ARGS.attentions.split(","))
  if ARGS.random_weights and hf_dir:
    shutil.rmtree(hf_dir, ignore_errors=True)
  print(json.dumps(result))


if __name__ == "__main__":
  sys.exit(main())
