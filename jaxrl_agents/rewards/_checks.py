"""Input checks shared by the reward functions.

Rewards run on the host over decoded strings, far from where a batch was
assembled, so a misaligned batch must fail loudly with the reward, field and
index named instead of silently scoring completion i against example j.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def check_batch(
    reward: str,
    completions: Sequence[str],
    examples: Sequence[Mapping[str, Any]] | None,
    fields: Sequence[str] = (),
) -> None:
  """Raises if `completions` and `examples` do not form one aligned batch.

  Args:
    reward: the reward's registered name, used in messages.
    completions: B decoded completions.
    examples: B task examples, or None for rewards that read no field.
    fields: keys every example must hold.

  Raises:
    TypeError: `completions` is a bare string (a str is a Sequence, so it would
      otherwise be scored character by character), an element is not a str, or
      `examples` is a single mapping instead of a sequence of them.
    ValueError: the lengths differ, or an example lacks one of `fields`.
  """
  if isinstance(completions, str | bytes):
    raise TypeError(f"{reward}: completions must be a sequence of strings, not a single "
                    f"{type(completions).__name__}")
  for i, completion in enumerate(completions):
    if not isinstance(completion, str):
      raise TypeError(f"{reward}: completion {i} is a {type(completion).__name__}, not a str")
  if examples is None:
    if fields:
      raise ValueError(f"{reward}: needs examples with field(s) {list(fields)}, got None")
    return
  if isinstance(examples, Mapping):
    # A column-major batch ({"answer": [...]}) would report its number of keys as its length.
    raise TypeError(f"{reward}: examples must be a sequence of per-example mappings, got one "
                    f"mapping with keys {sorted(examples)}")
  if len(completions) != len(examples):
    raise ValueError(f"{reward}: got {len(completions)} completions but {len(examples)} examples")
  for i, example in enumerate(examples):
    if not isinstance(example, Mapping):
      raise TypeError(f"{reward}: example {i} is a {type(example).__name__}, not a mapping")
    for field in fields:
      if field not in example:
        raise ValueError(f"{reward}: example {i} lacks field {field!r} "
                         f"(has {sorted(map(str, example))})")


def as_rewards(values: Sequence[float]) -> np.ndarray:
  """The f32[B] array every reward returns."""
  return np.asarray(values, dtype=np.float32).reshape(-1)
