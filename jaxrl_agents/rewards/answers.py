r"""Verifiers for math word problems whose answer is a number (GSM8K-style tasks).

Hand-written rather than built on `math-verify` (installable here) because
these answers are integers, where its LaTeX/sympy equivalence machinery adds
two pinned dependencies and SIGALRM timeouts (main thread only) without
expressing the strict "answer stated explicitly" rule below.

Three graders, from strict to lenient, all comparing numbers exactly as
rationals (`fractions.Fraction`, no float tolerance):

* "math_strict": the reply must state its final answer explicitly: the whole
  reply is the number, or it holds \boxed{N}, or it ends with a final statement
  ("... answer is N", "Answer: N", "= N", "#### N").
* "math_lenient": the boxed content when present, else the last number.
* "last_integer": the last integer written in the reply (a common TRL GSM8K
  baseline grader: "1 if the last integer of the reply is the answer").

Number syntax (choices shared by every grader, so they disagree only on
*which* number they read):

* "12", "+12", "12.0" and "12.00" are all 12; "12.5" is not 12.
* Commas are thousands separators only in well-formed groups of three:
  "1,234" and "12,345,678" are single numbers, while "1,2" and "1,2345" are
  read as two numbers (a list, "1" then "2"), never as 12 or as the European
  decimal 1.2, which are both guesses.
* A leading "-" (or the Unicode minus) is a sign only where it cannot be a
  binary minus: "x = -5" reads -5, "10-5" reads 10 then 5.
* Scientific notation, fractions ("1/2", "\frac{1}{2}") and words ("twelve")
  are not numbers here.
* What counts as a digit: the ASCII characters 0-9 and nothing else.
  Arabic-Indic ("\u0665"), fullwidth ("\uff15"), superscript ("\u00b2") and
  every other Unicode digit is text, not part of a number (a reply written in
  them states no answer), although `str.isdigit` and the regex `\d` accept them.
* A number of more than `MAX_NUMBER_DIGITS` digits is not a number here (no
  answer has that many; Python refuses to convert more than 4300 digits).

Every reader runs in time linear in the reply's length, whatever it holds
(tests/test_reward_properties.py checks this on hostile replies). Numbers
are found by one left-to-right scan (`_numbers`) that reads exactly what
`_NUMBER_RE.finditer` would: the regex itself rescans a malformed run of k
comma groups ("1,234,234,...,5") from each group, O(k^2). \boxed{} contents
come from one pass over the braces with a stack of open ones (`extract_boxed`),
not one forward scan per opening. A final statement is looked for in the last
`FINAL_STATEMENT_WINDOW` characters of the reply (trailing whitespace removed
first), with possessive quantifiers where a long run of whitespace or markup
would otherwise make the regex backtrack (it took minutes on 1000 spaces).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.rewards._checks import as_rewards, check_batch

# Digits with optional well-formed thousands groups and an optional decimal
# part. The lookaheads stop "1,2345" from being read as "1,234" then "5", and
# "1,234,5" as "1,234" then "5": a malformed grouping is read as a list.
_UNSIGNED = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?!,[0-9])|[0-9]+)(?:\.[0-9]+)?"
# A sign counts only when the previous character cannot end an operand, so the
# minus of "10-5" or "f(x)-3" stays a binary operator.
_SIGNED = r"(?:(?<![\w)\]}])[-+\u2212])?" + _UNSIGNED
# The numbers of a reply are what _NUMBER_RE.finditer reads; `_numbers` reads the
# same in linear time (tests/test_reward_properties.py compares the two).
_NUMBER_RE = re.compile(_SIGNED)
_BARE_NUMBER_RE = re.compile(r"[-+\u2212]?" + _UNSIGNED)
# The pieces `_numbers` scans with: possessive, so none of them backtracks.
_DIGIT_RUN_RE = re.compile(r"[0-9]++")
_GROUPS_RE = re.compile(r"(?:,[0-9]{3})++")
_MALFORMED_GROUP_END_RE = re.compile(r",?[0-9]")
_DECIMALS_RE = re.compile(r"\.[0-9]++")
_OPERAND_END_RE = re.compile(r"[\w)\]}]")
_SIGNS = "-+\u2212"
_ASCII_DIGITS = "0123456789"

# Markup a model may wrap around a final number: markdown bold/code, $...$,
# \(...\), \[...\].
_DECOR = r"(?:\*\*|\*|`|\$|\\\$|\\\(|\\\)|\\\[|\\\])*+"
# An explicit final statement at the very end of the reply. "answer" may be
# followed by a few words ("the answer to the question is 7", "Final answer: 7").
_FINAL_STATEMENT_RE = re.compile(
    r"(?:\banswer\b[^\n0-9=:]{0,30}?(?:\bis\b\s*+:?|:)|=|####)\s*+" + _DECOR + r"\s*+"
    r"(?P<number>[-+\u2212]?" + _UNSIGNED + r")\s*+" + _DECOR + r"\s*+\.?\s*+" + _DECOR
    + r"\s*+$",
    re.IGNORECASE,
)
# The whitespace, markup and period runs after the number use disjoint characters,
# so the possessive quantifiers above match the same replies as greedy ones would,
# without trying every split of a long run between them.
FINAL_STATEMENT_WINDOW = 1024
MAX_NUMBER_DIGITS = 100
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
# A box opening (its brace included) or a lone brace, for `extract_boxed`'s single pass.
_BRACE_RE = re.compile(_BOXED_RE.pattern + r"|[{}]")
# LaTeX and markup that may surround a number inside \boxed{...}. "%" goes too:
# GSM8K writes percentages as the bare number.
_BOXED_NOISE_RE = re.compile(r"\\[,!;: ]|\\\$|\$|\\%|%|\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|[{}]")


def extract_boxed(text: str) -> str | None:
  r"""Content of the last complete \boxed{...} (or \fbox{...}) in `text`.

  Braces nest: "\boxed{\frac{1}{2}}" gives "\frac{1}{2}". A \boxed{ whose
  brace is never closed (a truncated reply) is skipped in favour of the
  previous complete one. "Last" is by opening: in "\boxed{\boxed{1}}" it is
  the inner box.

  One left-to-right pass with a stack of the open braces, so linear in
  `text` even with thousands of unclosed boxes: a brace closes the most
  recent open one, which is how each box's own count of depth matches too.

  Returns:
    The content between the braces, or None if there is no complete box.
  """
  open_braces: list[int | None] = []  # content start of each open box, None for a plain "{"
  last = None  # (content start, end) of the complete box opened last
  for match in _BRACE_RE.finditer(text):
    if match.group() != "}":
      open_braces.append(match.end() if match.group() != "{" else None)
    elif open_braces:
      start = open_braces.pop()
      if start is not None and (last is None or start > last[0]):
        last = (start, match.start())
  return text[last[0]:last[1]] if last is not None else None


def count_boxed(text: str) -> int:
  r"""Number of \boxed{ (or \fbox{) openings in `text`, nested ones included."""
  return len(_BOXED_RE.findall(text))


def parse_number(text: str) -> Fraction | None:
  """The exact value of `text` if it is one number (see the module docstring), else None.

  Surrounding whitespace is ignored; nothing else is ("$12" and "12." are not
  numbers here; `strict_answer` and `lenient_answer` strip such markup).
  """
  text = text.strip()
  if sum(map(text.count, _ASCII_DIGITS)) > MAX_NUMBER_DIGITS \
      or not _BARE_NUMBER_RE.fullmatch(text):
    return None
  return Fraction(text.replace(",", "").replace("\u2212", "-"))


def _numbers(text: str) -> Iterator[str]:
  """Every number written in `text`, left to right, as written (see the module docstring).

  Reads exactly what `_NUMBER_RE.finditer` reads, in one pass. Grouping is
  tried from the first digit run of a number only: when a run of comma
  groups is malformed at its end, the regex would read its first digits and
  then try grouping again from every later group of the run, scanning to the
  same bad end each time; here the bad end is remembered instead.
  """
  pos = 0
  malformed_until = -1  # groups starting before this end in a malformed run
  while (run := _DIGIT_RUN_RE.search(text, pos)) is not None:
    start, end = run.span()
    if end - start <= 3 and start >= malformed_until:
      groups = _GROUPS_RE.match(text, end)
      if groups and _MALFORMED_GROUP_END_RE.match(text, groups.end()):
        malformed_until = groups.end()
      elif groups:
        end = groups.end()
    decimals = _DECIMALS_RE.match(text, end)
    if decimals:
      end = decimals.end()
    if start > 0 and text[start - 1] in _SIGNS \
        and not (start > 1 and _OPERAND_END_RE.match(text, start - 2)):
      start -= 1
    yield text[start:end]
    pos = end


def last_number(text: str) -> str | None:
  """The last number (integer or decimal, optionally signed) written in `text`, as written."""
  numbers = list(_numbers(text))
  return numbers[-1] if numbers else None


def last_integer(text: str) -> str | None:
  """The last integer written in `text`, as written.

  Decimals are skipped whole, not split: "3.5" contributes no integer (the
  naive `-?\\d+` reads "5"), so "it costs 7, or 3.5 each" gives "7".
  """
  last = None
  for number in _numbers(text):
    if "." not in number:
      last = number
  return last


def numbers_equal(a: str | int | Fraction | None, b: str | int | Fraction | None) -> bool:
  """Exact equality of two numbers given as strings (parsed with `parse_number`) or values.

  Unparseable strings and None are never equal to anything, including each other.
  """
  va, vb = _value(a), _value(b)
  return va is not None and vb is not None and va == vb


def _value(x: str | int | Fraction | None) -> Fraction | None:
  if x is None or isinstance(x, bool):
    return None
  if isinstance(x, int | Fraction):
    return Fraction(x)
  return parse_number(x)


def _boxed_value(text: str) -> Fraction | None:
  boxed = extract_boxed(text)
  if boxed is None:
    return None
  return reply_as_number(_BOXED_NOISE_RE.sub("", boxed))


def reply_as_number(text: str) -> Fraction | None:
  """The value of a reply that is only a number, up to whitespace and one trailing period."""
  text = text.strip()
  if text.endswith("."):
    text = text[:-1]
  return parse_number(text)


def strict_answer(text: str) -> Fraction | None:
  r"""The explicitly stated final answer of a reply, or None if it never states one.

  In order: the last \boxed{} (if a box is present it decides, even when its
  content is not a number); the whole reply if it is a bare number; a final
  statement ending the reply ("The answer is 42.", "Answer: **42**",
  "2 + 40 = 42", "#### 42"). Trailing words ("42 apples") are not a final
  statement.
  """
  if count_boxed(text):
    return _boxed_value(text)
  bare = reply_as_number(text)
  if bare is not None:
    return bare
  match = _FINAL_STATEMENT_RE.search(text.rstrip()[-FINAL_STATEMENT_WINDOW:])
  return parse_number(match.group("number")) if match else None


def lenient_answer(text: str) -> Fraction | None:
  """The boxed content if it is a number, else the last number in the reply."""
  boxed = _boxed_value(text)
  if boxed is not None:
    return boxed
  last = last_number(text)
  return parse_number(last) if last is not None else None


def _reference_answers(reward: str, examples: Sequence[Mapping[str, Any]]) -> list[Fraction]:
  answers = []
  for i, example in enumerate(examples):
    raw = example["answer"]
    value = _value(raw if isinstance(raw, int | Fraction) else str(raw))
    if value is None:
      # A dataset bug, not a model error: every completion would silently score 0.
      raise ValueError(f"{reward}: example {i} field 'answer' is not a number: "
                       f"{example['answer']!r}")
    answers.append(value)
  return answers


def _grade(reward: str, read, completions: Sequence[str],
           examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  check_batch(reward, completions, examples, fields=("answer",))
  answers = _reference_answers(reward, examples)
  return as_rewards([float(read(c) == a) for c, a in zip(completions, answers, strict=True)])


@registry.register("reward", "math_strict")
def math_strict_reward(completions: Sequence[str],
                       examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 if the reply states its final answer explicitly and it equals example["answer"].

  See `strict_answer`. A verbose reply whose last number happens to be right
  but that never states an answer scores 0.

  Args:
    completions: B decoded replies.
    examples: B examples with an "answer" field (an integer, or a string of one).

  Returns:
    f32[B] in {0, 1}.
  """
  return _grade("math_strict", strict_answer, completions, examples)


@registry.register("reward", "math_lenient")
def math_lenient_reward(completions: Sequence[str],
                        examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 if the boxed content (when it is a number) or else the last number equals the answer.

  Args:
    completions: B decoded replies.
    examples: B examples with an "answer" field.

  Returns:
    f32[B] in {0, 1}.
  """
  return _grade("math_lenient", lenient_answer, completions, examples)


def _last_integer_value(text: str) -> Fraction | None:
  last = last_integer(text)
  return parse_number(last) if last is not None else None


@registry.register("reward", "last_integer")
def last_integer_reward(completions: Sequence[str],
                        examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """1 if the last integer of the reply equals the answer (see `last_integer`).

  Boxes are not preferred and decimals are ignored: "12.0" does not count as 12.

  Args:
    completions: B decoded replies.
    examples: B examples with an "answer" field.

  Returns:
    f32[B] in {0, 1}.
  """
  return _grade("last_integer", _last_integer_value, completions, examples)
