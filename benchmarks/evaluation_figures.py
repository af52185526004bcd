"""The evaluation harness on a base model and a trained export: a mix's held-out set and GSM8K.

  .venv/bin/python -m jaxrl_agents.tools.export --workdir runs/grpo_reasoning_gym --out /tmp/hf
  .venv/bin/python benchmarks/evaluation_figures.py --trained /tmp/hf \
      --config experiments/configs/grpo_reasoning_gym.py --out runs/evaluation_figures

For each policy (the embedded base model, then --trained): greedy and k samples a question
(pass@1, pass@k, maj@k, mean@k under the strict and the lenient grader) on
  - the training config's held-out split (its task, task options, eval_size and reply
    budget), in the `reasoning_gym_plain` format the config trains with;
  - GSM8K's first --gsm8k-size test questions (greedy on --gsm8k-greedy-size), replies of
    up to --gsm8k-tokens tokens, in the gsm8k format.
Each evaluation's result JSON and replies go under --out; one summary JSON (figures, wall
times, the CPU) is printed as the last line and written to --out/summary_<policies>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import cpu_info


def _config(path: str, variant: str | None):
  spec = importlib.util.spec_from_file_location("eval_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def _run(model, examples, fmt, settings, out_path: str, **about) -> dict:
  """harness.evaluate, its result (with `about`: the task and its options, which
  benchmarks/transformers_grading.py --compare reads) and replies written at out_path."""
  from jaxrl_agents.evaluation import harness

  start = time.perf_counter()
  result, samples = harness.evaluate(model.params, model, examples, fmt, settings)
  result["wall_s"] = round(time.perf_counter() - start, 1)
  result.update(about)
  with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.splitext(out_path)[0] + ".samples.jsonl", "w") as f:
    for record in samples:
      f.write(json.dumps(record, default=str) + "\n")
  print(harness.table(result), f"\n{result['wall_s']} s", flush=True)
  return result


def _figures(result: dict) -> dict:
  return {grader: {metric: {"mean": round(entry[metric]["mean"], 4),
                            "se": round(entry[metric]["se"], 4)}
                   for metric in ("greedy", "pass@1", "pass@k", "maj@k", "mean@k")
                   if metric in entry}
          | ({"groups": entry["groups"]} if entry.get("groups") else {})
          for grader, entry in result["graders"].items()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--trained", required=True, help="an exported Hugging Face directory")
  p.add_argument("--config", default="experiments/configs/grpo_reasoning_gym.py")
  p.add_argument("--variant", default=None, help="the config's variant (e.g. tiny)")
  p.add_argument("--base", default=None, help="the base model (default: the config's)")
  p.add_argument("--out", default="runs/evaluation_figures")
  p.add_argument("--k", type=int, default=8)
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--gsm8k-size", type=int, default=50, help="questions sampled k times")
  p.add_argument("--gsm8k-greedy-size", type=int, default=100)
  p.add_argument("--gsm8k-tokens", type=int, default=256)
  p.add_argument("--skip-gsm8k", action="store_true")
  p.add_argument("--skip-mix", action="store_true", help="GSM8K only")
  p.add_argument("--policies", default="base,trained", help="which of base, trained to run")
  args = p.parse_args()

  from jaxrl_agents import data
  from jaxrl_agents.evaluation import harness
  from jaxrl_agents.models import zoo

  config = _config(args.config, args.variant)
  os.makedirs(args.out, exist_ok=True)
  mix = data.load_task(config.task, "test", **config.task_options.to_dict())[:config.eval_size]
  gsm8k = data.load_task("gsm8k", "test")
  summary = {"cpu": cpu_info.describe(), "config": args.config, "variant": args.variant,
             "task": config.task,
             "trained": os.path.abspath(args.trained), "k": args.k,
             "temperature": args.temperature, "policies": {}}
  sources = {"base": args.base or config.model, "trained": args.trained}
  for name in args.policies.split(","):
    source = sources[name]
    model = zoo.load(source)
    figures = {}
    if not args.skip_mix:
      mix_settings = harness.EvalSettings(k=args.k, temperature=args.temperature,
                                          max_new_tokens=config.max_new_tokens, batch_size=25)
      result = _run(model, mix, harness.FORMATS["reasoning_gym_plain"], mix_settings,
                    os.path.join(args.out, f"{name}_mix.json"), task=config.task,
                    task_options=config.task_options.to_dict(), source=source)
      figures["mix"] = {"questions": len(mix), "max_new_tokens": config.max_new_tokens,
                        "wall_s": result["wall_s"], "seconds": result["seconds"],
                        **_figures(result)}
    if not args.skip_gsm8k:
      greedy = _run(model, gsm8k[:args.gsm8k_greedy_size], harness.FORMATS["gsm8k"],
                    harness.EvalSettings(max_new_tokens=args.gsm8k_tokens, batch_size=25),
                    os.path.join(args.out, f"{name}_gsm8k_greedy.json"))
      sampled = _run(model, gsm8k[:args.gsm8k_size], harness.FORMATS["gsm8k"],
                     harness.EvalSettings(greedy=False, k=args.k,
                                          temperature=args.temperature,
                                          max_new_tokens=args.gsm8k_tokens, batch_size=8),
                     os.path.join(args.out, f"{name}_gsm8k_k{args.k}.json"))
      figures["gsm8k_greedy"] = {"questions": args.gsm8k_greedy_size,
                                 "wall_s": greedy["wall_s"], **_figures(greedy)}
      figures["gsm8k_sampled"] = {"questions": args.gsm8k_size, "wall_s": sampled["wall_s"],
                                  **_figures(sampled)}
    summary["policies"][name] = figures
  with open(os.path.join(args.out, f"summary_{'_'.join(summary['policies'])}.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
