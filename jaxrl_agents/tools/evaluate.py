r"""Evaluate a model, a training run or an exported directory on a task.

  python -m jaxrl_agents.tools.evaluate --task gsm8k --size 200              # the embedded model
  python -m jaxrl_agents.tools.evaluate --task gsm8k --workdir runs/grpo --k 8 --temperature 0.8
  python -m jaxrl_agents.tools.evaluate --task reasoning_gym/chain_sum,gcd --model /tmp/hf_dir \
      --task-option size=200 --task-option seed=1000003
  python -m jaxrl_agents.tools.evaluate --task reasoning_gym/products --format reasoning_gym_plain

Greedy accuracy, and with --k: pass@1, pass@k (unbiased), maj@k and mean@k, under the task's
strict and lenient graders, each with its standard error and a bootstrap 95% interval,
per group where the task has groups (data/suites.py, evaluation/harness.py). Prints a
table; writes the result JSON and one JSONL record per example (the replies and verdicts)
to --out (default: <workdir>/evaluations/ for a run, else ./evaluations/).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from jaxrl_agents.models import zoo


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_agents.tools.evaluate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--task", required=True,
                 help="gsm8k, aime2025, gpqa_diamond, reasoning_gym/<task>[,<task>...], "
                      "arithmetic/<config>")
  p.add_argument("--split", default="test")
  p.add_argument("--size", type=int, default=0, help="the first N examples (0: all)")
  p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                 help="a suite option (VALUE as JSON, else a string); repeatable")
  source = p.add_mutually_exclusive_group()
  source.add_argument("--model", default=None,
                      help="preset name, Hugging Face directory or .gguf file (default: the "
                           "embedded model)")
  source.add_argument("--workdir", default=None, help="a training run: its policy")
  p.add_argument("--step", type=int, default=None, help="the run's checkpoint (default: newest)")
  p.add_argument("--k", type=int, default=0, help="samples per example (0: greedy only)")
  p.add_argument("--no-greedy", action="store_true", help="only the k samples")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--max-new-tokens", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--format", default=None,
                 help="a prompt format of evaluation/harness.py's FORMATS, with its graders "
                      "(default: the task family's; reasoning_gym_plain: 'Answer with just "
                      "the answer.', read whole and leniently)")
  p.add_argument("--template", default=None, help="override the format's prompt template")
  p.add_argument("--out", default=None, help="the result JSON's path")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  return p.parse_args(argv)


def _options(pairs) -> dict:
  options = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise SystemExit(f"--task-option takes KEY=VALUE, got {pair!r}")
    try:
      options[key] = json.loads(value)
    except json.JSONDecodeError:
      options[key] = value
  return options


def _load_policy(args):
  """(zoo.Model with the policy's params, a name for the report)."""
  from jaxrl_agents.train import checkpointing

  if args.workdir:
    if not os.path.isdir(os.path.join(args.workdir, "checkpoints")):
      raise SystemExit(f"--workdir {args.workdir!r} holds no checkpoints/ (not a training run)")
    try:
      params, meta, step = checkpointing.latest_policy_params(args.workdir, args.step)
    except FileNotFoundError as e:
      raise SystemExit(f"--workdir {args.workdir!r}: {e}") from None
    model = zoo.load(meta["config"]["model"], dtype=args.dtype)
    zoo.check_params(params, model.cfg, args.workdir)
    model.params = params
    return model, f"{args.workdir} (step {step})", step
  if args.step is not None:
    raise SystemExit("--step needs --workdir")
  model = zoo.load(args.model or zoo.DEFAULT_MODEL, dtype=args.dtype)
  return model, model.name, None


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(message)s")
  import dataclasses

  from jaxrl_agents import data
  from jaxrl_agents.evaluation import harness

  try:
    fmt = harness.format_for(args.format or args.task)
  except KeyError as e:
    raise SystemExit(str(e)) from None
  if args.template:
    fmt = dataclasses.replace(fmt, template=args.template)
  settings = harness.EvalSettings(
      greedy=not args.no_greedy, k=args.k, temperature=args.temperature, top_p=args.top_p,
      top_k=args.top_k, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
      seed=args.seed)
  try:
    settings.check()
    examples = list(data.load_task(args.task, args.split, **_options(args.task_option)))
  except (ValueError, KeyError, ImportError) as e:
    raise SystemExit(f"error: {e}") from None
  if args.size:
    examples = examples[: args.size]
  model, source, step = _load_policy(args)
  result, samples = harness.evaluate(model.params, model, examples, fmt, settings)
  result.update(task=args.task, split=args.split, size=len(examples), source=source,
                task_options=_options(args.task_option))
  out = args.out or os.path.join(
      os.path.join(args.workdir, "evaluations") if args.workdir else "evaluations",
      re.sub(r"[^\w.-]+", "_", f"{args.task}_{args.split}_n{len(examples)}_k{args.k}"
             + (f"_step{step}" if step is not None else "")) + ".json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.splitext(out)[0] + ".samples.jsonl", "w") as f:
    for record in samples:
      f.write(json.dumps(record, default=str) + "\n")
  print(f"{source} on {args.task} ({args.split}, {len(examples)} examples); "
        f"{fmt.extraction}")
  print(harness.table(result))
  print(f"seconds: {result['seconds']}; written: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
