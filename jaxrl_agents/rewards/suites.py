"""Rewards graded by third-party suites' own scorers, and multiple-choice letters.

| name                   | score                                                                 |
|------------------------|-----------------------------------------------------------------------|
| reasoning_gym          | the task's own `score_answer` on the last `<answer>...</answer>`      |
| reasoning_gym_lenient  | the same on the tagged answer, else on the last line's statement      |
| reasoning_gym_solved   | 1 where `reasoning_gym` gives full credit (a grader: accuracy)        |
| reasoning_gym_solved_lenient | 1 where `reasoning_gym_lenient` gives full credit               |
| reasoning_gym_solved_exact | 1 where the whole reply, alone on one line, gets full credit      |
| multiple_choice        | 1 when the reply ends stating a letter ("Answer: B") equal to "answer" |
| multiple_choice_lenient| 1 when the last standalone letter A-D equals "answer"                  |

reasoning-gym's examples (`data/suites.py`) carry the "metadata" its scorers read; the
scorer is the one of `metadata["source_dataset"]`, so a mix of tasks is scored task by
task. Many scorers give partial credit (the default gives len(answer) / len(reply's answer)
when the right answer is a substring: "91" for "9" scores 0.5): a reward may use it, a
held-out accuracy counts the full-credit answers (`reasoning_gym_solved`).
reasoning-gym's own extraction (`reasoning_gym.utils.extract_answer`) is a regex
that rescans the reply from each `<answer>` (quadratic on a reply of many opening
tags); `tagged_answer` reads the same tag in one pass: the text between the last
`</answer>` and the last `<answer>` before it (they differ only on nested tags). An answer
longer than `MAX_ANSWER_CHARS` scores 0 without reaching the scorer, and the tasks whose
scorer evaluates its input as code are refused (`data.suites.unsafe_scorers`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.rewards._checks import as_rewards, check_batch

MAX_ANSWER_CHARS = 4096
LETTERS = "ABCD"
# The last characters of a reply a final "Answer: X" statement is looked for in.
_FINAL_WINDOW = 256
_FINAL_LETTER_RE = re.compile(
    r"\banswer\b[^\n]{0,20}?(?:\bis\b|:)\s*+[*_`(\[]*+([A-D])\b[)\]*_`.]*+\s*+$", re.IGNORECASE)
_LETTER_RE = re.compile(r"(?<![A-Za-z])([A-D])(?![A-Za-z])")


def tagged_answer(text: str, tag: str = "answer") -> str | None:
  """The stripped text between the last `</tag>` and the last `<tag>` before it; None
  without one. Linear in the reply's length."""
  close = text.rfind(f"</{tag}>")
  if close < 0:
    return None
  start = text.rfind(f"<{tag}>", 0, close)
  if start < 0:
    return None
  return text[start + len(tag) + 2:close].strip()


_STATEMENT_MARKERS = ("answer is", "answer:", "=")
_WRAPPING = " \t*`\"'$"


def last_line(text: str) -> str | None:
  """The answer a reply's last non-empty line states: the text after its last "answer is",
  "answer:" (any case) or "=", when it has one, else the whole line; markdown, quotes and a
  final period around it removed. "The answer is 6." and "3 * 4 = 12" read "6" and "12"."""
  text = text.rstrip()
  line = text[text.rfind("\n") + 1:].strip()
  if not line:
    return None
  lowered = line.lower()
  cut = max(lowered.rfind(m) + len(m) if lowered.rfind(m) >= 0 else -1
            for m in _STATEMENT_MARKERS)
  if cut >= 0:
    line = line[cut:]
  line = line.strip(_WRAPPING)
  if line.endswith("."):
    line = line[:-1].strip(_WRAPPING)
  return line or None


def tagged_or_last_line(text: str) -> str | None:
  """The tagged answer, else what the last line states (the lenient reading)."""
  return tagged_answer(text) or last_line(text)


def whole_reply(text: str) -> str | None:
  """The reply itself when it is one line (markdown, quotes and a final period around it
  removed): the strict reading of a prompt that asks for just the answer. "12." and
  "**Yes**" read "12" and "Yes"; "The answer is 12." reads itself (a scorer gives it
  nothing); a reply of several lines reads None."""
  text = text.strip()
  if not text or "\n" in text:
    return None
  text = text.strip(_WRAPPING)
  if text.endswith("."):
    text = text[:-1].strip(_WRAPPING)
  return text or None


@functools.cache
def _scorer(task: str):
  from jaxrl_agents.data import suites

  if task in suites.unsafe_scorers():
    raise ValueError(f"reasoning-gym's scorer of {task!r} evaluates the answer as code; "
                     "it is not run on a model's replies (data/suites.py)")
  reasoning_gym = suites._require("reasoning_gym")
  return reasoning_gym.get_score_answer_fn(task)


def _score(read, reward: str, completions: Sequence[str],
           examples: Sequence[Mapping[str, Any]]) -> list[float]:
  check_batch(reward, completions, examples, fields=("answer", "metadata"))
  scores = []
  for i, (completion, example) in enumerate(zip(completions, examples, strict=True)):
    task = example["metadata"].get("source_dataset")
    if not task:
      raise ValueError(f"{reward}: example {i} has no metadata['source_dataset'] (not a "
                       "reasoning-gym example)")
    answer = read(completion)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
      scores.append(0.0)
      continue
    scorer = _scorer(task)  # outside the try: an unsafe scorer is an error, not a 0
    try:
      score = float(scorer(answer, dict(example)))
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError, AttributeError,
            RecursionError):
      score = 0.0  # a scorer that cannot read the answer gives it nothing
    scores.append(min(max(score, 0.0), 1.0))
  return scores


@registry.register("reward", "reasoning_gym")
def reasoning_gym_reward(completions: Sequence[str],
                         examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """The example's reasoning-gym task scoring the reply's last `<answer>` tag (0 without).

  Returns:
    f32[B] in [0, 1] (some scorers give partial credit).
  """
  return as_rewards(_score(tagged_answer, "reasoning_gym", completions, examples))


@registry.register("reward", "reasoning_gym_lenient")
def reasoning_gym_lenient_reward(completions: Sequence[str],
                                 examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """`reasoning_gym`, reading what the last line states where the reply has no `<answer>` tag."""
  return as_rewards(_score(tagged_or_last_line, "reasoning_gym_lenient", completions,
                          examples))


@registry.register("reward", "reasoning_gym_solved")
def reasoning_gym_solved_reward(completions: Sequence[str],
                                examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 where `reasoning_gym` gives full credit, else 0: the grader of a held-out accuracy."""
  # full credit read before the float32 cast, which rounds 0.99999999 up to 1
  return as_rewards(np.asarray(_score(tagged_answer, "reasoning_gym_solved", completions,
                                      examples)) >= 1.0)


@registry.register("reward", "reasoning_gym_solved_lenient")
def reasoning_gym_solved_lenient_reward(completions: Sequence[str],
                                        examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 where `reasoning_gym_lenient` gives full credit, else 0."""
  return as_rewards(np.asarray(_score(tagged_or_last_line, "reasoning_gym_solved_lenient",
                                      completions, examples)) >= 1.0)


@registry.register("reward", "reasoning_gym_solved_exact")
def reasoning_gym_solved_exact_reward(completions: Sequence[str],
                                      examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 where the task's scorer gives full credit to the whole reply (`whole_reply`), else 0:
  the strict grader of a prompt that asks for just the answer."""
  return as_rewards(np.asarray(_score(whole_reply, "reasoning_gym_solved_exact", completions,
                                      examples)) >= 1.0)


def strict_letter(text: str) -> str | None:
  """The letter of a final statement ending the reply ("The answer is (B).", "Answer: B"),
  or a reply that is only the letter."""
  bare = text.strip().strip("().*[] ")
  if len(bare) == 1 and bare in LETTERS:
    return bare
  match = _FINAL_LETTER_RE.search(text.rstrip()[-_FINAL_WINDOW:])
  return match.group(1).upper() if match else None


def lenient_letter(text: str) -> str | None:
  """The last standalone capital A-D in the reply."""
  found = _LETTER_RE.findall(text)
  return found[-1] if found else None


def _letters(read, reward: str, completions, examples) -> np.ndarray:
  check_batch(reward, completions, examples, fields=("answer",))
  return as_rewards([float(read(c) == str(e["answer"]).strip().upper())
                     for c, e in zip(completions, examples, strict=True)])


@registry.register("reward", "multiple_choice")
def multiple_choice_reward(completions: Sequence[str],
                           examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 if the reply states its final choice (see `strict_letter`) and it is example["answer"]."""
  return _letters(strict_letter, "multiple_choice", completions, examples)


@registry.register("reward", "multiple_choice_lenient")
def multiple_choice_lenient_reward(completions: Sequence[str],
                                   examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 if the last standalone letter A-D of the reply is example["answer"]."""
  return _letters(lenient_letter, "multiple_choice_lenient", completions, examples)
