"""Cost of one GRPO step's two halves, with and without sharing each group's prompt.

  .venv/bin/python benchmarks/grpo_step.py
  .venv/bin/python benchmarks/grpo_step.py --prompts 4 --group-size 8 --widths 16,48
  .venv/bin/python benchmarks/grpo_step.py --dtype bfloat16 --modes shared_prompt,packed

On SmolLM2-135M-Instruct in float32 (or bf16 compute, `--dtype`), for P
chat-templated arithmetic questions x G completions (the race's shapes by default):

- rollout: `sampler.generate` at temperature 1.0 with one prefill per prompt
  (`samples_per_prompt=G`) against the same prompts repeated G times; both
  draw the same tokens from the same key, so the work compared is identical.
- update: the GRPO experiment's jitted update (loss, gradient, AdamW) on a
  batch with completions of each width in --widths (lengths drawn uniformly up
  to it), in each of UPDATE_MODES: `share_prompt` off (each prompt once per
  row) and on (once per group), and packed replies (`pack_replies`: only the
  reply tokens, in the slots a run's later update of that batch gets).

Each figure is the best of --repeats timed calls after a warm-up call; compile
time is the warm-up's excess over the best call. The last line of output is
one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import grpo
from experiments.configs import grpo_race
from jaxrl_agents import data as data_lib
from jaxrl_agents import types
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import scoring, single_turn

# The update's modes: a row per completion with its prompt; each group's prompt once
# (share_prompt); and only the reply tokens, packed into one stream (pack_replies).
UPDATE_MODES = ("per_row", "shared_prompt", "packed")


def best_of(fn, repeats: int) -> tuple[float, float]:
  """(compile seconds: first call minus best, best of `repeats` later calls)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return max(0.0, first - min(times)), min(times)


def time_rollouts(model, tokens, mask, sampling, g: int, key, repeats: int) -> dict:
  """The rollout with each prompt repeated G times against one prefill per prompt."""
  rollout = {}
  for name, (t, m, spp) in {
      "repeated_prompts": (np.repeat(tokens, g, 0), np.repeat(mask, g, 0), 1),
      "shared_prefill": (tokens, mask, g)}.items():
    t, m = jnp.asarray(t), jnp.asarray(m)
    compile_s, best = best_of(lambda t=t, m=m, spp=spp: sampler_lib.generate(
        model.params, model.cfg, t, m, key, sampling, samples_per_prompt=spp).tokens,
        repeats)
    rollout[name] = {"seconds": round(best, 3), "compile_s": round(compile_s, 1)}
    print(f"rollout {name:17s} {best:6.2f} s   (compile {compile_s:.1f} s)", flush=True)
  rollout["speedup"] = round(rollout["repeated_prompts"]["seconds"]
                             / rollout["shared_prefill"]["seconds"], 2)
  return rollout


def update_batch(tokens, mask, g: int, width: int, rng: np.random.Generator) -> grpo.GRPOBatch:
  """A GRPO batch of the prompts' groups with completions of lengths drawn up to `width`."""
  rows = tokens.shape[0] * g
  lengths = rng.integers(1, width + 1, size=rows)
  completion_mask = np.arange(width)[None, :] < lengths[:, None]
  completion = np.where(completion_mask, rng.integers(100, 1000, size=(rows, width)), 0)
  traj = types.single_turn(
      jnp.repeat(jnp.asarray(tokens), g, 0), jnp.repeat(jnp.asarray(mask), g, 0),
      jnp.asarray(completion, jnp.int32), jnp.asarray(completion_mask),
      jnp.zeros(completion.shape))
  zeros = jnp.zeros(traj.tokens.shape, jnp.float32)
  return grpo.GRPOBatch(traj=traj, advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
                        old_logp=zeros, ref_logp=zeros, correct=jnp.zeros(rows))


def time_update(model, config, batch: grpo.GRPOBatch, mode: str, key, repeats: int) -> dict:
  """{seconds, compile_s[, slots]} of the GRPO experiment's update of `batch` in `mode`."""
  config.share_prompt = mode != "per_row"
  config.pack_replies = mode == "packed"
  algorithm = grpo.GRPO(config, model.cfg)
  if mode == "packed":  # the slots a run's later update of this batch gets
    slots = scoring.packed_slots(batch.traj, rows=batch.advantages.shape[0],
                                 group_size=config.group_size)
    batch = batch._replace(packed_slots=jnp.zeros((slots,), bool))
  state = [algorithm.init_state(jax.tree.map(jnp.copy, model.params), key)]

  def step():
    state[0], metrics = algorithm.update(state[0], batch, key, progress=0.0)
    return metrics["loss"]

  compile_s, best = best_of(step, repeats)
  result = {"seconds": round(best, 3), "compile_s": round(compile_s, 1)}
  if batch.packed_slots is not None:
    result["slots"] = int(batch.packed_slots.shape[0])
  return result


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--group-size", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=48)
  ap.add_argument("--widths", default="16,48", help="completion widths of the update batch")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="compute dtype (float32 parameters either way)")
  ap.add_argument("--modes", default=",".join(UPDATE_MODES),
                  help=f"update modes to time, of {','.join(UPDATE_MODES)}")
  args = ap.parse_args()
  modes = args.modes.split(",")
  if not set(modes) <= set(UPDATE_MODES) or "shared_prompt" not in modes:
    ap.error(f"--modes {args.modes}: a comma-separated subset of {UPDATE_MODES} with "
             "shared_prompt (the speed-ups are against it)")
  p, g = args.prompts, args.group_size
  widths = [int(w) for w in args.widths.split(",")]
  if max(widths) > args.max_new_tokens:
    ap.error(f"--widths {args.widths} must be at most --max-new-tokens {args.max_new_tokens}")

  model = zoo.load("smollm2-135m-instruct")
  model = dataclasses.replace(model, cfg=model.cfg.replace(dtype=args.dtype))
  config = grpo_race.get_config()
  config.prompts_per_step, config.group_size = p, g
  # One program timed at a time: nothing compiles ahead in the background meanwhile.
  config.pack_compile_ahead = 0
  source = data_lib.load_task("arithmetic/mixed", "train")
  examples = [source[i] for i in range(p)]
  prompts = single_turn.format_prompts(examples, config.prompt_template)
  tokens, mask, _ = single_turn.encode(model.tokenizer, prompts, chat=True, system=None)
  stop = tokenizer_lib.stop_token_ids(model.tokenizer)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                        stop_tokens=stop, pad_id=model.tokenizer.pad_token_id)
  print(f"{p} prompts x {g} completions, prompt width {tokens.shape[1]}, "
        f"at most {args.max_new_tokens} new tokens", flush=True)

  key = jax.random.key(0)
  results = {"prompts": p, "group_size": g, "prompt_width": int(tokens.shape[1]),
             "dtype": args.dtype,
             "rollout": time_rollouts(model, tokens, mask, sampling, g, key, args.repeats)}
  rng = np.random.default_rng(0)
  update = {}
  for width in widths:
    batch = update_batch(tokens, mask, g, width, rng)
    row = {}
    for mode in modes:
      row[mode] = time_update(model, config, batch, mode, key, args.repeats)
      print(f"update width {width:3d} {mode:14s} {row[mode]['seconds']:6.2f} s   "
            f"(compile {row[mode]['compile_s']:.1f} s)", flush=True)
    if "per_row" in row:
      row["speedup"] = round(row["per_row"]["seconds"] / row["shared_prompt"]["seconds"], 2)
    if "packed" in row:
      row["packed_speedup"] = round(row["shared_prompt"]["seconds"] / row["packed"]["seconds"],
                                    2)
    update[str(width)] = row
  results["update"] = update
  print(json.dumps(results))


if __name__ == "__main__":
  main()
