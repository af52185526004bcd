"""Sampler throughput: this project vs transformers and tunix, on SmolLM2-135M-Instruct.

  .venv/bin/python benchmarks/sampler.py            # all systems (sets up tunix's venv)
  .venv/bin/python benchmarks/sampler.py --skip-tunix --batch-sizes 1,8

Greedy decoding of 64 new tokens (stop tokens disabled so every system
generates exactly 64) for batches of chat-templated arithmetic questions of
about 45 tokens, in float32 and bfloat16. Each figure is the best of 3 timed
calls after a warm-up call; compile time is the warm-up's excess over the best
call. Side by side, in the same run: transformers' `generate` (torch CPU, same
weights), tunix's `Sampler` (its llama3 model given SmolLM2's shapes and
weights, in benchmarks/.venv-tunix), and the machine's own limits (memory read
bandwidth bounds batch-1 decoding; matmul throughput bounds batch 32).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.rollout import sampler as sampler_lib

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TOKENS = 64
PROMPT_BUCKET = 64


def make_questions(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  ops = [("+", "plus"), ("-", "minus"), ("*", "times")]
  out = []
  for _ in range(n):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    sym, word = rng.choice(ops)
    out.append(f"What is {a} {sym} {b}? Compute {a} {word} {b} step by step and give the result.")
  return out


def best_of(fn, repeats: int) -> tuple[float, float]:
  """(first call seconds, best of `repeats` later calls)."""
  start = time.perf_counter()
  fn()
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return first, min(times)


def bench_ours(model, ids, batch_sizes, dtypes, repeats):
  tok_s, compile_s = {}, {}
  sampling = sampler_lib.SamplingConfig(max_new_tokens=NEW_TOKENS, stop_tokens=(),
                                        pad_id=model.tokenizer.pad_token_id)
  for dtype in dtypes:
    cfg = model.cfg.replace(dtype=dtype, param_dtype=dtype)
    params = transformer.cast_params(model.params, dtype)
    for bs in batch_sizes:
      tokens, mask = tokenizer_lib.pad_left(ids[:bs], model.tokenizer.pad_token_id, PROMPT_BUCKET)
      tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)

      def run(params=params, cfg=cfg, tokens=tokens, mask=mask):
        out = sampler_lib.generate(params, cfg, tokens, mask, jax.random.key(0), sampling)
        jax.block_until_ready(out)

      first, best = best_of(run, repeats)
      key = f"{dtype}_bs{bs}"
      tok_s[key] = bs * NEW_TOKENS / best
      compile_s[key] = max(first - best, 0.0)
      print(f"ours  {dtype:8s} bs={bs:2d}: {tok_s[key]:7.1f} tok/s (best {best:.2f}s, "
            f"compile {compile_s[key]:.1f}s)", flush=True)
  return tok_s, compile_s


def bench_hf(hf_dir, ids, pad_id, batch_sizes, dtypes, repeats):
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 2)
  tok_s = {}
  for dtype in dtypes:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    model.eval()
    for bs in batch_sizes:
      tokens, mask = tokenizer_lib.pad_left(ids[:bs], pad_id)
      tokens_t = torch.tensor(tokens, dtype=torch.long)
      mask_t = torch.tensor(mask, dtype=torch.long)

      def run(model=model, tokens_t=tokens_t, mask_t=mask_t):
        with torch.no_grad():
          out = model.generate(tokens_t, attention_mask=mask_t, max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad_id)
        assert out.shape[1] == tokens_t.shape[1] + NEW_TOKENS

      _, best = best_of(run, repeats)
      key = f"{dtype}_bs{bs}"
      tok_s[key] = bs * NEW_TOKENS / best
      print(f"hf    {dtype:8s} bs={bs:2d}: {tok_s[key]:7.1f} tok/s (best {best:.2f}s)", flush=True)
  return tok_s


def bench_tunix(hf_dir, texts, batch_sizes, dtypes, repeats):
  subprocess.run(["bash", os.path.join(HERE, "setup_tunix.sh")], check=True)
  python = os.path.join(HERE, ".venv-tunix", "bin", "python")
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(texts, f)
  cmd = [python, os.path.join(HERE, "tunix_sampler.py"), "--hf-dir", hf_dir, "--prompts", f.name,
         "--batch-sizes", ",".join(map(str, batch_sizes)), "--dtypes", ",".join(dtypes),
         "--repeats", str(repeats), "--new-tokens", str(NEW_TOKENS)]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  lines = proc.stdout.strip().splitlines()
  for line in lines[:-1]:
    print(line, flush=True)
  if proc.returncode != 0:
    print(proc.stderr[-3000:], file=sys.stderr)
    raise RuntimeError("tunix benchmark failed")
  return json.loads(lines[-1])


def machine_limits(repeats: int = 5) -> dict:
  """Memory read bandwidth and matmul throughput, measured with JAX."""
  big = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
  total = jax.jit(jnp.sum)
  _, t = best_of(lambda: total(big).block_until_ready(), repeats)
  bandwidth = big.nbytes / t / 1e9
  n = 2048
  a32 = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  mm32 = jax.jit(lambda a, b: a @ b)
  _, t32 = best_of(lambda: mm32(a32, a32).block_until_ready(), repeats)
  a16 = a32.astype(jnp.bfloat16)
  mm16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  _, t16 = best_of(lambda: mm16(a16, a16).block_until_ready(), repeats)
  flops = 2 * n ** 3
  return {"read_gb_s": bandwidth, "matmul_f32_gflop_s": flops / t32 / 1e9,
          "matmul_bf16_f32acc_gflop_s": flops / t16 / 1e9}


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch-sizes", default="1,8,32")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--skip-tunix", action="store_true")
  p.add_argument("--skip-hf", action="store_true")
  args = p.parse_args()
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  dtypes = args.dtypes.split(",")

  model = zoo.load(zoo.DEFAULT_MODEL)
  hf_dir = zoo.smollm2_dir()
  questions = make_questions(max(batch_sizes))
  texts = [tokenizer_lib.chat_prompt(model.tokenizer, q) for q in questions]
  ids = [model.tokenizer.encode(t, add_special_tokens=False) for t in texts]
  print(f"prompts: {len(ids)}, mean length {np.mean([len(i) for i in ids]):.1f} tokens, "
        f"{NEW_TOKENS} new tokens, greedy", flush=True)

  limits = machine_limits()
  print("machine:", json.dumps({k: round(v, 1) for k, v in limits.items()}), flush=True)
  result = {"tok_s": {}, "compile_s": {}, "machine": limits,
            "prompt_tokens_mean": float(np.mean([len(i) for i in ids]))}
  result["tok_s"]["ours"], result["compile_s"]["ours"] = bench_ours(
      model, ids, batch_sizes, dtypes, args.repeats)
  if not args.skip_hf:
    result["tok_s"]["hf"] = bench_hf(hf_dir, ids, model.tokenizer.pad_token_id, batch_sizes,
                                     dtypes, args.repeats)
  if not args.skip_tunix:
    tunix = bench_tunix(hf_dir, texts, batch_sizes, dtypes, args.repeats)
    result["tok_s"]["tunix"] = tunix["tok_s"]
    result["compile_s"]["tunix"] = tunix["compile_s"]
    ours_texts = sampler_lib.Sampler(model)(questions[:len(tunix["texts"]["patched"])],
                                            max_new_tokens=NEW_TOKENS)[0]
    for variant, their_texts in tunix["texts"].items():
      same = sum(a.strip() == b.strip() for a, b in zip(ours_texts, their_texts, strict=True))
      result[f"tunix_{variant}_text_agreement"] = same / len(ours_texts)
      print(f"tunix {variant}: {same}/{len(ours_texts)} greedy texts identical to ours; "
            f"first: {their_texts[0][:80]!r}", flush=True)

  ours = result["tok_s"]["ours"]
  # Bounds: batch 1 reads every weight once per token; batch 32 does 2 flops per
  # parameter per token.
  weight_bytes = {"float32": 4 * model.cfg.num_params, "bfloat16": 2 * model.cfg.num_params}
  result["limits_tok_s"] = {
      "float32_bs1": limits["read_gb_s"] * 1e9 / weight_bytes["float32"],
      "bfloat16_bs1": limits["read_gb_s"] * 1e9 / weight_bytes["bfloat16"],
      "float32_compute": limits["matmul_f32_gflop_s"] * 1e9 / (2 * model.cfg.num_params),
      "bfloat16_compute": limits["matmul_bf16_f32acc_gflop_s"] * 1e9 / (2 * model.cfg.num_params),
  }
  for dtype in dtypes:
    for bs in batch_sizes:
      key = f"{dtype}_bs{bs}"
      bound = result["limits_tok_s"][f"{dtype}_bs1" if bs == 1 else f"{dtype}_compute"]
      result.setdefault("fraction_of_limit", {})[key] = ours[key] / bound
  for other in ("tunix", "hf"):
    if other not in result["tok_s"]:
      continue
    for bs in batch_sizes:
      for dtype in dtypes:
        key = f"{dtype}_bs{bs}"
        if key in result["tok_s"][other]:
          result.setdefault(f"ratio_vs_{other}", {})[key] = ours[key] / result["tok_s"][other][key]
  best_dtype = lambda system, bs: max(result["tok_s"][system].get(f"{d}_bs{bs}", 0) for d in dtypes)
  if "tunix" in result["tok_s"]:
    result["ratio_vs_tunix_bs1"] = result["ratio_vs_tunix"].get("float32_bs1")
    result["ratio_vs_tunix_bs32"] = result["ratio_vs_tunix"].get("float32_bs32")
    result["ratio_vs_tunix_bs32_best_dtype"] = best_dtype("ours", 32) / best_dtype("tunix", 32)
  if "hf" in result["tok_s"]:
    result["ratio_vs_hf_bs32"] = result["ratio_vs_hf"].get("float32_bs32")
    result["ratio_vs_hf_bs32_best_dtype"] = best_dtype("ours", 32) / best_dtype("hf", 32)
  result["compile_s"]["ours_max"] = max(result["compile_s"]["ours"].values())
  print(json.dumps(result))


if __name__ == "__main__":
  main()
