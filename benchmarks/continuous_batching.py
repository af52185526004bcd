r"""Decode throughput of continuous batching against a static batch, on long-tailed lengths.

  .venv/bin/python benchmarks/continuous_batching.py                    # this CPU's size
  .venv/bin/python benchmarks/continuous_batching.py --mean 256 --cap 2048 --sequences 128
                                                                        # the accelerator mix

The embedded SmolLM2-135M-Instruct decodes `--sequences` chat-templated arithmetic
questions greedily, `--batch` rows at a time, stop tokens disabled. Sequence i must
produce L_i tokens, L_i drawn from a geometric distribution of mean `--mean`, capped at
`--cap` (reply lengths of RL rollouts are long-tailed like this):

  static      `sampler.generate`, the queue in batches of `--batch` rows, each batch
              decoding until its longest L_i (`max_steps`), the tokens after each L_i
              discarded: what a static batch costs.
  continuous  `rollout/continuous.generate` with `--batch` slots and per-sequence
              budgets L_i: a slot whose sequence is done takes the next one.

Both count the useful tokens (sum of L_i) over the run's time; compile time is measured
apart (ahead-of-time compilation). It also reports the fraction of sequences whose
greedy tokens are identical under both. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from sampler import make_questions

import cpu_info
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import weights, zoo
from jaxrl_agents.rollout import continuous, shapes
from jaxrl_agents.rollout import sampler as sampler_lib


def random_model(hf_dir: str) -> zoo.Model:
  """DIR's architecture and tokenizer with random weights (the decode speed does not
  depend on their values: stop tokens are disabled)."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    cfg = weights.config_from_hf(json.load(f))
  return zoo.random_model(cfg, f"random:{hf_dir}",
                          tokenizer=tokenizer_lib.load_tokenizer(hf_dir))


def lengths(n: int, mean: float, cap: int, seed: int) -> np.ndarray:
  """n geometric lengths (support 1, 2, ...) of mean `mean`, capped at `cap`."""
  return np.minimum(np.random.default_rng(seed).geometric(1.0 / mean, n), cap).astype(np.int32)


def compiled(fn, *args, **static):
  t0 = time.perf_counter()
  out = jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile()
  return out, time.perf_counter() - t0


def measure(model, sequences: int, batch: int, mean: float, cap: int, seed: int = 0) -> dict:
  budgets = lengths(sequences, mean, cap, seed)
  ids = tokenizer_lib.encode_prompts(model.tokenizer, make_questions(sequences, seed), True, None)
  width = shapes.prompt_width(max(len(s) for s in ids))
  tokens, mask = tokenizer_lib.pad_left(ids, model.tokenizer.pad_token_id, width)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=int(budgets.max()), stop_tokens=(),
                                        pad_id=model.tokenizer.pad_token_id)
  params, cfg = model.params, model.cfg

  static_fn, static_compile_s = compiled(
      lambda p, t, m, steps: sampler_lib.generate(p, cfg, t, m, jax.random.key(0), sampling,
                                                  max_steps=steps),
      params, tokens[:batch], mask[:batch], jnp.int32(1))
  t0 = time.perf_counter()
  static_tokens = []
  for start in range(0, sequences, batch):
    rows = slice(start, start + batch)
    out = static_fn(params, tokens[rows], mask[rows], jnp.int32(budgets[rows].max()))
    static_tokens.append(np.asarray(out.tokens))
  static_s = time.perf_counter() - t0
  static_tokens = np.concatenate(static_tokens)

  keys = jax.random.split(jax.random.key(0), sequences)
  budget_array = jnp.asarray(budgets)
  cont_fn, cont_compile_s = compiled(
      lambda p, t, m, k, b: continuous.generate(p, cfg, t, m, k, sampling, slots=batch,
                                                max_new_tokens=b),
      params, tokens, mask, keys, budget_array)
  t0 = time.perf_counter()
  out = cont_fn(params, tokens, mask, keys, budget_array)
  cont_tokens = np.asarray(out.tokens)
  cont_s = time.perf_counter() - t0
  assert np.asarray(out.lengths).tolist() == budgets.tolist(), (np.asarray(out.lengths), budgets)

  same = [static_tokens[i, :n].tolist() == cont_tokens[i, :n].tolist()
          for i, n in enumerate(budgets)]
  useful = int(budgets.sum())
  static_steps = int(sum(budgets[s:s + batch].max() for s in range(0, sequences, batch)))
  return {
      "sequences": sequences, "batch": batch, "mean": mean, "cap": cap,
      "prompt_width": width, "useful_tokens": useful,
      "length_mean": float(budgets.mean()), "length_max": int(budgets.max()),
      "static_decode_steps": static_steps,
      "decode_tok_s": {"static": useful / static_s, "continuous": useful / cont_s},
      "seconds": {"static": static_s, "continuous": cont_s},
      "compile_s": {"static": static_compile_s, "continuous": cont_compile_s},
      "continuous_over_static": static_s / cont_s,
      "greedy_identical": sum(same) / len(same)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sequences", type=int, default=128)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--mean", type=float, default=64)
  p.add_argument("--cap", type=int, default=512)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32", help="compute dtype")
  p.add_argument("--random-weights", metavar="DIR",
                 help="a Hugging Face directory's config.json and tokenizer, weights drawn at "
                      "random (same shapes; for a machine the weights cannot be sent to)")
  args = p.parse_args()
  model = random_model(args.random_weights) if args.random_weights else zoo.load(
      zoo.DEFAULT_MODEL)
  model.cfg = model.cfg.replace(dtype=args.dtype)
  r = measure(model, args.sequences, args.batch, args.mean, args.cap, args.seed)
  r.update(model=model.name, dtype=model.cfg.dtype, backend=jax.default_backend(),
           host=cpu_info.describe())
  print(f"{args.sequences} sequences, batch {args.batch}, lengths geometric mean {args.mean} "
        f"cap {args.cap} (mean {r['length_mean']:.0f}, max {r['length_max']}): "
        f"static {r['decode_tok_s']['static']:.1f} tok/s ({r['seconds']['static']:.1f} s), "
        f"continuous {r['decode_tok_s']['continuous']:.1f} tok/s "
        f"({r['seconds']['continuous']:.1f} s): x{r['continuous_over_static']:.2f}; "
        f"greedy identical {r['greedy_identical']:.3f}", flush=True)
  print(json.dumps(r))


if __name__ == "__main__":
  main()
