"""How rollout lengths are rounded, so a run compiles a handful of programs, not one per step.

Every array shape under jit is a compiled program; lengths that vary with the
data are rounded to a few values. The rules, each for a reason:

- `prompt_width`: prompts are left-padded to a multiple of 16. A task's prompts
  vary by a few tokens, so this gives one or two shapes per run while padding
  far less than powers of two (a 46-token SmolLM2 chat prompt pads to 48, not 64).
- `prefix_width`: a prefix shared by every prompt (the chat template's system
  prompt) is rounded down to a multiple of 8, so its length does not change
  with the first words of the questions.
- `power_of_two`: batch sizes, token budgets and the completion columns an
  update trains on (the longest completion) round up to a power of two.
- `half_octave`: the packed reply tokens of a GRPO update (`config.pack_replies`)
  round up to a power of two or 1.5 times one: at most a third of padding, and
  a handful of compiled programs as replies shorten over a run.
"""

from __future__ import annotations

import math

PROMPT_MULTIPLE = 16
PREFIX_MULTIPLE = 8


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= n."""
  return -(-n // multiple) * multiple


def prompt_width(longest: int, multiple: int = PROMPT_MULTIPLE) -> int:
  """Columns of a left-padded prompt batch whose longest prompt has `longest` tokens."""
  return round_up(max(longest, 1), multiple)


def prefix_width(common: int, multiple: int = PREFIX_MULTIPLE) -> int:
  """The length of a shared prefix of `common` tokens that is actually shared: rounded down."""
  return common - common % multiple


def power_of_two(n: int, minimum: int = 16) -> int:
  """n rounded up to the next power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def half_octave(n: int, minimum: int = 16) -> int:
  """n rounded up to the next of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5 times
  them), at least `minimum`."""
  p = power_of_two(n, minimum)
  return max(minimum, p * 3 // 4) if n <= p * 3 // 4 else p


def half_octaves_below(n: int, count: int, minimum: int = 16) -> list[int]:
  """The `count` largest `half_octave` values under n, largest first, none under
  `half_octave(minimum)`: the slot counts a packed batch moves down to as replies shorten."""
  values, v = [], half_octave(minimum, minimum)
  while v < n:
    values.append(v)
    v = half_octave(v + 1, minimum)
  return values[::-1][:count]
