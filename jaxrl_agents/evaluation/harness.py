"""Evaluating a policy on a task: greedy accuracy, pass@k, maj@k and mean@k under each grader.

```
from jaxrl_agents.evaluation import harness
from jaxrl_agents import data
from jaxrl_agents.models import zoo

model = zoo.load("smollm2-135m-instruct")
examples = list(data.load_task("gsm8k", "test"))[:100]
result, samples = harness.evaluate(model.params, model, examples, harness.format_for("gsm8k"),
                                   harness.EvalSettings(k=8, temperature=0.8))
result["graders"]["math_strict"]["greedy"]   # {"mean", "se", "ci95"}
```
Every grader of the task's format scores every reply (the strict and the lenient reading
side by side: at small model sizes the reading moves the figure by tens of points).
Greedy decoding and the k samples have their own settings (`EvalSettings`), apart from
any training run's. The k replies of an example come from one prefill (the sampler's
`samples_per_prompt`); batches are padded to one shape, so a whole evaluation compiles
two programs. Graders score each reply within `grader_time_limit_s`
(`rewards.time_limit`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.data.loader import padded_batches
from jaxrl_agents.data.prompts import format_prompts
from jaxrl_agents.evaluation import estimators
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rewards import answers, suites, time_limit
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import single_turn


@dataclasses.dataclass(frozen=True)
class TaskFormat:
  """How a task is asked and read: the prompt template (fields of the example in braces),
  its graders (strict first), and how each grader reads an answer (for maj@k)."""
  template: str
  graders: tuple[str, ...]
  system: str | None = None
  chat: bool = True
  extraction: str = ""  # in words, for the report


# Prompts the embedded 135M instruct model follows (docs/evaluation.md), with the strict
# and the lenient grader of each.
FORMATS: dict[str, TaskFormat] = {
    "gsm8k": TaskFormat(
        "{question}\nSolve it step by step, then end with the line 'Answer: <number>'.",
        ("math_strict", "math_lenient"),
        extraction="strict: a final 'Answer: N' (or \\boxed{N}, '#### N', '= N'); lenient: "
                   "the boxed or else the last number"),
    "aime2025": TaskFormat(
        "{question}\nSolve it step by step, then end with the line 'Answer: <integer>'.",
        ("math_strict", "math_lenient"),
        extraction="as gsm8k"),
    "gpqa_diamond": TaskFormat(
        "{question}\n\n{choices}\n\nEnd with the line 'Answer: <letter>'.",
        ("multiple_choice", "multiple_choice_lenient"),
        extraction="strict: a final 'Answer: X' (or a reply that is only the letter); "
                   "lenient: the last standalone A-D"),
    "reasoning_gym": TaskFormat(
        "{question}\nPut your final answer inside <answer></answer> tags.",
        ("reasoning_gym_solved", "reasoning_gym_solved_lenient"),
        extraction="strict: the last <answer>...</answer>; lenient: that, else what the "
                   "last line states ('The answer is X.' reads X); graded by reasoning-gym's "
                   "score_answer, full credit"),
    # The prompt the GRPO mix trains with (experiments/configs/grpo_reasoning_gym.py): the
    # embedded model never writes the tags above, and answers this one in a line or two.
    "reasoning_gym_plain": TaskFormat(
        "{question}\nAnswer with just the answer.",
        ("reasoning_gym_solved_exact", "reasoning_gym_solved_lenient"),
        extraction="strict: the whole reply, one line, is the answer; lenient: the last "
                   "<answer> tag, else what the last line states ('The answer is X.' reads "
                   "X); graded by reasoning-gym's score_answer, full credit"),
    "arithmetic": TaskFormat("{question} Answer with just the number.",
                             ("math_strict", "math_lenient"), extraction="as gsm8k"),
}

# How each grader reads a reply's answer: the answers maj@k votes over.
READERS: dict[str, Callable[[str], Any]] = {
    "math_strict": answers.strict_answer,
    "math_lenient": answers.lenient_answer,
    "last_integer": answers.last_integer,
    "multiple_choice": suites.strict_letter,
    "multiple_choice_lenient": suites.lenient_letter,
    "reasoning_gym": suites.tagged_answer,
    "reasoning_gym_solved": suites.tagged_answer,
    "reasoning_gym_lenient": suites.tagged_or_last_line,
    "reasoning_gym_solved_lenient": suites.tagged_or_last_line,
    "reasoning_gym_solved_exact": suites.whole_reply,
}


def format_for(task: str) -> TaskFormat:
  """The TaskFormat of a task name ("gsm8k", "reasoning_gym/chain_sum", "arithmetic/add2")."""
  family = task.split("/", 1)[0]
  if family not in FORMATS:
    raise KeyError(f"no prompt format for task {task!r}; known: {sorted(FORMATS)} (or build "
                   "a harness.TaskFormat)")
  return FORMATS[family]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """Decoding for an evaluation, apart from training's. k = 0: greedy only."""
  greedy: bool = True
  k: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 256
  batch_size: int = 16  # examples per batch (greedy); sampled batches hold batch_size * k rows
  seed: int = 0
  grader_time_limit_s: float = 10.0

  def check(self) -> None:
    if self.k < 0 or (not self.greedy and self.k == 0):
      raise ValueError(f"nothing to evaluate: greedy={self.greedy}, k={self.k} (k >= 1 "
                       "samples, or greedy)")
    if self.k and not self.temperature > 0:
      raise ValueError(f"k={self.k} samples need temperature > 0, got {self.temperature}")
    for name in ("max_new_tokens", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _summary(values: Sequence[float]) -> dict[str, Any]:
  low, high = estimators.bootstrap_interval(values)
  return {"mean": float(np.mean(values)), "se": estimators.standard_error(values),
          "ci95": [low, high]}


def _decode(params, model, examples, fmt: TaskFormat, sampling, group: int, rng,
            batch_size: int, progress, label: str) -> list[str]:
  """`group` completions per example (example-major), in padded batches."""
  out = []
  for index, (_, n, padded) in enumerate(padded_batches(examples, batch_size)):
    s = single_turn.sample(params, model, padded, jax.random.fold_in(rng, index),
                           group_size=group, sampling=sampling, template=fmt.template,
                           chat=fmt.chat, system=fmt.system)
    out += s.completions[: n * group]
    if progress is not None:
      progress.update(n)
      progress.set_postfix_str(label)
  return out


def evaluate(params, model, examples: Sequence[Mapping[str, Any]], fmt: TaskFormat,
             settings: EvalSettings = EvalSettings(), *, progress: bool = True
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """(result, samples) of the policy `params` of `model` (a zoo.Model) on `examples`.

  result: {"num_examples", "settings", "format", "seconds": {greedy, sampled},
  "graders": {grader: {"greedy": summary, "pass@1", "pass@k", "maj@k", "mean@k": summary,
  "groups": {group: {metric: mean}}}}} where a summary is {"mean", "se", "ci95"} over the
  examples. samples: one record per example (prompt, answer, greedy reply, verdicts,
  sampled replies and their verdicts).
  """
  settings.check()
  examples = list(examples)
  if not examples:
    raise ValueError("no examples to evaluate")
  graders = {}
  for name in fmt.graders:
    graders[name] = time_limit.TimeLimited(registry.get("reward", name),
                                           settings.grader_time_limit_s)
  tok = model.tokenizer
  stop, pad = tokenizer_lib.stop_token_ids(tok), tok.pad_token_id
  rng = jax.random.key(settings.seed)
  n, k = len(examples), settings.k
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=n * (int(settings.greedy) + int(k > 0)), desc="evaluate", unit="example")
  seconds, greedy, sampled = {}, [], []
  if settings.greedy:
    start = time.perf_counter()
    sampling = sampler_lib.SamplingConfig(max_new_tokens=settings.max_new_tokens,
                                          temperature=0.0, stop_tokens=stop, pad_id=pad)
    greedy = _decode(params, model, examples, fmt, sampling, 1, rng, settings.batch_size, bar,
                     "greedy")
    seconds["greedy"] = round(time.perf_counter() - start, 2)
  if k:
    start = time.perf_counter()
    sampling = sampler_lib.SamplingConfig(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
        top_p=settings.top_p, top_k=settings.top_k, stop_tokens=stop, pad_id=pad)
    sampled = _decode(params, model, examples, fmt, sampling, k, jax.random.fold_in(rng, 1),
                      settings.batch_size, bar, f"{k} samples")
    seconds["sampled"] = round(time.perf_counter() - start, 2)
  if bar is not None:
    bar.close()

  groups = [str(ex.get("group", "all")) for ex in examples]
  report, verdicts = _grade(graders, examples, groups, greedy, sampled, k)
  result = {"num_examples": n, "settings": dataclasses.asdict(settings),
            "format": dataclasses.asdict(fmt), "seconds": seconds,
            "grader_timeouts": {name: time_limit.timeouts(fn) for name, fn in graders.items()},
            "graders": report}
  return result, _sample_records(examples, format_prompts(examples, fmt.template), groups,
                                 greedy, sampled, k, verdicts)


def _sample_records(examples, prompts, groups, greedy, sampled, k, verdicts) -> list[dict]:
  """One record per example: its prompt, answer, replies and each grader's verdicts."""
  samples = []
  for i, ex in enumerate(examples):
    record = {"index": i, "group": groups[i], "prompt": prompts[i], "answer": ex.get("answer")}
    if greedy:
      record["greedy"] = greedy[i]
      record["greedy_verdicts"] = {name: float(v[0][i]) for name, v in verdicts.items()}
    if k:
      record["samples"] = sampled[i * k:(i + 1) * k]
      record["sample_verdicts"] = {name: v[1][i].tolist() for name, v in verdicts.items()}
    samples.append(record)
  return samples


def _grade(graders, examples, groups: list[str], greedy: list[str], sampled: list[str],
           k: int) -> tuple[dict[str, Any], dict[str, tuple]]:
  """(report per grader: metric summaries and per-group means; verdicts per grader:
  (greedy f64[n] or None, sampled f64[n, k] or None))."""
  n = len(examples)
  repeated = [ex for ex in examples for _ in range(k)]
  report, verdicts = {}, {}
  for name, grade in graders.items():
    per_example: dict[str, list[float]] = collections.defaultdict(list)
    g = np.asarray(grade(greedy, examples), np.float64) if greedy else None
    s = np.asarray(grade(sampled, repeated), np.float64).reshape(n, k) if k else None
    verdicts[name] = (g, s)
    read = READERS.get(name)
    for i in range(n):
      if g is not None:
        per_example["greedy"].append(float(g[i]))
      if s is not None:
        solved = int(np.sum(s[i] >= 1.0))
        per_example["pass@1"].append(solved / k)
        per_example["pass@k"].append(estimators.pass_at_k(k, solved, k))
        per_example["mean@k"].append(float(np.mean(s[i])))
        if read is not None:
          votes = [_hashable(read(c)) for c in sampled[i * k:(i + 1) * k]]
          per_example["maj@k"].append(estimators.majority_verdict(votes, s[i]))
    entry = {metric: _summary(values) for metric, values in per_example.items()}
    entry["groups"] = {
        group: {metric: float(np.mean([v for v, gr in zip(values, groups, strict=True)
                                       if gr == group]))
                for metric, values in per_example.items()}
        for group in sorted(set(groups))} if len(set(groups)) > 1 else {}
    report[name] = entry
  return report, verdicts


def _hashable(answer: Any) -> Any:
  return answer if answer is None or isinstance(answer, str | int) else str(answer)


def table(result: Mapping[str, Any]) -> str:
  """The result as a Markdown table: one row per grader, mean +- SE per metric."""
  metrics = ["greedy", "pass@1", "pass@k", "maj@k", "mean@k"]
  k = result["settings"]["k"]
  shown = [m for m in metrics if any(m in g for g in result["graders"].values())]
  names = [m.replace("@k", f"@{k}") for m in shown]
  lines = [f"| grader | {' | '.join(names)} |", "|---" * (len(shown) + 1) + "|"]
  for grader, entry in result["graders"].items():
    cells = [f"{entry[m]['mean']:.3f} +- {entry[m]['se']:.3f}" if m in entry else ""
             for m in shown]
    lines.append(f"| {grader} | {' | '.join(cells)} |")
  return "\n".join(lines)
