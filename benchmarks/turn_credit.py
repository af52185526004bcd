"""Turn-level credit compared on one game: the same runs with each `turn_credit`, several seeds.

  .venv/bin/python benchmarks/turn_credit.py
  .venv/bin/python benchmarks/turn_credit.py --credits episode,gigpo+shaping --seeds 0,1,2

Each run is GRPO on guess-the-number with the tiny random model (numbers 1-4,
3 turns of one token; the setting of tests/test_env_loop.py's learning test):
--steps steps of 8 tasks x 16 episodes. A credit is a `turn_credit` name
("episode", "turn", "gigpo", "igpo"), with "+shaping" for potential-based shaping
from the environment's potential (minus the bits still missing). Reported per
credit over the seeds: the sampled success rate over the first and last five
steps, invalid replies per episode at the end, and the final held-out success
rate (32 fixed tasks, greedy) with its standard error over the seeds. The last
line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

import cpu_info
from experiments import grpo
from experiments.configs import grpo_guess_number
from jaxrl_agents.train import metrics as metrics_lib


def run(credit: str, seed: int, steps: int) -> dict:
  config = grpo_guess_number.get_config("tiny")
  config.seed = seed
  config.max_new_tokens, config.prompts_per_step, config.group_size = 1, 8, 16
  config.steps, config.eval_every, config.eval_size, config.eval_batch_size = steps, steps, 32, 32
  config.checkpoint_every, config.sample_every = 10_000, 0
  config.optimizer.learning_rate, config.entropy_coef = 3e-3, 0.05
  name, _, shaping = credit.partition("+")
  config.turn_credit.name = name
  config.potential_shaping = shaping == "shaping"
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    last = grpo.train(config, workdir, progress=False)
    seconds = time.perf_counter() - start
    train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
             if r["kind"] == "train"]
  mean = lambda key, rows: float(np.mean([r[key] for r in rows]))
  return {"success_first5": mean("success", train[:5]),
          "success_last5": mean("success", train[-5:]),
          "invalid_last5": mean("invalid", train[-5:]), "heldout": float(last["accuracy"]),
          "seconds": round(seconds, 1)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--credits", default="episode,turn,gigpo,gigpo+shaping,igpo")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=40)
  args = ap.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  out = {"cpu": cpu_info.describe(), "steps": args.steps, "seeds": seeds, "credits": {}}
  for credit in args.credits.split(","):
    runs = [run(credit, seed, args.steps) for seed in seeds]
    heldout = [r["heldout"] for r in runs]
    row = {k: round(float(np.mean([r[k] for r in runs])), 3) for k in runs[0]}
    row["heldout_se"] = round(float(np.std(heldout, ddof=1) / np.sqrt(len(heldout))), 3) \
        if len(heldout) > 1 else None
    row["runs"] = runs
    out["credits"][credit] = row
    print(f"{credit:16s} success {row['success_first5']:.3f} -> {row['success_last5']:.3f}  "
          f"invalid {row['invalid_last5']:.2f}  held-out {row['heldout']:.3f} "
          f"(se {row['heldout_se']})  {row['seconds']:.0f} s per run", flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
