"""TFDS builder "countdown": reach a target from 3-4 numbers with + - * /.

Each example:

  numbers   int64[3 or 4], in the order the question lists them
  target    int64
  question  "Using the numbers [1, 4, 8, 24], create an equation that equals 64. Use each
            number once with + - * /."
  solution  one reference answer, e.g. "24 + (4 + 1) * 8" (not the only one)

| config  | numbers per instance | train | test |
|---------|----------------------|-------|------|
| `n3`    | 3                    |  5000 |  500 |
| `n4`    | 4                    |  5000 |  500 |
| `mixed` | 3 or 4, half each    |  5000 |  500 |  (the default)

Instances are made solvable by construction: draw numbers in 1..25, build a
random binary expression tree over all of them (random shape and order, each
operator uniform among those that keep every intermediate value a positive
integer: no fractions, zeros or negatives along the way) and keep it when the
result lies in 1..100. So the reference solution uses every number exactly once
and integer arithmetic suffices to check it.

Splits. For each count (3, 4), instances are drawn from a fixed seed and
deduplicated by (sorted numbers, target); the first 500 distinct ones are test,
the next 5000 train. `mixed` takes the first half of each count's train and test,
so a test instance of any config is never a train instance of any config.

Answers are checked by the one countdown verifier, `jaxrl_agents.rewards.countdown`
(no `eval`: a whitelisted `ast` parse, exact Fractions).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_agents.data._tfds import ArrayRecordBuilder

SEED = "jaxrl_agents/countdown/v1"
MIN_NUMBER, MAX_NUMBER = 1, 25
MIN_TARGET, MAX_TARGET = 1, 100
TRAIN_SIZE, TEST_SIZE = 5000, 500
OPERATORS = ("+", "-", "*", "/")
# Binding strength, for printing with the fewest parentheses.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class Instance(NamedTuple):
  """One puzzle and a reference solution."""

  numbers: tuple[int, ...]
  target: int
  solution: str


def question(numbers: tuple[int, ...] | list[int], target: int) -> str:
  """The question text for `numbers` and `target`."""
  listed = ", ".join(str(n) for n in numbers)
  return (f"Using the numbers [{listed}], create an equation that equals {target}. "
          "Use each number once with + - * /.")


def _apply(op: str, x: int, y: int) -> int | None:
  """x op y when the result is a positive integer, else None."""
  if op == "+":
    return x + y
  if op == "-":
    return x - y if x > y else None
  if op == "*":
    return x * y
  return x // y if x % y == 0 else None


def _random_tree(numbers: list[int], rng: random.Random) -> tuple[int, str, int] | None:
  """(value, expression, precedence) of a random tree over `numbers`, or None if stuck.

  A leaf has precedence 3 (never needs parentheses).
  """
  if len(numbers) == 1:
    return numbers[0], str(numbers[0]), 3
  cut = rng.randint(1, len(numbers) - 1)
  left, right = _random_tree(numbers[:cut], rng), _random_tree(numbers[cut:], rng)
  if left is None or right is None:
    return None
  (x, x_text, x_prec), (y, y_text, y_prec) = left, right
  ops = [op for op in OPERATORS if _apply(op, x, y) is not None]
  if not ops:
    return None
  op = rng.choice(ops)
  prec = _PRECEDENCE[op]
  if x_prec < prec:
    x_text = f"({x_text})"
  # The right operand of - and / also needs them at equal precedence: a - (b - c).
  if y_prec < prec or (y_prec == prec and op in "-/"):
    y_text = f"({y_text})"
  return _apply(op, x, y), f"{x_text} {op} {y_text}", prec


def _draw(count: int, rng: random.Random) -> Instance:
  """One solvable instance with `count` numbers (rejection sampling)."""
  while True:
    numbers = [rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(count)]
    order = numbers[:]
    rng.shuffle(order)  # the solution's order is not the question's order
    tree = _random_tree(order, rng)
    if tree is not None and MIN_TARGET <= tree[0] <= MAX_TARGET:
      return Instance(tuple(numbers), tree[0], tree[1])


@functools.cache
def count_splits(count: int) -> tuple[tuple[Instance, ...], tuple[Instance, ...]]:
  """(train, test) instances with `count` numbers; disjoint by (sorted numbers, target)."""
  rng = random.Random(f"{SEED}/{count}")  # string seeds are stable across Python versions
  seen: set[tuple[tuple[int, ...], int]] = set()
  instances: list[Instance] = []
  while len(instances) < TEST_SIZE + TRAIN_SIZE:
    instance = _draw(count, rng)
    key = (tuple(sorted(instance.numbers)), instance.target)
    if key not in seen:
      seen.add(key)
      instances.append(instance)
  return tuple(instances[TEST_SIZE:]), tuple(instances[:TEST_SIZE])


@dataclasses.dataclass(eq=False)
class CountdownConfig(tfds.core.BuilderConfig):
  """Which number counts a config holds.

  Attributes:
    counts: numbers per instance, e.g. (3,) or (3, 4).
  """

  counts: tuple[int, ...] = (3, 4)

  def instances(self, split: str) -> list[Instance]:
    """The config's instances of `split` ("train" or "test")."""
    if split not in ("train", "test"):
      raise ValueError(f"unknown split {split!r}; countdown has 'train' and 'test'")
    out: list[Instance] = []
    for count in self.counts:
      train, test = count_splits(count)
      pool = train if split == "train" else test
      out.extend(pool[:len(pool) // len(self.counts)])
    return out


class Countdown(ArrayRecordBuilder):
  """Countdown number puzzles; see the module docstring for the configs."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
      CountdownConfig(name="n3", counts=(3,), description="3 numbers"),
      CountdownConfig(name="n4", counts=(4,), description="4 numbers"),
      CountdownConfig(name="mixed", counts=(3, 4), description="3 or 4 numbers, half each"),
  ]
  DEFAULT_BUILDER_CONFIG_NAME = "mixed"

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: dataset_info_from_configs wants metadata files next to the module.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "numbers": tfds.features.Sequence(np.int64),
            "target": np.int64,
            "question": tfds.features.Text(),
            "solution": tfds.features.Text(),
        }),
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager  # nothing to download: instances are generated
    return {split: self._generate_examples(split) for split in ("train", "test")}

  def _generate_examples(self, split: str):
    for i, inst in enumerate(self.builder_config.instances(split)):
      yield i, {"numbers": list(inst.numbers), "target": inst.target,
                "question": question(inst.numbers, inst.target), "solution": inst.solution}
