"""An independent grading of an exported model: transformers decodes, reasoning-gym scores.

  .venv/bin/python -m jaxrl_agents.tools.export --workdir runs/grpo_reasoning_gym --out /tmp/hf
  .venv/bin/python benchmarks/transformers_grading.py --model-dir /tmp/hf \
      --compare runs/grpo_reasoning_gym/evaluations/trained.json

The evaluation harness (evaluation/harness.py) decodes with this project's sampler and
grades with its reward registry. This script shares neither: the prompts are rendered by
the exported tokenizer's own chat template (`apply_chat_template`), the replies come from
`transformers`' greedy `generate` in PyTorch, and each reply is scored by reasoning-gym's
`score_answer` of its task, called here directly. Only the reading of the answer out of
the reply (the tagged answer, else what the last line states) is the same rule, written
again below, since that rule is part of what is being measured.

With --compare (a `tools.evaluate` result JSON on the same questions, greedy), it prints
both accuracies, their difference against the standard error, and the fraction of
questions whose replies are identical. Prints a table, then one JSON object as its
last line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import time

import cpu_info


def read_answer(reply: str) -> str | None:
  """The tagged answer, else what the last non-empty line states (after its last
  "answer is", "answer:" or "="), markdown and quotes and a final period removed."""
  open_at, close_at = reply.rfind("<answer>"), reply.rfind("</answer>")
  if 0 <= open_at < close_at:
    return reply[open_at + len("<answer>"):close_at].strip()
  lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
  if not lines:
    return None
  line, lowered = lines[-1], lines[-1].lower()
  cuts = [lowered.rfind(m) + len(m) for m in ("answer is", "answer:", "=") if m in lowered]
  if cuts:
    line = line[max(cuts):]
  line = line.strip(" \t*`\"'$")
  if line.endswith("."):
    line = line[:-1].strip(" \t*`\"'$")
  return line or None


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model-dir", required=True, help="an exported Hugging Face directory")
  p.add_argument("--task", default=None, help="default: the --compare result's task")
  p.add_argument("--size", type=int, default=0, help="the first N test questions (0: all)")
  p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--template", default=None, help="default: the --compare result's template")
  p.add_argument("--max-new-tokens", type=int, default=None)
  p.add_argument("--batch-size", type=int, default=25)
  p.add_argument("--compare", default=None, help="a tools.evaluate result JSON (greedy)")
  args = p.parse_args()

  import numpy as np
  import reasoning_gym
  import torch
  import transformers

  from jaxrl_agents import data

  compared = None
  if args.compare:
    with open(args.compare) as f:
      compared = json.load(f)
  task = args.task or (compared or {}).get("task")
  template = args.template or (compared or {}).get("format", {}).get("template")
  max_new = args.max_new_tokens or (compared or {}).get("settings", {}).get("max_new_tokens")
  if not (task and template and max_new):
    raise SystemExit("transformers_grading: give --task, --template and --max-new-tokens, or "
                     "--compare with a tools.evaluate result JSON that names them")
  options = {}
  for item in args.task_option or []:
    key, _, value = item.partition("=")
    try:
      options[key] = json.loads(value)
    except json.JSONDecodeError:
      options[key] = value
  if compared and not args.task_option:
    options = dict(compared.get("task_options", {}))
  size = args.size or (compared or {}).get("num_examples", 0)
  examples = data.load_task(task, "test", **options)
  examples = examples[:size] if size else examples

  torch.manual_seed(0)
  tok = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  tok.padding_side = "left"
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir,
                                                            dtype=torch.float32)
  model.eval()
  replies, start = [], time.perf_counter()
  for i in range(0, len(examples), args.batch_size):
    batch = examples[i:i + args.batch_size]
    texts = [tok.apply_chat_template([{"role": "user", "content": template.format(**ex)}],
                                     tokenize=False, add_generation_prompt=True)
             for ex in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
      out = model.generate(**enc, max_new_tokens=max_new, do_sample=False,
                           pad_token_id=tok.pad_token_id)
    for row in out[:, enc["input_ids"].shape[1]:]:
      replies.append(tok.decode(row, skip_special_tokens=True))
    print(f"  {len(replies)}/{len(examples)} replies, {time.perf_counter() - start:.0f} s",
          flush=True)
  seconds = time.perf_counter() - start

  correct, per_group = [], {}
  for ex, reply in zip(examples, replies, strict=True):
    answer = read_answer(reply)
    score = 0.0
    if answer is not None:
      scorer = reasoning_gym.get_score_answer_fn(ex["metadata"]["source_dataset"])
      try:
        score = float(scorer(answer, ex))
      except (ValueError, TypeError, ArithmeticError, KeyError):
        score = 0.0
    correct.append(1.0 if score >= 1.0 else 0.0)
    per_group.setdefault(str(ex.get("group", "all")), []).append(correct[-1])
  accuracy = float(np.mean(correct))
  se = float(np.std(correct, ddof=1) / math.sqrt(len(correct))) if len(correct) > 1 else 0.0
  result = {"model_dir": os.path.abspath(args.model_dir), "task": task,
            "task_options": options, "template": template, "max_new_tokens": max_new,
            "num_examples": len(examples), "accuracy": accuracy, "se": se,
            "groups": {g: float(np.mean(v)) for g, v in sorted(per_group.items())},
            "seconds": round(seconds, 1), "cpu": cpu_info.describe(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         # the distribution's version: reasoning_gym.__version__ of 0.1.25
                         # still says 0.1.19
                         "reasoning_gym": importlib.metadata.version("reasoning-gym")}}
  print("| grading | greedy accuracy (SE) |")
  print("|---|---|")
  print(f"| transformers + reasoning-gym (this script) | {accuracy:.3f} ({se:.3f}) |")
  if compared:
    lenient = [g for g in compared["graders"] if g.endswith("lenient")][0]
    theirs = compared["graders"][lenient]["greedy"]
    same = None
    samples_path = os.path.splitext(args.compare)[0] + ".samples.jsonl"
    if os.path.exists(samples_path):
      with open(samples_path) as f:
        harness_replies = [json.loads(line)["greedy"] for line in f]
      same = float(np.mean([a.strip() == b.strip()
                            for a, b in zip(harness_replies, replies, strict=True)]))
    result["harness"] = {"grader": lenient, "accuracy": theirs["mean"], "se": theirs["se"],
                         "difference": accuracy - theirs["mean"],
                         "identical_replies": same}
    print(f"| the harness ({lenient}) | {theirs['mean']:.3f} ({theirs['se']:.3f}) |")
    print(f"difference {accuracy - theirs['mean']:+.3f} (SE {se:.3f}); identical replies: "
          f"{same if same is None else f'{same:.1%}'}")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
