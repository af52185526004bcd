r"""XLA's compiled memory for the gradient of the policy's log-probabilities at long replies.

  .venv/bin/python benchmarks/long_scoring_memory.py --lengths 512,1024,2048,4096

For SmolLM2-135M's shapes (parameters from `jax.eval_shape`, no weights touched), 4 rows
with a 64-column prompt and replies of each length, it compiles
`jax.grad(sum(scoring.policy_logprobs(..., with_entropy=True, chunk=c)))` and reports
`compiled.memory_analysis()`'s temporaries and the compile time, for the per-layer list
layout and for the stacked layout with its scanned layer rematerialized (`remat="full"`),
each with the vocabulary logits in one piece (chunk 0: f32[B, N, V], 192 KiB a token at
V = 49152) and `--chunk` columns at a time (`scoring.hidden_logprobs`). The list layout
runs only up to `--list-up-to` (its compile grows fast: 247 s at 2,048 here). Prints one
JSON object as its last line (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import types
from jaxrl_agents.models import transformer, zoo
from jaxrl_agents.rollout import scoring

GIB = 2 ** 30


def measure(cfg, rows: int, prompt: int, length: int, chunk: int, stacked: bool) -> dict:
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0), cfg))
  if stacked:
    params = jax.eval_shape(transformer.stack_layers, params)
    cfg = cfg.replace(remat="full")
  traj = types.single_turn(np.ones((rows, prompt), np.int32), np.ones((rows, prompt), bool),
                           np.ones((rows, length), np.int32), np.ones((rows, length), bool),
                           np.zeros((rows, length), np.float32))

  def loss(p):
    logp, entropy = scoring.policy_logprobs(p, cfg, traj, with_entropy=True, chunk=chunk)
    return jnp.sum(logp) + jnp.sum(entropy)

  t0 = time.perf_counter()
  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  seconds = time.perf_counter() - t0
  memory = compiled.memory_analysis()
  return {"length": length, "chunk": chunk, "layout": "stacked, remat full" if stacked
          else "list", "compile_s": round(seconds, 1),
          "temp_gib": round(memory.temp_size_in_bytes / GIB, 3),
          "argument_gib": round(memory.argument_size_in_bytes / GIB, 3),
          "output_gib": round(memory.output_size_in_bytes / GIB, 3)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", default="512,1024,2048,4096")
  p.add_argument("--list-up-to", type=int, default=1024)
  p.add_argument("--chunk", type=int, default=128)
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--prompt", type=int, default=64)
  args = p.parse_args()
  cfg = zoo.load("smollm2-135m-instruct").cfg
  results = []
  for length in map(int, args.lengths.split(",")):
    for stacked in (False, True):
      if not stacked and length > args.list_up_to:
        continue
      for chunk in (0, args.chunk):
        r = measure(cfg, args.rows, args.prompt, length, chunk, stacked)
        print(f"reply {length:5d}  {r['layout']:18s}  chunk {chunk:4d}  temporaries "
              f"{r['temp_gib']:7.3f} GiB  (compile {r['compile_s']:.1f} s)", flush=True)
        results.append(r)
  print(json.dumps({"model": "smollm2-135m-instruct", "rows": args.rows,
                    "prompt": args.prompt, "vocab": cfg.vocab_size, "results": results}))


if __name__ == "__main__":
  main()
