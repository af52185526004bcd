"""Countdown verifier: reach the target with the given numbers and + - * /.

Model output is never passed to eval/exec. An expression is first restricted
to digits, whitespace, + - * / and parentheses, then parsed with
`ast.parse(mode="eval")` (which only parses) and accepted only if every node
is a BinOp with Add/Sub/Mult/Div or an int Constant (the game's rules: binary
+ - * / between the given numbers); unary signs, "**", "//", "%", names, calls
and attributes are all rejected. Literals are capped at
`MAX_LITERAL_DIGITS` digits and expressions at `MAX_EXPRESSION_CHARS`
characters, which bounds the size of every intermediate value, and arithmetic
is exact (`fractions.Fraction`), so (1 / 3) * 3 is 1 and 1 / 0 is invalid.

Where the expression is read from (`extract_expression`): the last
<answer>...</answer> block if there is one (its content only), else the last
line that looks like an arithmetic expression (digits and at least one
operator). Either may end with "= N"; a stated N that is not the target fails,
even when the left side is right, since the reply then asserts wrong arithmetic.
Digits are ASCII 0-9 only, as in `jaxrl_agents.rewards.answers`. Reading a
reply takes time linear in its length (one pass over the answer tags, and
trailing markup matched on the reversed line); parsing is bounded by
`MAX_EXPRESSION_CHARS`.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.rewards._checks import as_rewards, check_batch

MAX_EXPRESSION_CHARS = 200
MAX_LITERAL_DIGITS = 6

_UNICODE_OPERATORS = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "\u22c5": "*"})
_ALLOWED_CHARS_RE = re.compile(r"[0-9+\-*/() ]+")
# An operator between two operands, so a lone "-5" is not an expression line; "**" is
# matched so that "2**100" reaches the parser and is rejected there, with a reason.
_HAS_OPERATOR_RE = re.compile(r"[\d)]\s*[-+*/]+\s*[\d(-]")
# An opening or closing answer tag; `_last_answer_block` pairs them in one pass (the
# regex "<answer>(.*?)</answer>" rescans to the end from every unclosed tag, O(n^2)).
_ANSWER_TAG_RE = re.compile(r"<(/?)answer>", re.IGNORECASE)
_STATED_RESULT_RE = re.compile(r"=\s*(-?[0-9]+)\s*$")
# A stated result longer than this cannot be a target; it is kept as a value no target
# equals, without converting it (int() refuses more than 4300 digits).
_MAX_STATED_DIGITS = 12
# A label before the expression ("Answer: 3 * 8"); letters only, so no digit is lost.
_LABEL_RE = re.compile(r"^[A-Za-z][A-Za-z ]*:\s*")
# Markup around a line: math delimiters, markdown code and bold, a final period. The
# trailing markup is matched on the reversed line, from its start: a forward regex
# anchored at the end ("...$") is tried from every position, and from each position in a
# long run of "$" or "`" scans to the run's end (quadratic; seconds on 20k characters).
_LEADING_WRAPPER_RE = re.compile(r"(?:\$+|`+|\*\*|\\\(|\\\[)\s*")
_TRAILING_WRAPPER_REVERSED_RE = re.compile(r"\.?(?:\$+|`+|\*\*|\)\\|\]\\)?\s*")


class ExpressionError(ValueError):
  """An expression outside the safe arithmetic grammar, or one that cannot be evaluated."""


class ParsedExpression(NamedTuple):
  """A validated expression.

  Attributes:
    tree: the `ast` node of the expression; only whitelisted node types occur.
    numbers: its integer literals in order of appearance (the 3 of "-3" is 3).
  """

  tree: ast.expr
  numbers: tuple[int, ...]


def parse_expression(expression: str) -> ParsedExpression:
  """Parses `expression` under the safe grammar (see the module docstring).

  Raises:
    ExpressionError: naming what was rejected.
  """
  text = " ".join(expression.translate(_UNICODE_OPERATORS).split())
  if not text:
    raise ExpressionError("empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise ExpressionError(f"expression has {len(text)} characters, more than "
                          f"{MAX_EXPRESSION_CHARS}")
  if not _ALLOWED_CHARS_RE.fullmatch(text):
    bad = sorted(set(re.sub(r"[0-9+\-*/() ]", "", text)))
    raise ExpressionError(f"characters {bad} are not digits, + - * / or parentheses")
  try:
    tree = ast.parse(text, mode="eval").body
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise ExpressionError(f"not an arithmetic expression: {e}") from e
  numbers: list[int] = []
  _check_node(tree, numbers)
  return ParsedExpression(tree, tuple(numbers))


def _check_node(node: ast.AST, numbers: list[int]) -> None:
  if isinstance(node, ast.BinOp):
    if not isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
      raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
    _check_node(node.left, numbers)
    _check_node(node.right, numbers)
  elif isinstance(node, ast.Constant) and type(node.value) is int:
    if node.value >= 10**MAX_LITERAL_DIGITS:
      raise ExpressionError(f"literal {node.value} has more than {MAX_LITERAL_DIGITS} digits")
    numbers.append(node.value)
  else:
    raise ExpressionError(f"{type(node).__name__} is not allowed")


def evaluate(parsed: ParsedExpression) -> Fraction:
  """The exact value of a parsed expression.

  Raises:
    ExpressionError: on division by zero.
  """
  return _evaluate_node(parsed.tree)


def _evaluate_node(node: ast.AST) -> Fraction:
  if isinstance(node, ast.Constant):
    return Fraction(node.value)
  assert isinstance(node, ast.BinOp), "parse_expression admits no other node"
  left, right = _evaluate_node(node.left), _evaluate_node(node.right)
  if isinstance(node.op, ast.Add):
    return left + right
  if isinstance(node.op, ast.Sub):
    return left - right
  if isinstance(node.op, ast.Mult):
    return left * right
  if right == 0:
    raise ExpressionError("division by zero")
  return left / right


def evaluate_expression(expression: str) -> tuple[Fraction, tuple[int, ...]]:
  """(exact value, integer literals used) of `expression`; raises ExpressionError if invalid."""
  parsed = parse_expression(expression)
  return evaluate(parsed), parsed.numbers


def _strip_wrappers(line: str) -> str:
  """`line` without one layer of leading and of trailing markup (see _LEADING_WRAPPER_RE)."""
  leading = _LEADING_WRAPPER_RE.match(line)
  if leading:
    line = line[leading.end():]
  trailing = _TRAILING_WRAPPER_REVERSED_RE.match(line[::-1]).end()
  return line[:len(line) - trailing]


def _last_answer_block(reply: str) -> str | None:
  """Content of the last <answer>...</answer> block, or None if no block is closed.

  A block runs from an opening tag to the first closing tag after it (tags
  inside it are content), as with the lazy regex "<answer>(.*?)</answer>".
  """
  content_start, last = None, None
  for tag in _ANSWER_TAG_RE.finditer(reply):
    if not tag.group(1) and content_start is None:
      content_start = tag.end()
    elif tag.group(1) and content_start is not None:
      last, content_start = reply[content_start:tag.start()], None
  return last


def _split_stated_result(text: str, need_operator: bool) -> tuple[str, int | None] | None:
  text = " ".join(text.split())
  for _ in range(2):  # e.g. "$(1 + 2) * 3$." has two layers
    text = _strip_wrappers(text).strip()
  text = _LABEL_RE.sub("", text)
  stated = None
  match = _STATED_RESULT_RE.search(text)
  if match:
    digits = match.group(1)
    stated = int(digits) if len(digits.lstrip("-")) <= _MAX_STATED_DIGITS \
        else 10**(_MAX_STATED_DIGITS + 1)
    text = text[:match.start()].strip()
  text = text.translate(_UNICODE_OPERATORS)
  if not text or not _ALLOWED_CHARS_RE.fullmatch(text) or not re.search(r"\d", text):
    return None
  if need_operator and not _HAS_OPERATOR_RE.search(text):
    return None
  return text, stated


def extract_expression(reply: str) -> tuple[str, int | None] | None:
  """(expression, stated result or None) read from a reply, or None if there is none.

  The content of the last <answer>...</answer> block if present (nothing else
  is considered then), else the last line made only of digits, + - * /,
  parentheses and whitespace with at least one operator. Either may carry a
  label ("Answer: "), math or markdown delimiters, a final period and a
  trailing "= N" (returned as the stated result). The expression is returned
  as text; whether it parses is `parse_expression`'s business.
  """
  block = _last_answer_block(reply)
  if block is not None:
    return _split_stated_result(block, need_operator=False)
  for line in reversed(reply.splitlines()):
    found = _split_stated_result(line, need_operator=True)
    if found is not None:
      return found
  return None


def _task(reward: str, i: int, example: Mapping[str, Any]) -> tuple[Counter, Fraction]:
  numbers, target = example["numbers"], example["target"]
  if isinstance(numbers, str | bytes) or not all(
      isinstance(n, int | np.integer) and not isinstance(n, bool) for n in numbers):
    raise ValueError(f"{reward}: example {i} field 'numbers' must be a list of integers, "
                     f"got {numbers!r}")
  if not isinstance(target, int | np.integer) or isinstance(target, bool):
    raise ValueError(f"{reward}: example {i} field 'target' must be an integer, got {target!r}")
  return Counter(int(n) for n in numbers), Fraction(int(target))


def solves(reply: str, numbers: Counter, target: Fraction, use_all: bool = True) -> bool:
  """Whether `reply` gives a valid expression over `numbers` that equals `target`."""
  found = extract_expression(reply)
  if found is None:
    return False
  expression, stated = found
  if stated is not None and stated != target:
    return False
  try:
    value, used = evaluate_expression(expression)
  except ExpressionError:
    return False
  used_counts = Counter(used)
  if use_all:
    uses_ok = used_counts == numbers
  else:
    uses_ok = all(used_counts[n] <= numbers[n] for n in used_counts)
  return uses_ok and value == target


@registry.register("reward", "countdown")
def countdown_reward(completions: Sequence[str], examples: Sequence[Mapping[str, Any]], *,
                     use_all: bool = True) -> np.ndarray:
  """1 if the reply's expression is valid, uses the given numbers and equals the target.

  Each given number may be used at most as many times as it is given; with
  `use_all` (the classic game, and TinyZero's task) every number must also be
  used, i.e. each exactly as often as given.

  Args:
    completions: B decoded replies.
    examples: B examples with "numbers" (list of ints) and "target" (int).
    use_all: require every given number to be used.

  Returns:
    f32[B] in {0, 1}.
  """
  check_batch("countdown", completions, examples, fields=("numbers", "target"))
  tasks = [_task("countdown", i, ex) for i, ex in enumerate(examples)]
  return as_rewards([float(solves(c, numbers, target, use_all))
                     for c, (numbers, target) in zip(completions, tasks, strict=True)])


@registry.register("reward", "countdown_format")
def countdown_format_reward(completions: Sequence[str],
                            examples: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
  """1 if an expression can be extracted from the reply and passes the safe parser.

  Numbers, target and the value are not checked ("1 / 0" passes: it parses).

  Args:
    completions: B decoded replies.
    examples: B examples (unused; checked for length when given).

  Returns:
    f32[B] in {0, 1}.
  """
  check_batch("countdown_format", completions, examples)
  scores = []
  for completion in completions:
    found = extract_expression(completion)
    try:
      ok = found is not None and parse_expression(found[0]) is not None
    except ExpressionError:
      ok = False
    scores.append(float(ok))
  return as_rewards(scores)
