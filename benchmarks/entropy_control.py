"""Entropy and exploration controls compared on the main job (GRPO on arithmetic, 50 steps).

  .venv/bin/python benchmarks/entropy_control.py --out runs/entropy_control
  .venv/bin/python benchmarks/entropy_control.py --variants baseline lr_cosine --seeds 0 1 2
  .venv/bin/python benchmarks/entropy_control.py --out runs/entropy_control --summarize

Each variant is experiments/configs/grpo_arithmetic.py with a few overrides
(VARIANTS below), run for its 50 steps into OUT/<variant>_s<seed>. A run that
already reached its final evaluation is not run again, and one that stopped
part way resumes from its last checkpoint, so an interrupted sweep continues
where it stopped. Runs go one after the other (`--parallel 2` runs two at a
time; on 2 cores that only pays where one run leaves a core idle).

Reports, per run: held-out accuracy (100 test questions, greedy, strict grader)
at steps 0, 25 and 50, the policy entropy (nats per token, mean over steps
1-5, 21-25 and 46-50) and the fraction of groups without reward variance over
the last 25 steps. Writes OUT/entropy_control.png (entropy against step, and
held-out accuracy at each evaluation) and OUT/entropy_control.json; prints a
Markdown table and, as its last line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import cpu_info

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(REPO, "experiments", "configs", "grpo_arithmetic.py")

# Every variant starts from the main job as it was before this comparison chose its
# controls: clip-higher (eps_high 0.28, DAPO), no token control, a constant learning
# rate, no KL, no entropy bonus.
BEFORE = {"token_control.name": "none", "token_control.frac": 0.0, "optimizer.decay": "constant"}

# name -> (config overrides on top of BEFORE, what it is).
VARIANTS: dict[str, tuple[dict[str, object], str]] = {
    "baseline": ({}, "the main job before this comparison"),
    "lr_cosine": ({"optimizer.decay": "cosine"},
                  "learning rate 2e-5 decayed to 0 over the 50 updates (cosine)"),
    "entropy_gate": ({"token_control.name": "entropy_gate", "token_control.frac": 0.2},
                     "gradient only through the 20% highest-entropy tokens (80/20 rule)"),
    "cov_clip": ({"token_control.name": "covariance_clip", "token_control.frac": 0.02},
                 "no gradient through the 2% of tokens with the largest "
                 "log-prob/advantage covariance (KL-Cov/Clip-Cov)"),
    "gate_cosine": ({"token_control.name": "entropy_gate", "token_control.frac": 0.2,
                     "optimizer.decay": "cosine"}, "entropy_gate and lr_cosine together"),
    "cov_cosine": ({"token_control.name": "covariance_clip", "token_control.frac": 0.02,
                    "optimizer.decay": "cosine"}, "cov_clip and lr_cosine together"),
    "entropy_bonus": ({"entropy_coef": 0.005}, "entropy bonus 0.005"),
    "temperature_1": ({"temperature": 1.0}, "sampling temperature 1.0 instead of 0.8"),
    "kl_accuracy": ({"kl_coef": 0.05, "kl_controller.name": "accuracy"},
                    "k3 KL to the initial policy, beta = 0.05 x accuracy^2"),
    "oversample": ({"oversample": 2},
                   "8 groups sampled, the 4 whose rewards vary trained on (DAPO's dynamic "
                   "sampling)"),
    "overlap": ({"overlap": True}, "rollout overlapped with the update (one step stale)"),
    "overlap_tis": ({"overlap": True, "off_policy.correction": "tis"},
                    "overlapped, truncated importance sampling (cap 2)"),
}

# The variant whose settings the main job now uses: drawn in black.
MAIN_JOB = "gate_cosine"

STEPS = 50
MIDPOINT = 25
WINDOW = 5


def run_dir(out: str, variant: str, seed: int) -> str:
  return os.path.join(out, f"{variant}_s{seed}")


def finished(workdir: str) -> bool:
  """Whether the run's final evaluation (step STEPS) is on record."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    for line in f:
      if '"kind": "eval"' in line and json.loads(line).get("step") == STEPS:
        return True
  return False


def command(out: str, variant: str, seed: int) -> list[str]:
  overrides = {**BEFORE, **VARIANTS[variant][0]}
  cmd = [sys.executable, "-m", "experiments.grpo", f"--config={CONFIG}",
         f"--workdir={run_dir(out, variant, seed)}", f"--config.seed={seed}",
         f"--config.steps={STEPS}", f"--config.eval_every={MIDPOINT}",
         # A resume needs the newest checkpoint only. Each holds the policy and AdamW's
         # moments (about 1.5 GB for the main job), and a sweep runs a dozen jobs: with the
         # default three apiece one sweep filled 57 GB.
         "--config.keep_checkpoints=1"]
  return cmd + [f"--config.{key}={value}" for key, value in overrides.items()]


def run_all(out: str, jobs: list[tuple[str, int]], parallel: int) -> None:
  pending = [job for job in jobs if not finished(run_dir(out, *job))]
  running: list[tuple[subprocess.Popen, str, float]] = []
  while pending or running:
    while pending and len(running) < parallel:
      variant, seed = pending.pop(0)
      name = os.path.basename(run_dir(out, variant, seed))
      log = open(os.path.join(out, f"{name}.log"), "a")
      print(f"[entropy_control] {name}: {' '.join(command(out, variant, seed)[2:])}",
            flush=True)
      proc = subprocess.Popen(command(out, variant, seed), cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT)
      running.append((proc, name, time.time()))
    time.sleep(5)
    for entry in list(running):
      proc, name, start = entry
      if proc.poll() is None:
        continue
      running.remove(entry)
      status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
      print(f"[entropy_control] {name}: {status} in {(time.time() - start) / 60:.1f} min "
            f"(log: {os.path.join(out, name + '.log')})", flush=True)


def summarize_run(workdir: str) -> dict:
  from jaxrl_agents.tools import analysis

  run = analysis.load_run(workdir)
  acc = run.eval["accuracy"] if "accuracy" in run.eval else None

  def at(step):
    return float(acc.loc[step]) if acc is not None and step in acc.index else None

  def window_mean(col, last_step):
    if col not in run.train:
      return None
    rows = run.train[col].loc[last_step - WINDOW + 1:last_step]
    return float(rows.mean()) if len(rows) else None

  zero_var = None
  if "zero_variance_groups" in run.train:
    zero_var = float(run.train["zero_variance_groups"].loc[MIDPOINT + 1:STEPS].mean())
  return {"acc_start": at(0), "acc_mid": at(MIDPOINT), "acc_end": at(STEPS),
          "entropy_start": window_mean("entropy", WINDOW),
          "entropy_mid": window_mean("entropy", MIDPOINT),
          "entropy_end": window_mean("entropy", STEPS),
          "zero_variance_groups_late": zero_var,
          "train_minutes": float(run.train["step_time_s"].sum() / 60)
          if "step_time_s" in run.train else None,
          "steps": int(run.train.index.max()) if len(run.train) else 0}


def plot(out: str, runs: dict[str, str], rows: dict[str, dict]) -> str:
  """Entropy and held-out accuracy against step: a colour per variant, a line style per seed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from jaxrl_agents.tools import analysis

  fig, (ax_h, ax_a) = plt.subplots(1, 2, figsize=(14, 4.8))
  variants = list(dict.fromkeys(r["variant"] for r in rows.values()))
  styles = ("-", "--", ":", "-.")
  for name, workdir in runs.items():
    run = analysis.load_run(workdir, name)
    others = [v for v in variants if v != MAIN_JOB]
    color = "black" if rows[name]["variant"] == MAIN_JOB else \
        plt.cm.tab10(others.index(rows[name]["variant"]) % 10)
    style = styles[rows[name]["seed"] % len(styles)]
    if "entropy" in run.train:
      ax_h.plot(run.train.index, analysis.smooth(run.train["entropy"], 0.5), color=color,
                linestyle=style, label=name)
    if "accuracy" in run.eval:
      ax_a.plot(run.eval.index, run.eval["accuracy"], marker="o", color=color, linestyle=style,
                label=name)
  ax_h.set_yscale("log")
  ax_h.set_xlabel("step")
  ax_h.set_ylabel("policy entropy (nats/token, smoothed)")
  ax_a.set_xlabel("step")
  ax_a.set_ylabel("held-out accuracy (100 questions)")
  ax_a.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.suptitle("Entropy controls on the main job (GRPO, arithmetic, SmolLM2-135M)")
  fig.tight_layout()
  path = os.path.join(out, "entropy_control.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _fmt(x, digits=2):
  return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="runs/entropy_control")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--summarize", action="store_true", help="only read the runs in --out")
  args = parser.parse_args()
  if args.parallel < 1:
    parser.error("--parallel must be at least 1")
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  jobs = [(v, s) for s in args.seeds for v in args.variants]
  if not args.summarize:
    run_all(out, jobs, args.parallel)

  rows, dirs = {}, {}
  for variant, seed in jobs:
    workdir = run_dir(out, variant, seed)
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
      print(f"[entropy_control] {os.path.basename(workdir)}: no metrics, left out", flush=True)
      continue
    name = os.path.basename(workdir)
    rows[name] = {"variant": variant, "seed": seed, **summarize_run(workdir)}
    dirs[name] = workdir
  print("\n| run | what | held-out step 0 | step 25 | step 50 | entropy 1-5 | 21-25 | 46-50 "
        "| no-variance groups (26-50) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, r in rows.items():
    print(f"| {name} | {VARIANTS[r['variant']][1]} | {_fmt(r['acc_start'])} | "
          f"{_fmt(r['acc_mid'])} | {_fmt(r['acc_end'])} | {_fmt(r['entropy_start'], 3)} | "
          f"{_fmt(r['entropy_mid'], 3)} | {_fmt(r['entropy_end'], 3)} | "
          f"{_fmt(r['zero_variance_groups_late'])} |")
  figure = plot(out, dirs, rows) if dirs else None
  result = {"cpu": cpu_info.describe(), "runs": rows, "figure": figure}
  with open(os.path.join(out, "entropy_control.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))
  return 0 if len(rows) == len(jobs) else 1


if __name__ == "__main__":
  sys.exit(main())
