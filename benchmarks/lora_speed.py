r"""What LoRA costs in time: merging the adapters, a rollout and a training pass.

  .venv/bin/python benchmarks/lora_speed.py [--rank 16 --rows 32 --new-tokens 32]

On SmolLM2-135M's shapes with random weights (speed does not depend on the values),
per-layer list layout (the CPU default), float32:

  merge     the adapters merged into every targeted weight once (`lora.merge`, jitted):
            what a rollout pays before its decoding loop (`LoraLM.loop_params`)
  rollout   `sampler.generate` of `--rows` rows x `--new-tokens` greedy tokens after a
            32-token prompt, without adapters and with them (merged once inside the jit)
  grad      the gradient of the summed log-probs of those rows (`scoring.policy_logprobs`):
            full fine-tuning's (every weight) against LoRA's (adapters only, merged in
            each layer)

Each is compiled first (compile seconds reported apart), then timed `--repeats` times;
the median is reported. Prints a Markdown table, then one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import cpu_info
from jaxrl_agents import types
from jaxrl_agents.models import lora, transformer
from jaxrl_agents.rollout import sampler, sampling, scoring

SMOLLM2 = transformer.TransformerConfig(  # SmolLM2-135M's config.json
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
    ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True, max_seq_len=8192)


def timed(fn, *args, repeats: int) -> tuple[float, float]:
  """(compile seconds, median seconds of a call) of jit(fn) on args."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--rows", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  cfg = SMOLLM2
  params = jax.jit(cfg.init)(jax.random.key(0))
  spec = lora.LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
  adapters = jax.jit(lambda p: lora.init(jax.random.key(1), p, spec))(params)
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # trained-looking: B nonzero
  full = {"base": params, "lora": adapters}
  model = lora.LoraLM(cfg, spec)

  prompts = jax.random.randint(jax.random.key(2), (args.rows, 32), 3, cfg.vocab_size)
  mask = jnp.ones(prompts.shape, bool)
  sc = sampling.SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0, stop_tokens=())
  rollout = lambda c: lambda p: sampler.generate(p, c, prompts, mask, jax.random.key(3), sc)

  out = sampler.generate(params, cfg, prompts, mask, jax.random.key(3), sc)
  traj = types.single_turn(prompts, mask, out.tokens, jnp.ones(out.tokens.shape, bool),
                           jnp.zeros(out.tokens.shape, jnp.float32))

  def summed(c):
    return lambda p: jnp.sum(scoring.policy_logprobs(p, c, traj, group_size=1)[0])

  rows = {
      "merge": timed(lambda p, a: lora.merge(p, a, spec), params, adapters,
                     repeats=args.repeats),
      "rollout_base": timed(rollout(cfg), params, repeats=args.repeats),
      "rollout_lora": timed(rollout(model), full, repeats=args.repeats),
      "grad_full": timed(jax.grad(summed(cfg)), params, repeats=args.repeats),
      "grad_lora": timed(lambda p, a: jax.grad(lambda x: summed(model)({"base": p,
                                                                        "lora": x}))(a),
                         params, adapters, repeats=args.repeats),
  }
  print("| what | compile (s) | median (s) |")
  print("|---|---|---|")
  for name, (c, s) in rows.items():
    print(f"| {name} | {c:.1f} | {s:.3f} |")
  result = {"rank": args.rank, "rows": args.rows, "new_tokens": args.new_tokens,
            "cpu": cpu_info.describe(),
            "seconds": {k: round(v[1], 4) for k, v in rows.items()},
            "compile_s": {k: round(v[0], 1) for k, v in rows.items()},
            "rollout_lora_over_base": round(rows["rollout_lora"][1] / rows["rollout_base"][1], 3),
            "grad_lora_over_full": round(rows["grad_lora"][1] / rows["grad_full"][1], 3)}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
