"""A whole GRPO iteration, this project against tunix's GRPOLearner, on SmolLM2-135M-Instruct.

  .venv/bin/python benchmarks/grpo_iteration.py            # 8 iterations a side
  .venv/bin/python benchmarks/grpo_iteration.py --steps 12

One iteration: sample 2 prompts x 4 completions (at most 32 new tokens,
temperature 0.9), score them (1 when the reply's last integer is the answer),
reference and policy log-probabilities, group advantages, one AdamW update
with the KL to the frozen reference model (beta 0.04): tunix's GRPOLearner
configuration at these sizes (benchmarks/tunix_grpo_iteration.py, in tunix's
own virtualenv, `setup_tunix.sh`).

- The project: the GRPO experiment itself (`experiments.grpo`, float32,
  rewards scored in-process as tunix does), one process; an iteration's time
  is its logged `step_time_s`. Run twice: cold (an empty compilation cache:
  the figures compared), then again with the persistent compilation cache the
  first run filled (the project's default for a rerun or a resume).
- tunix: the same prompts in the same order (read back from the project's
  samples.jsonl, chat-templated the same way), one process; an iteration's
  time is the interval between the learner's reads of consecutive batches.

Reported: the first iteration (with compilation) and the median of the rest
(steady state), for each, and the ratios ours / tunix. The sides run one after
the other, each alone on the machine. The last line of output is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import cpu_info

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROMPTS, GENERATIONS, NEW_TOKENS, BETA, LEARNING_RATE = 2, 4, 32, 0.04, 1e-6


def run_ours(workdir: str, steps: int, cache: str) -> dict:
  flags = {"model": "smollm2-135m-instruct", "steps": steps, "prompts_per_step": PROMPTS,
           "group_size": GENERATIONS, "max_new_tokens": NEW_TOKENS, "temperature": 0.9,
           "kl_coef": BETA, "optimizer.learning_rate": LEARNING_RATE,
           "rewards": "{'last_integer': 1.0}", "grader": "last_integer",
           # plain GRPO, as tunix runs it: not the main job's exploration controls
           "token_control.name": "none", "optimizer.decay": "constant",
           # nor its background compiles ahead of need (8 timed iterations would run beside
           # compiles of programs they may never use) or its compaction (8 rows)
           "pack_compile_ahead": 0, "compact_min_rows": 0,
           "reward_time_limit_s": 0.0, "eval_every": 0, "eval_size": 2,
           "checkpoint_every": 10_000, "sample_every": 1, "samples_per_log": PROMPTS * GENERATIONS,
           "tensorboard": False}
  cmd = [sys.executable, "-m", "experiments.grpo",
         f"--config={REPO}/experiments/configs/grpo_arithmetic.py", f"--workdir={workdir}",
         f"--compilation_cache={cache}", *(f"--config.{k}={v}" for k, v in flags.items())]
  start = time.perf_counter()
  subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  wall = time.perf_counter() - start
  from jaxrl_agents.train import metrics as metrics_lib

  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  return {"system": "jaxrl_agents", "step_s": [r["step_time_s"] for r in train],
          "compile_s": train[0]["compile_time_s"], "process_s": wall,
          "reward_mean": statistics.mean(r["reward_mean"] for r in train)}


def tunix_batches(workdir: str, steps: int) -> list[dict]:
  """The prompts the project's run sampled, step by step, chat-templated for tunix."""
  from jaxrl_agents.models import tokenizer as tokenizer_lib
  from jaxrl_agents.models import zoo
  from jaxrl_agents.train import metrics as metrics_lib

  tok = zoo.load("smollm2-135m-instruct").tokenizer
  samples = [s for s in metrics_lib.read_jsonl(os.path.join(workdir, "samples.jsonl"))
             if s["kind"] == "train"]
  batches = []
  for step in range(1, steps + 1):
    rows = [s for s in samples if s["step"] == step][::GENERATIONS]  # one row per group
    if len(rows) != PROMPTS:
      raise RuntimeError(f"step {step}: {len(rows)} prompts in samples.jsonl, expected {PROMPTS}")
    batches.append({"prompts": [tokenizer_lib.chat_prompt(tok, r["prompt"]) for r in rows],
                    "answer": [str(r["answer"]) for r in rows]})
  return batches


def run_tunix(batches: list[dict], steps: int) -> dict:
  from jaxrl_agents.models import zoo

  subprocess.run(["bash", os.path.join(HERE, "setup_tunix.sh")], check=True)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(batches, f)
  cmd = [os.path.join(HERE, ".venv-tunix", "bin", "python"),
         os.path.join(HERE, "tunix_grpo_iteration.py"), "--hf-dir", zoo.smollm2_dir(),
         "--batches", f.name, "--steps", str(steps), "--generations", str(GENERATIONS),
         "--max-new-tokens", str(NEW_TOKENS), "--beta", str(BETA),
         "--learning-rate", str(LEARNING_RATE)]
  start = time.perf_counter()
  out = subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True)
  wall = time.perf_counter() - start
  result = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
  return {**result, "process_s": wall}


def summary(side: dict) -> dict:
  steps = side["step_s"]
  return {"first_step_s": round(steps[0], 2),
          "steady_step_s": round(statistics.median(steps[1:]), 2),
          "steady_spread_s": [round(min(steps[1:]), 2), round(max(steps[1:]), 2)],
          "process_s": round(side["process_s"], 1)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=8)
  args = ap.parse_args()
  if args.steps < 3:
    raise SystemExit("--steps must be at least 3 (the first iteration compiles)")
  machine = cpu_info.describe()
  print(f"CPU: {machine}", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "compilation_cache")
    ours = run_ours(os.path.join(tmp, "cold"), args.steps, cache)
    print(f"jaxrl_agents: {summary(ours)}", flush=True)
    # The project's default: JAX's persistent compilation cache beside the workdir, so a
    # second run (a rerun, a resume) loads its programs. Reported apart; the ratios are cold.
    warm = run_ours(os.path.join(tmp, "warm"), args.steps, cache)
    print(f"jaxrl_agents, rerun with its compilation cache: {summary(warm)}", flush=True)
    batches = tunix_batches(os.path.join(tmp, "cold"), args.steps)
  theirs = run_tunix(batches, args.steps)
  print(f"tunix:        {summary(theirs)}", flush=True)
  a, b = summary(ours), summary(theirs)
  result = {
      "machine": machine, "steps": args.steps, "prompts": PROMPTS, "generations": GENERATIONS,
      "max_new_tokens": NEW_TOKENS, "jaxrl_agents": {**a, "compile_s": round(ours["compile_s"], 1),
                                                      "step_s": ours["step_s"]},
      "jaxrl_agents_cached_rerun": {**summary(warm), "compile_s": round(warm["compile_s"], 1)},
      "tunix": {**b, "step_s": theirs["step_s"]},
      "steady_ratio": round(a["steady_step_s"] / b["steady_step_s"], 3),
      "first_step_ratio": round(a["first_step_s"] / b["first_step_s"], 3),
      "first_step_ratio_cached_rerun": round(summary(warm)["first_step_s"] / b["first_step_s"], 3),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
