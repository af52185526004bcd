"""How hard each reasoning-gym task is for a model: greedy held-out accuracy per task.

  .venv/bin/python benchmarks/task_difficulty.py                    # the embedded model
  .venv/bin/python benchmarks/task_difficulty.py --tasks gcd,lcm --per-task 50
  .venv/bin/python benchmarks/task_difficulty.py --easy     # EASY's tasks at EASY's levels
  .venv/bin/python benchmarks/task_difficulty.py --easy --template "{question}
  Answer with just the answer."                              # another prompt

Draws `--per-task` test questions of each task (the seeded test split of
`reasoning_gym/<task>`, data/suites.py), asks them with the reasoning-gym prompt format
(evaluation/harness.py), and grades the greedy replies with reasoning-gym's scorers,
strict (the <answer> tag) and lenient (else the last line). What the GRPO mix is chosen
from (docs/evaluation.md): tasks whose accuracy is neither ~0 (no signal) nor high.
Prints a Markdown table, then one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import cpu_info
from jaxrl_agents import data
from jaxrl_agents.evaluation import harness
from jaxrl_agents.models import zoo

# Tasks with short answers and scorers that do not evaluate the answer.
CANDIDATES = ("basic_arithmetic,chain_sum,decimal_arithmetic,gcd,lcm,products,power_function,"
              "fraction_simplification,prime_factorization,count_bits,base_conversion,"
              "number_format,leg_counting,letter_counting,coin_flip,time_intervals,"
              "calendar_arithmetic,simple_equations,gsm_symbolic,spell_backward,"
              "word_sequence_reversal,letter_jumble,caesar_cipher,family_relationships,"
              "syllogism,aiw,number_filtering,count_primes")

# Easier levels of tasks (each generator's own options) for a 135M model: short operands,
# few terms or words, still large enough question spaces for disjoint train and test splits.
EASY: dict[str, dict] = {
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                             operators=("+", "-", "*"), allow_parentheses=False,
                             allow_negation=False),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
    "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
    "letter_counting": dict(min_words=3, max_words=5),
    "count_bits": dict(min_n=1, max_n=1000),
    "gcd": dict(min_value=1, max_value=100),
    "lcm": dict(min_value=1, max_value=30),
    "spell_backward": dict(min_word_len=3, max_word_len=5),
    "word_sequence_reversal": dict(min_words=2, max_words=3),
    "syllogism": {}, "calendar_arithmetic": {}, "aiw": {},
}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default=zoo.DEFAULT_MODEL)
  p.add_argument("--tasks", default=CANDIDATES)
  p.add_argument("--per-task", type=int, default=24)
  p.add_argument("--max-new-tokens", type=int, default=96)
  p.add_argument("--batch-size", type=int, default=24)
  p.add_argument("--easy", action="store_true", help="EASY's tasks at EASY's levels")
  p.add_argument("--template", default=None,
                 help="the prompt ({question} is the task's question; default: the tag "
                      "instruction of evaluation/harness.py's reasoning_gym format)")
  args = p.parse_args()
  configs = EASY if args.easy else {}
  if args.easy:
    args.tasks = ",".join(EASY)
  model = zoo.load(args.model)
  fmt = harness.format_for("reasoning_gym")
  if args.template:
    fmt = dataclasses.replace(fmt, template=args.template)
  examples, skipped = [], {}
  for task in args.tasks.split(","):
    try:
      options = {"configs": {task: configs[task]}} if configs.get(task) else {}
      rows = data.load_task(f"reasoning_gym/{task}", "test", test_size=args.per_task,
                            **options)
    except Exception as e:  # noqa: BLE001 - report the task, measure the others
      skipped[task] = f"{type(e).__name__}: {e}"
      continue
    examples += [{**row, "group": task} for row in rows]
  start = time.perf_counter()
  result, _ = harness.evaluate(model.params, model, examples, fmt,
                               harness.EvalSettings(max_new_tokens=args.max_new_tokens,
                                                    batch_size=args.batch_size))
  seconds = time.perf_counter() - start
  strict = result["graders"]["reasoning_gym_solved"]["groups"]
  lenient = result["graders"]["reasoning_gym_solved_lenient"]["groups"]
  print("| task | strict (tagged) | lenient |")
  print("|---|---|---|")
  rows = {}
  for task in sorted(strict, key=lambda t: -strict[t]["greedy"]):
    rows[task] = {"strict": strict[task]["greedy"], "lenient": lenient[task]["greedy"]}
    print(f"| {task} | {rows[task]['strict']:.2f} | {rows[task]['lenient']:.2f} |")
  print(json.dumps({"model": args.model, "per_task": args.per_task, "configs": configs,
                    "template": fmt.template,
                    "max_new_tokens": args.max_new_tokens, "seconds": round(seconds, 1),
                    "cpu": cpu_info.describe(), "skipped": skipped, "tasks": rows}))


if __name__ == "__main__":
  main()
