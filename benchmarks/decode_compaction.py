"""A GRPO rollout with and without decode compaction (`SamplingConfig.compact_min_rows`).

  .venv/bin/python benchmarks/decode_compaction.py
  .venv/bin/python benchmarks/decode_compaction.py --workdir runs/learning_race/ours

The learning race's rollout (experiments/configs/grpo_race.py: `--prompts`
arithmetic/mixed training questions x `--group` samples at temperature 0.8, at
most 48 new tokens, the chat template) by the embedded SmolLM2-135M-Instruct,
or by the latest policy a run's `--workdir` checkpointed (a trained policy's
replies are short, with a long one now and then: where compaction pays).
For each of `--batches` question batches, the same key samples the batch once
without compaction and once with it (interleaved, as these machines drift),
after one untimed call each that compiles. Reported: each setting's compile
call, the median and total rollout time, the speedup, the reply lengths, and
whether the replies are the same (they should be, up to float rounding of the
log-probabilities).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import cpu_info


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="", help="a run whose latest policy samples "
                 "(default: the embedded model)")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--batches", type=int, default=6)
  p.add_argument("--min-rows", type=int, default=8, help="compact_min_rows when on (>= 2)")
  args = p.parse_args()
  if min(args.prompts, args.group, args.batches) < 1 or args.min_rows < 2:
    p.error("every count must be >= 1, --min-rows >= 2")

  import jax
  import numpy as np

  from experiments.configs import grpo_race
  from jaxrl_agents.data import tasks
  from jaxrl_agents.models import zoo
  from jaxrl_agents.rollout import single_turn
  from jaxrl_agents.train import checkpointing

  machine = cpu_info.describe()
  print(f"CPU: {machine}", flush=True)
  config = grpo_race.get_config()
  model = zoo.load(zoo.DEFAULT_MODEL)
  params, source = model.params, "embedded model"
  if args.workdir:
    params, _, step = checkpointing.latest_policy_params(args.workdir)
    source = f"{args.workdir} step {step}"
  print(f"policy: {source}", flush=True)
  questions = tasks.load_task(config.task, "train")
  race = single_turn.sampling_from_config(config, model.tokenizer)  # the race config compacts
  off = dataclasses.replace(race, compact_min_rows=0)
  on = dataclasses.replace(race, compact_min_rows=args.min_rows)
  settings = {"whole batch": off, f"compacted to {args.min_rows}": on}

  def rollout(sampling, batch):
    examples = [questions[(batch * args.prompts + i) % len(questions)]
                for i in range(args.prompts)]
    start = time.perf_counter()
    s = single_turn.sample(params, model, examples, jax.random.key(batch),
                           group_size=args.group, sampling=sampling,
                           template=config.prompt_template, chat=config.chat,
                           system=config.get("system_prompt") or None)
    jax.block_until_ready(s.traj)
    return time.perf_counter() - start, s

  compile_s = {name: rollout(sampling, -1)[0] for name, sampling in settings.items()}
  times = {name: [] for name in settings}
  lengths, same_rows, rows, logp_diff = [], 0, 0, 0.0
  for batch in range(args.batches):
    samples = {}
    for name, sampling in settings.items():
      seconds, samples[name] = rollout(sampling, batch)
      times[name].append(seconds)
    whole, compacted = (samples[name].traj for name in settings)
    batch_lengths = np.asarray(whole.policy_mask).sum(1)
    lengths.append(batch_lengths)
    same = np.zeros(len(batch_lengths), bool)
    if whole.tokens.shape == compacted.tokens.shape:
      same = np.all(np.asarray(whole.tokens) == np.asarray(compacted.tokens), axis=1)
    same_rows += int(same.sum())
    rows += len(same)
    if same.any():
      logp_diff = max(logp_diff, float(np.max(np.abs(
          np.asarray(whole.sampling_logprobs)[same]
          - np.asarray(compacted.sampling_logprobs)[same]))))
    print(f"batch {batch}: lengths mean {batch_lengths.mean():.1f} max {batch_lengths.max()}  "
          + "  ".join(f"{name} {times[name][-1]:.2f} s" for name in settings), flush=True)

  names = list(settings)
  median = {name: statistics.median(times[name]) for name in names}
  total = {name: sum(times[name]) for name in names}
  all_lengths = np.concatenate(lengths)
  print("compile call: " + ", ".join(f"{n} {compile_s[n]:.1f} s" for n in names))
  print("rollout median: " + ", ".join(f"{n} {median[n]:.2f} s" for n in names)
        + f"; total speedup {total[names[0]] / total[names[1]]:.2f}x")
  print(f"identical replies: {same_rows}/{rows} rows; largest log-probability difference "
        f"{logp_diff:.2e}")
  print(json.dumps({
      "benchmark": "decode_compaction", "machine": machine, "policy": source,
      "prompts": args.prompts, "group": args.group, "batches": args.batches,
      "min_rows": args.min_rows, "compile_call_s": compile_s, "rollout_median_s": median,
      "rollout_total_s": total, "speedup": total[names[0]] / total[names[1]],
      "reply_length_mean": float(all_lengths.mean()),
      "reply_length_max": int(all_lengths.max()), "identical_rows": same_rows, "rows": rows,
      "max_logprob_difference": logp_diff}))


if __name__ == "__main__":
  main()
