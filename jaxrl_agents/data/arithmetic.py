"""TFDS builder "arithmetic": one-step integer arithmetic questions with exact answers.

Each example is a plain question and the integer answer as text:

  question   "What is 37 + 45?"
  answer     "82"
  operation  "add" | "sub" | "mul"
  a, b       int64 operands (the question is `a <op> b`)

Problems come from five groups; every config but `mixed` is one group:

| config      | problems                              | train | test |
|-------------|---------------------------------------|-------|------|
| `add1`      | a + b, a, b in 0..9                   |    80 |   20 |
| `sub1`      | a - b, a, b in 0..9, a >= b           |    35 |   20 |
| `add2`      | a + b, a, b in 10..99                 |  7600 |  500 |
| `sub2`      | a - b, a, b in 10..99, a >= b         |  3595 |  500 |
| `mul_table` | a * b, a, b in 2..12                  |    97 |   24 |
| `mixed`     | the five groups in equal shares       |  5000 |  100 |

Subtraction keeps a >= b, so every answer is a non-negative integer (small models
then never need a minus sign; a negative-result config would be a new group).

Splits. Each group's full problem set is enumerated and cut once, from a fixed
seed, into test (min(500, max(20, n // 5)) problems) and train (the rest). The cut
is made over unordered operand pairs for + and *, so when 3 + 4 is a test problem,
4 + 3 is too: the test split measures arithmetic the model has not seen in either
order. `mixed` reuses the same cut, so no test problem of any config is a train
problem of any other. Its train split takes 1000 problems from each group (the
small groups' train problems repeat, each about equally often, because RL wants
the groups balanced more than it wants distinct prompts); its test split takes 20
distinct test problems from each group (20 is the smallest group's test size).

The builder needs no download and no TensorFlow: it writes array_record files
and reads them back as random-access sources (`builder.as_data_source()`,
`tfds.data_source("arithmetic/add2", ...)`), or simply use
`jaxrl_agents.data.load_task("arithmetic/add2", "train")`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_agents.data._tfds import ArrayRecordBuilder

SEED = "jaxrl_agents/arithmetic/v1"
SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
MIXED_TRAIN_PER_GROUP = 1000
MIXED_TEST_PER_GROUP = 20


class Problem(NamedTuple):
  """One question `a <operation> b`."""

  operation: str
  a: int
  b: int


class Group(NamedTuple):
  """A family of problems: an operation over an operand range."""

  operation: str
  low: int
  high: int  # inclusive
  non_negative: bool = False  # keep a >= b (subtraction)


GROUPS: dict[str, Group] = {
    "add1": Group("add", 0, 9),
    "sub1": Group("sub", 0, 9, non_negative=True),
    "add2": Group("add", 10, 99),
    "sub2": Group("sub", 10, 99, non_negative=True),
    "mul_table": Group("mul", 2, 12),
}


def solve(operation: str, a: int, b: int) -> int:
  """The exact integer result of `a <operation> b`."""
  if operation == "add":
    return a + b
  if operation == "sub":
    return a - b
  if operation == "mul":
    return a * b
  raise ValueError(f"unknown operation {operation!r}; known: {sorted(SYMBOLS)}")


def group_of(example) -> str:
  """The name of the group (GROUPS) an example's problem comes from; `example` holds
  the fields operation, a, b. Every problem belongs to exactly one group."""
  operation, a, b = _text(example["operation"]), int(example["a"]), int(example["b"])
  for name, group in GROUPS.items():
    if (group.operation == operation and group.low <= min(a, b) and max(a, b) <= group.high
        and (not group.non_negative or a >= b)):
      return name
  raise ValueError(f"{a} {SYMBOLS.get(operation, operation)} {b} is in no arithmetic group")


def question(problem: Problem) -> str:
  """The question text, e.g. "What is 37 + 45?"."""
  return f"What is {problem.a} {SYMBOLS[problem.operation]} {problem.b}?"


def statement(example, answer) -> str:
  """`answer` stated in the equation form a reply takes, e.g. "37 + 45 = 82"; `example`
  holds the fields operation, a, b (an example, or `Problem._asdict()`)."""
  a, b = int(example["a"]), int(example["b"])
  return f"{a} {SYMBOLS[_text(example['operation'])]} {b} = {answer}"


def mistake(example, rng: random.Random) -> int:
  """A plausible wrong (non-negative) answer to `example` (fields operation, a, b): off by
  1-3, a carry or borrow slip (10, 20, 9 or 11 off), another operation's result, the
  digits reversed, for a product the operands written side by side ("8 * 12 = 812"), or
  any number up to twice the answer; what a small model's wrong replies look like."""
  operation = _text(example["operation"])
  a, b = int(example["a"]), int(example["b"])
  y = solve(operation, a, b)
  kinds = (
      lambda: y + rng.choice((-3, -2, -1, 1, 2, 3)),
      lambda: y + rng.choice((-20, -10, 10, 20)),
      lambda: y + rng.choice((-11, -9, 9, 11)),
      lambda: solve(rng.choice([o for o in SYMBOLS if o != operation]), a, b),
      lambda: int(str(y)[::-1]) if y >= 10 else y + 5,
      lambda: int(f"{a}{b}") if operation == "mul" else rng.randint(0, 2 * max(y, 10)),
      lambda: rng.randint(0, 2 * max(y, 10)),
  )
  while True:  # every kind but the reversal of a palindrome or a zero result moves
    wrong = rng.choice(kinds)()
    if wrong >= 0 and wrong != y:
      return wrong


def _text(value) -> str:
  return value.decode() if isinstance(value, bytes) else str(value)


def _units(group: Group) -> list[tuple[Problem, ...]]:
  """The group's problems, bundled so that a commutative pair is never split."""
  commutative = group.operation in ("add", "mul")
  units = []
  operands = range(group.low, group.high + 1)
  for a in operands:
    for b in operands:
      if group.non_negative and a < b:
        continue
      if commutative:
        if a > b:
          continue  # (a, b) travels with (b, a), emitted when a <= b
        units.append((Problem(group.operation, a, b),) if a == b else
                     (Problem(group.operation, a, b), Problem(group.operation, b, a)))
      else:
        units.append((Problem(group.operation, a, b),))
  return units


@functools.cache
def group_splits(name: str) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
  """(train, test) problems of group `name`, in a fixed shuffled order.

  Args:
    name: a key of `GROUPS`.

  Returns:
    Two disjoint tuples whose union is every problem of the group.
  """
  units = _units(GROUPS[name])
  num_problems = sum(len(u) for u in units)
  test_size = min(500, max(20, num_problems // 5))
  # String seeds hash with SHA-512, stable across Python versions and platforms.
  rng = random.Random(f"{SEED}/{name}")
  rng.shuffle(units)
  train, test = [], []
  for unit in units:
    # Greedy fill: a pair that would overshoot goes to train, a later single may fit.
    (test if len(test) + len(unit) <= test_size else train).extend(unit)
  rng.shuffle(train)
  rng.shuffle(test)
  return tuple(train), tuple(test)


def _balanced(problems: tuple[Problem, ...], count: int, rng: random.Random) -> list[Problem]:
  """`count` problems: whole reshuffled passes over `problems`, the last one cut short."""
  out: list[Problem] = []
  while len(out) < count:
    epoch = list(problems)
    rng.shuffle(epoch)
    out.extend(epoch[:count - len(out)])
  return out


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
  """Which problem groups a config holds, and how many of each per split.

  Attributes:
    groups: keys of `GROUPS`.
    train_per_group: problems taken from each group's train cut; None takes all once.
    test_per_group: distinct problems from each group's test cut; None takes all.
  """

  groups: tuple[str, ...] = ()
  train_per_group: int | None = None
  test_per_group: int | None = None

  def problems(self, split: str) -> list[Problem]:
    """The config's problems of `split` ("train" or "test"), in a fixed order."""
    rng = random.Random(f"{SEED}/{self.name}/{split}")
    out: list[Problem] = []
    for name in self.groups:
      train, test = group_splits(name)
      if split == "train":
        out.extend(train if self.train_per_group is None else
                   _balanced(train, self.train_per_group, rng))
      elif split == "test":
        if self.test_per_group is not None and self.test_per_group > len(test):
          raise ValueError(f"group {name} has {len(test)} test problems, "
                           f"{self.test_per_group} requested")
        out.extend(test[:self.test_per_group])
      else:
        raise ValueError(f"unknown split {split!r}; arithmetic has 'train' and 'test'")
    return out


def _group_description(name: str) -> str:
  g = GROUPS[name]
  cond = ", a >= b" if g.non_negative else ""
  return f"a {SYMBOLS[g.operation]} b with a, b in {g.low}..{g.high}{cond}"


class Arithmetic(ArrayRecordBuilder):
  """One-step integer arithmetic questions; see the module docstring for the configs."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      *[ArithmeticConfig(name=name, groups=(name,), description=_group_description(name))
        for name in GROUPS],
      ArithmeticConfig(
          name="mixed", groups=tuple(GROUPS), train_per_group=MIXED_TRAIN_PER_GROUP,
          test_per_group=MIXED_TEST_PER_GROUP,
          description="one- and two-digit + and -, and the 2..12 times tables, in equal "
          "shares"),
  ]
  DEFAULT_BUILDER_CONFIG_NAME = "mixed"

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly, not dataset_info_from_configs: the latter looks for
    # README/TAGS/CITATIONS files next to the module, which a library does not ship.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "question": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "operation": tfds.features.Text(),
            "a": np.int64,
            "b": np.int64,
        }),
        supervised_keys=("question", "answer"),
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager  # nothing to download: problems are enumerated
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split: str):
    for i, p in enumerate(self.builder_config.problems(split)):
      yield i, {"question": question(p), "answer": str(solve(p.operation, p.a, p.b)),
                "operation": p.operation, "a": p.a, "b": p.b}
