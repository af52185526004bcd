"""The main job's step time with the rollout overlapped with the update, against without.

  .venv/bin/python benchmarks/overlap.py                 # 20 steps a side, ~8 minutes
  .venv/bin/python benchmarks/overlap.py --steps 30

Runs experiments/configs/grpo_arithmetic.py (SmolLM2-135M-Instruct, 4 prompts x
8, at most 32 new tokens, float32) for --steps steps twice from the same seed,
one after the other: `overlap=False`, then `overlap=True` (step t+1's rollout
sampled during step t's update; jaxrl_agents/train/overlap.py). Evaluation is off
and the persistent compilation cache is shared, so both sides compile about
the same (the second side's cache hits are not free on XLA:CPU). Reported per
side: the median step time over steps 3 to --steps (the first two compile),
the median rollout, update and (overlapped) rollout-wait times, and the mean
completion length (the two runs sample different tokens after step 1, so
their replies, and with them the work per step, differ a little). The last
line of output is one JSON object with the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import cpu_info

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run(workdir: str, steps: int, overlap: bool, cache: str) -> dict:
  cmd = [sys.executable, "-m", "experiments.grpo",
         f"--config={REPO}/experiments/configs/grpo_arithmetic.py", f"--workdir={workdir}",
         f"--compilation_cache={cache}", f"--config.steps={steps}", "--config.eval_every=0",
         f"--config.checkpoint_every={10 * steps}", "--config.tensorboard=False",
         f"--config.overlap={overlap}"]
  subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  from jaxrl_agents.train import metrics as metrics_lib

  train = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
           if r["kind"] == "train"][2:]

  def median(key):
    values = [r[key] for r in train if key in r]
    return statistics.median(values) if values else None

  return {"overlap": overlap, "step_s": median("step_time_s"),
          "rollout_s": median("rollout_time_s"), "update_s": median("update_time_s"),
          "rollout_wait_s": median("rollout_wait_s"),
          "response_length": statistics.mean(r["response_length"] for r in train),
          "steps_timed": len(train)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  if args.steps < 4:
    parser.error("--steps must be at least 4 (the first two steps compile)")
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "cache")
    sides = [run(os.path.join(tmp, f"overlap_{o}"), args.steps, o, cache) for o in (False, True)]
  print("| overlap | step (median) | rollout | update | waited for the rollout | reply tokens |")
  print("|---|---|---|---|---|---|")
  for s in sides:
    wait = "-" if s["rollout_wait_s"] is None else f"{s['rollout_wait_s']:.2f} s"
    print(f"| {s['overlap']} | {s['step_s']:.2f} s | {s['rollout_s']:.2f} s | "
          f"{s['update_s']:.2f} s | {wait} | {s['response_length']:.1f} |")
  print(json.dumps({"cpu": cpu_info.describe(), "steps": args.steps, "off": sides[0],
                    "on": sides[1], "speedup": sides[0]["step_s"] / sides[1]["step_s"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
