"""A GRPO rollout's `generate` with the layers as a list, stacked, or stacked and sliced first.

  .venv/bin/python benchmarks/rollout_layout.py
  .venv/bin/python benchmarks/rollout_layout.py --prompts 8 --group 8 --new-tokens 48

SmolLM2-135M-Instruct's weights in float32; `--prompts` random prompts of
`--prompt-tokens` tokens, `--group` samples each at temperature 0.8, exactly
`--new-tokens` new tokens (no stop tokens), as the learning race's rollout
samples them. Three cases, interleaved round by round because these machines
drift, best of `--rounds` after one warm-up call each:

  list                the per-layer list layout (the CPU default)
  stacked             `transformer.stack_layers` (`config.layout="stacked"`); the
                      sampler slices it once per call (`lm.loop_params`)
  stacked, sliced     the stacked params sliced eagerly before the call, then
                      the list layout's program (the slice's time included)

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import cpu_info


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--prompt-tokens", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=48)
  p.add_argument("--rounds", type=int, default=4)
  args = p.parse_args()
  if min(args.prompts, args.group, args.prompt_tokens, args.new_tokens, args.rounds) < 1:
    p.error("every count must be >= 1")

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxrl_agents.models import transformer, zoo
  from jaxrl_agents.rollout import sampler as sampler_lib

  model = zoo.load("smollm2-135m-instruct")
  cfg, listed = model.cfg, model.params
  stacked = jax.block_until_ready(transformer.stack_layers(listed))
  tokens = jnp.asarray(np.random.RandomState(0).randint(
      100, 20000, (args.prompts, args.prompt_tokens)), jnp.int32)
  mask = jnp.ones(tokens.shape, bool)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.8,
                                        stop_tokens=(), pad_id=0)

  def rollout(params):
    out = sampler_lib.generate(params, cfg, tokens, mask, jax.random.key(0), sampling,
                               samples_per_prompt=args.group)
    return jax.block_until_ready(out.tokens)

  cases = {
      "list": lambda: rollout(listed),
      "stacked": lambda: rollout(stacked),
      "stacked, sliced": lambda: rollout(transformer.unstack_layers(stacked)),
  }
  first, best = {}, {name: float("inf") for name in cases}
  for name, call in cases.items():
    t0 = time.perf_counter()
    call()
    first[name] = time.perf_counter() - t0
  for _ in range(args.rounds):
    for name, call in cases.items():
      t0 = time.perf_counter()
      call()
      best[name] = min(best[name], time.perf_counter() - t0)
  for name in cases:
    print(f"{name:16s} first call {first[name]:6.2f} s   best {best[name]:6.3f} s   "
          f"/ list {best[name] / best['list']:.2f}")
  print(json.dumps({
      "machine": cpu_info.describe(), "shape": vars(args),
      "first_call_s": {k: round(v, 2) for k, v in first.items()},
      "best_s": {k: round(v, 3) for k, v in best.items()},
      "ratio_to_list": {k: round(v / best["list"], 3) for k, v in best.items()},
  }))


if __name__ == "__main__":
  main()
