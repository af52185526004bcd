"""Multi-turn rollout speed: the episode as one `lax.scan` against turns driven from Python.

  .venv/bin/python benchmarks/multiturn.py
  .venv/bin/python benchmarks/multiturn.py --models tiny --batch 64 --turns 5

For each model, B = --batch episodes of guess-the-number (numbers 1-16, at
most --turns turns of --reply-tokens tokens, temperature 1) played two ways
with the same key: `multiturn.rollout` (one jitted program, a scan over all K
turns) and `multiturn.rollout_by_turn` (one jitted program per turn, the loop
in Python, stopping when every episode has finished). Both must produce the
same episodes; the script checks it. A third way plays the same game as a host
environment (`guess_number_host`) through `rollout/host_loop.py`, the loop for
tools: replies decoded to text, environments stepped in Python threads, their
answers tokenized; it reports how many of its episodes equal the scan's token
for token (its own prompt padding changes float rounding, so a sampled token
can flip on a near-tie).
Reported: episodes/s and environment steps/s (turns played) of the best of
--repeats calls after a warm-up, compile time (the warm-up's excess) apart.
The last line of output is one JSON object.

The update's side: the loss and gradient of the policy's log-probabilities
and entropies on --update-rows of those episodes, with vocabulary logits for
the reply blocks only (the Trajectory's reply_spans, the default) and for
every column after the prompt (what scoring did before), compile apart.
--env frozen_lake plays FrozenLake (4x4 random maps), whose wide map
observations make the difference larger.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import cpu_info
from jaxrl_agents import envs
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import host_loop, multiturn, scoring
from jaxrl_agents.rollout import sampler as sampler_lib


def timed(fn, repeats: int):
  """(compile seconds: first call minus best, best seconds, the last result)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return max(0.0, first - min(times)), min(times), out


def bench_model(name: str, args) -> dict:
  model = zoo.load(name)
  tok = model.tokenizer
  env = envs.make("guess_number", tok, low=1, high=16) if args.env == "guess_number" \
      else envs.make("frozen_lake", tok)
  template = multiturn.turn_template(tok)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=args.reply_tokens, temperature=1.0,
                                        stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                        pad_id=tok.pad_token_id)
  prompts = args.batch // args.group_size
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(1), prompts))
  run_args = (model.params, model.cfg, env, template, tasks, jax.random.key(2), sampling)
  kwargs = dict(group_size=args.group_size, num_turns=args.turns)
  row = {}
  results = {}
  for way, fn in (("scan", multiturn.rollout), ("by_turn", multiturn.rollout_by_turn)):
    compile_s, best, eps = timed(lambda fn=fn: fn(*run_args, **kwargs), args.repeats)
    results[way] = eps
    steps = int(np.asarray(eps.turns).sum())
    row[way] = {"seconds": round(best, 3), "compile_s": round(compile_s, 1),
                "episodes_per_s": round(args.batch / best, 2),
                "env_steps_per_s": round(steps / best, 2), "env_steps": steps}
    print(f"{name:24s} {way:8s} {best:7.3f} s  {args.batch / best:8.2f} episodes/s  "
          f"{steps / best:8.2f} env steps/s  (compile {compile_s:.1f} s)", flush=True)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
      jax.tree.leaves(results["scan"]), jax.tree.leaves(results["by_turn"]), strict=True))
  row["same_episodes"] = same
  if args.env == "guess_number":
    row["host_loop"] = bench_host_loop(name, model, tasks, results["scan"], args)
  row["scan_over_by_turn"] = round(row["by_turn"]["seconds"] / row["scan"]["seconds"], 2)
  row["update"] = bench_update(name, model, results["scan"].traj, args)
  return row


def bench_host_loop(name: str, model, tasks, scanned, args) -> dict:
  """The same game as a host environment through `host_loop.rollout`: decode to text, step
  in Python threads, tokenize the answers; checked to play the scan's episodes."""
  tok = model.tokenizer
  env = envs.make("guess_number_host", tok, low=1, high=16)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=args.reply_tokens, temperature=1.0,
                                        stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                        pad_id=tok.pad_token_id)
  _, play_rng = jax.random.split(jax.random.key(2))  # the scan's turn keys
  jax_env = envs.make("guess_number", tok, low=1, high=16)
  compile_s, best, out = timed(lambda: host_loop.rollout(
      model.params, model.cfg, tok, env, np.asarray(tasks).tolist(), play_rng, sampling,
      group_size=args.group_size, num_turns=args.turns, obs_tokens=jax_env.obs_width,
      step_timeout_s=30.0).episodes, args.repeats)
  steps = int(np.asarray(out.turns).sum())
  a, b = scanned.traj, out.traj
  # The host loop pads prompts to its own width, so attention's float rounding differs
  # from the scan's: a sampled token can flip where two are nearly tied.
  same = sum(np.asarray(a.tokens)[i][np.asarray(a.valid)[i]].tolist() ==
             np.asarray(b.tokens)[i][np.asarray(b.valid)[i]].tolist()
             for i in range(args.batch))
  print(f"{name:24s} {'host':8s} {best:7.3f} s  {args.batch / best:8.2f} episodes/s  "
        f"{steps / best:8.2f} env steps/s  (compile {compile_s:.1f} s)", flush=True)
  return {"seconds": round(best, 3), "compile_s": round(compile_s, 1),
          "episodes_per_s": round(args.batch / best, 2),
          "env_steps_per_s": round(steps / best, 2), "env_steps": steps,
          "episodes_equal_to_scan": int(same)}


def bench_update(name: str, model, traj, args) -> dict:
  """Loss + gradient time with logits at the reply columns only against every column."""
  traj = jax.tree.map(lambda x: x[:args.update_rows], traj)

  def loss(params, traj):
    logp, entropy = scoring.policy_logprobs(params, model.cfg, traj, with_entropy=True)
    return jnp.sum(logp) + jnp.sum(jnp.where(traj.policy_mask, entropy, 0.0))

  grad = jax.jit(jax.value_and_grad(loss))
  row = {"rows": args.update_rows, "columns": int(traj.tokens.shape[1] - traj.prompt_width)}
  for way, t in (("reply_columns", traj), ("every_column", traj.replace(reply_spans=()))):
    compile_s, best, _ = timed(lambda t=t: grad(model.params, t), args.repeats)
    row[way] = {"seconds": round(best, 3), "compile_s": round(compile_s, 1),
                "scored_columns": len(scoring.scored_columns(t))}
    print(f"{name:24s} update {way:14s} {best:7.3f} s  ({len(scoring.scored_columns(t))} "
          f"columns with logits; compile {compile_s:.1f} s)", flush=True)
  row["reply_over_every"] = round(row["every_column"]["seconds"] /
                                  row["reply_columns"]["seconds"], 2)
  return row


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default="tiny,smollm2-135m-instruct")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--group-size", type=int, default=8)
  ap.add_argument("--turns", type=int, default=5)
  ap.add_argument("--reply-tokens", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--env", default="guess_number", choices=("guess_number", "frozen_lake"))
  ap.add_argument("--update-rows", type=int, default=8)
  args = ap.parse_args()
  out = {"cpu": cpu_info.describe(), "env": args.env, "batch": args.batch, "turns": args.turns,
         "reply_tokens": args.reply_tokens, "models": {}}
  for name in args.models.split(","):
    out["models"][name] = bench_model(name, args)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
