"""The main job with LoRA adapters against full fine-tuning: held-out accuracy, time, memory.

  .venv/bin/python benchmarks/lora_learning.py --out runs/lora_learning
  .venv/bin/python benchmarks/lora_learning.py --variants full lora_2e-4 --seeds 0 1 2
  .venv/bin/python benchmarks/lora_learning.py --out runs/lora_learning --summarize

Each variant is experiments/configs/grpo_arithmetic.py (the main job, 50 steps) with the
overrides in VARIANTS, run into OUT/<variant>_s<seed>, one run at a time (each run's
time and memory are its own). A run that already reached its final evaluation is not
run again, so an interrupted sweep continues where it stopped.

Reports per run: held-out accuracy (100 test questions, greedy, strict grader) at steps
0, 25 and 50, the training time (`train_time_s` at the last evaluation: rollouts and
updates, without evaluations and startup), the median step, the process's peak resident
memory (`ru_maxrss` of the run's own process, written to OUT/<run>/peak_rss.json) and
its wall time. Prints a Markdown table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import cpu_info

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(REPO, "experiments", "configs", "grpo_arithmetic.py")

LORA = {"lora.rank": 16, "lora.alpha": 32.0}
# name -> config overrides of the main job.
VARIANTS: dict[str, dict[str, object]] = {
    "full": {},
    "lora_1e-4": {**LORA, "optimizer.learning_rate": 1e-4},
    "lora_2e-4": {**LORA, "optimizer.learning_rate": 2e-4},
    "lora_3e-4": {**LORA, "optimizer.learning_rate": 3e-4},
    "lora_1e-3": {**LORA, "optimizer.learning_rate": 1e-3},
}


def _finished(workdir: str) -> bool:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return any(json.loads(line).get("kind") == "eval" and json.loads(line)["step"] >= 50
               for line in f if line.strip())


def run(variant: str, seed: int, out: str) -> None:
  """Runs one variant and seed into OUT/<variant>_s<seed>; writes its peak memory."""
  workdir = os.path.join(out, f"{variant}_s{seed}")
  if _finished(workdir):
    return
  command = [sys.executable, "-m", "experiments.grpo", f"--config={CONFIG}",
             f"--workdir={workdir}", f"--config.seed={seed}"]
  command += [f"--config.{k}={v}" for k, v in VARIANTS[variant].items()]
  os.makedirs(workdir, exist_ok=True)
  start = time.perf_counter()
  with open(os.path.join(out, f"{variant}_s{seed}.log"), "w") as log:
    proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"{variant} seed {seed} failed; see {log.name}")
  with open(os.path.join(workdir, "peak_rss.json"), "w") as f:
    json.dump({"peak_rss_bytes": usage.ru_maxrss * 1024,
               "wall_s": round(time.perf_counter() - start, 1)}, f)


def summarize(workdir: str) -> dict:
  """The figures of one finished run."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  evals = {r["step"]: r for r in records if r["kind"] == "eval"}
  steps = [r["step_time_s"] for r in records if r["kind"] == "train"]
  row = {f"step_{s}": round(evals[s]["accuracy"], 2) for s in (0, 25, 50) if s in evals}
  row["train_time_s"] = round(evals[max(evals)].get("train_time_s", float("nan")))
  row["median_step_s"] = round(statistics.median(steps), 2)
  memory = os.path.join(workdir, "peak_rss.json")
  if os.path.exists(memory):
    with open(memory) as f:
      measured = json.load(f)
    row["peak_rss_gb"] = round(measured["peak_rss_bytes"] / 1e9, 2)
    row["wall_s"] = measured["wall_s"]
  return row


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="runs/lora_learning")
  p.add_argument("--variants", nargs="+", default=["full", "lora_2e-4"],
                 choices=sorted(VARIANTS))
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--summarize", action="store_true",
                 help="only summarize the finished runs under --out")
  args = p.parse_args()
  if not args.summarize:
    for variant in args.variants:
      for seed in args.seeds:
        run(variant, seed, args.out)
  rows = {}
  print("| variant | seed | step 0 | step 25 | step 50 | training time (s) | median step (s) "
        "| peak memory (GB) | wall (s) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for variant in args.variants:
    for seed in args.seeds:
      workdir = os.path.join(args.out, f"{variant}_s{seed}")
      if not _finished(workdir):
        continue
      r = rows[f"{variant}_s{seed}"] = summarize(workdir)
      print(f"| {variant} | {seed} | {r.get('step_0')} | {r.get('step_25')} | "
            f"{r.get('step_50')} | {r['train_time_s']} | {r['median_step_s']} | "
            f"{r.get('peak_rss_gb', '')} | {r.get('wall_s', '')} |")
  print(json.dumps({"cpu": cpu_info.describe(), "variants": {v: VARIANTS[v] for v in
                                                               args.variants},
                    "runs": rows}))


if __name__ == "__main__":
  main()
