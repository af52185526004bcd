"""Sampler throughput: this project vs transformers and tunix, on SmolLM2-135M-Instruct.

  .venv/bin/python benchmarks/sampler.py            # all systems (sets up tunix's venv)
  .venv/bin/python benchmarks/sampler.py --skip-tunix --batch-sizes 1,8

Greedy decoding of 64 new tokens (stop tokens disabled so every system
generates exactly 64) for batches of chat-templated arithmetic questions of
about 45 tokens, in float32 and bfloat16. Each figure is the best of 3 timed
calls after a warm-up call; compile time is the warm-up's excess over the best
call. The systems are interleaved: each round times every system once, so a
machine whose speed drifts over minutes slows all of them alike. Side by side,
in the same run: transformers' `generate` (torch CPU, same weights), tunix's
`Sampler` (its llama3 model given SmolLM2's shapes and weights, in
benchmarks/.venv-tunix, timed through a worker process), and the machine's own limits (memory read
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

import cpu_info
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import shapes

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TOKENS = 64


def make_questions(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  ops = [("+", "plus"), ("-", "minus"), ("*", "times")]
  out = []
  for _ in range(n):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    sym, word = rng.choice(ops)
    out.append(f"What is {a} {sym} {b}? Compute {a} {word} {b} step by step and give the result.")
  return out


def timed(fn):
  """Returns a function that calls fn and returns the seconds it took."""
  def run():
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
  return run


def best_of(fn, repeats: int) -> tuple[float, float]:
  """(first call seconds, best of `repeats` later calls)."""
  first = timed(fn)()
  return first, min(timed(fn)() for _ in range(repeats))


def ours_runner(model, ids, dtype, bs, shared_prefix=True):
  """The prompts as `Sampler` passes them: the batch's common prefix (the chat
  template's system prompt) prefilled once, the rest left-padded to a bucket."""
  sampling = sampler_lib.SamplingConfig(max_new_tokens=NEW_TOKENS, stop_tokens=(),
                                        pad_id=model.tokenizer.pad_token_id)
  cfg = model.cfg.replace(dtype=dtype, param_dtype=dtype)
  # Cast, and laid out for `bs` rows, once outside the timing, as `Sampler` does.
  params = model.cfg.decoding_params(transformer.cast_params(model.params, dtype), bs)
  prefix, rest = [], ids[:bs]
  if shared_prefix:
    prefix, rest = sampler_lib.split_shared_prefix(rest)
  length = shapes.power_of_two(max(len(s) for s in rest))
  tokens, mask = tokenizer_lib.pad_left(rest, model.tokenizer.pad_token_id, length)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  prefix = jnp.asarray(prefix, jnp.int32) if prefix else None

  def run():
    out = sampler_lib.generate(params, cfg, tokens, mask, jax.random.key(0), sampling,
                               prefix_tokens=prefix)
    jax.block_until_ready(out)
  return timed(run)


def hf_runner(hf_model, ids, pad_id, bs, device="cpu"):
  import torch

  tokens, mask = tokenizer_lib.pad_left(ids[:bs], pad_id)
  tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
  mask_t = torch.tensor(mask, dtype=torch.long, device=device)

  def run():
    with torch.no_grad():
      out = hf_model.generate(tokens_t, attention_mask=mask_t, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad_id)
    out = out.cpu()  # on a GPU: waits for the last kernel, inside the timing
    assert out.shape[1] == tokens_t.shape[1] + NEW_TOKENS
  return timed(run)


def load_hf(hf_dir, dtype):
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(len(os.sched_getaffinity(0)))  # the CPUs this process may use
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
  return model.eval()


class WorkerProcess:
  """A benchmark worker script in its own process, run by `python`, that answers each
  stdin line with one JSON line on stdout.

  A baseline in its own process brings its own libraries (tunix's JAX, torch) and
  can be closed, freeing its memory, before the project's side is timed
  (`train_step.bench_alone` says why that matters).
  """

  def __init__(self, python: str, script: str, *args: str):
    self.name = script
    self.proc = subprocess.Popen([python, os.path.join(HERE, script), *args],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def request(self, line: str) -> dict:
    self.proc.stdin.write(line + "\n")
    self.proc.stdin.flush()
    while True:  # a library may print its own lines; the answer is the next JSON object
      answer = self.proc.stdout.readline()
      if not answer:
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}) on request {line!r}")
      if answer.startswith("{"):
        return json.loads(answer)
      print(answer, end="", file=sys.stderr)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


class TunixProcess(WorkerProcess):
  """A worker script run in tunix's own virtualenv (benchmarks/.venv-tunix, set up on
  first use)."""

  def __init__(self, script: str, *args: str):
    subprocess.run(["bash", os.path.join(HERE, "setup_tunix.sh")], check=True)
    super().__init__(os.path.join(HERE, ".venv-tunix", "bin", "python"), script, *args)


class TunixWorker(TunixProcess):
  """tunix's sampler, timing one call per request."""

  def __init__(self, hf_dir, texts):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
      json.dump(texts, f)
    super().__init__("tunix_sampler.py", "--hf-dir", hf_dir, "--prompts", f.name,
                     "--new-tokens", str(NEW_TOKENS), "--serve")

  def runner(self, dtype, bs):
    return lambda: self.request(f"{dtype} {bs}")["seconds"]


def bench_interleaved(runners: dict, repeats: int) -> dict:
  """{system: (first call s, best s)}: one warm-up call each, then `repeats` rounds.

  Each round times every system once, in turn, so a machine whose speed drifts
  over minutes (these shared machines do) slows all systems alike.
  """
  first = {name: run() for name, run in runners.items()}
  times = {name: [] for name in runners}
  for _ in range(repeats):
    for name, run in runners.items():
      times[name].append(run())
  return {name: (first[name], min(times[name])) for name in runners}


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
  p.add_argument("--no-shared-prefix", action="store_true",
                 help="prefill every prompt whole (no shared system-prompt prefix)")
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
  cpu = cpu_info.describe()
  print("machine:", json.dumps({**cpu, **{k: round(v, 1) for k, v in limits.items()}}), flush=True)
  result = {"tok_s": {}, "compile_s": {}, "machine": {**cpu, **limits},
            "prompt_tokens_mean": float(np.mean([len(i) for i in ids])),
            "ours_shared_prefix_tokens": 0 if args.no_shared_prefix else len(
                sampler_lib.split_shared_prefix(ids)[0])}
  systems = ["ours"] + ([] if args.skip_hf else ["hf"]) + ([] if args.skip_tunix else ["tunix"])
  for system in systems:
    result["tok_s"][system], result["compile_s"][system] = {}, {}
  tunix = None if args.skip_tunix else TunixWorker(hf_dir, texts)
  for dtype in dtypes:
    hf_model = None if args.skip_hf else load_hf(hf_dir, dtype)
    for bs in batch_sizes:
      runners = {"ours": ours_runner(model, ids, dtype, bs, not args.no_shared_prefix)}
      if hf_model is not None:
        runners["hf"] = hf_runner(hf_model, ids, model.tokenizer.pad_token_id, bs)
      if tunix is not None:
        runners["tunix"] = tunix.runner(dtype, bs)
      key = f"{dtype}_bs{bs}"
      for system, (first, best) in bench_interleaved(runners, args.repeats).items():
        result["tok_s"][system][key] = bs * NEW_TOKENS / best
        result["compile_s"][system][key] = max(first - best, 0.0)
        print(f"{system:6s} {dtype:8s} bs={bs:2d}: {bs * NEW_TOKENS / best:7.1f} tok/s "
              f"(best {best:.2f}s, first call {first:.1f}s)", flush=True)
    del hf_model
  if tunix is not None:
    their = tunix.request("texts")
    tunix.close()
    ours_texts = sampler_lib.Sampler(model)(questions[:len(their["patched"])],
                                            max_new_tokens=NEW_TOKENS)[0]
    for variant, their_texts in their.items():
      same = sum(a.strip() == b.strip() for a, b in zip(ours_texts, their_texts, strict=True))
      result[f"tunix_{variant}_text_agreement"] = same / len(ours_texts)
      print(f"tunix {variant}: {same}/{len(ours_texts)} greedy texts identical to ours; "
            f"first: {their_texts[0][:80]!r}", flush=True)
  result["compile_s"].pop("hf", None)  # eager torch: nothing to compile

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
  for other in ("tunix", "hf"):
    if other not in result["tok_s"]:
      continue
    for bs in (1, 32):
      result[f"ratio_vs_{other}_bs{bs}"] = result[f"ratio_vs_{other}"].get(f"float32_bs{bs}")
    if 32 in batch_sizes:  # a batch size not run has no best dtype
      result[f"ratio_vs_{other}_bs32_best_dtype"] = best_dtype("ours", 32) / best_dtype(other, 32)
  result["compile_s"]["ours_max"] = max(result["compile_s"]["ours"].values())
  print(json.dumps(result))


if __name__ == "__main__":
  main()
