"""A calculator tool for multiplication the model cannot do in its head (a host environment).

Task: "What is A * B?" with A, B of `digits` digits (with `example`, the
question shows one worked call). Each turn the agent either calls the tool or
answers:

  <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

The last complete <tool_call>...</tool_call> of a reply is the call; its JSON
must name "calculator" and give an "expression" of digits, + - * / and
parentheses, which `rewards.countdown.evaluate_expression` parses (never
eval; exact arithmetic, bounded size). The tool's answer (the value, or
"Error: ...") is the next user message. A reply without a tool call is the
final answer, read as `math_strict` reads one: reward 1 when it equals A * B,
and the episode ends. Counted per step in `info`: tool_call, tool_error,
success.

Reading a reply is linear in its length (the tag search is one pass with
`str.rfind`; the JSON between the tags is at most MAX_CALL_CHARS characters).
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.envs import base
from jaxrl_agents.rewards import answers, countdown

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 1000


def tool_call(reply: str) -> str | None:
  """The text inside the reply's last complete <tool_call>...</tool_call>, else None."""
  return base.last_between(reply, OPEN, CLOSE)


def run_call(call: str) -> str:
  """The calculator's answer to a tool call's JSON text: the value, or "Error: ..."."""
  if len(call) > MAX_CALL_CHARS:
    return f"Error: the tool call is longer than {MAX_CALL_CHARS} characters."
  try:
    request = json.loads(call)
  except json.JSONDecodeError as e:
    return f"Error: the tool call is not JSON ({e.msg})."
  if not isinstance(request, dict) or request.get("name") != "calculator":
    return 'Error: call the tool as {"name": "calculator", "arguments": {"expression": ...}}.'
  arguments = request.get("arguments")
  expression = arguments.get("expression") if isinstance(arguments, dict) else None
  if not isinstance(expression, str):
    return 'Error: the arguments need an "expression" string.'
  try:
    value, _ = countdown.evaluate_expression(expression)
  except countdown.ExpressionError as e:
    return f"Error: {e}."
  return _show(value)


def _show(value: Fraction) -> str:
  if value.denominator == 1:
    return str(value.numerator)
  return f"{value.numerator / value.denominator:.6g}"


def call_text(expression: str) -> str:
  """A tool call of the calculator, as the agent should write it."""
  return f"{OPEN}{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}" \
      f"{CLOSE}"


class CalculatorEpisode:
  """One question and its calls."""

  def __init__(self, a: int, b: int, example: bool):
    self.a, self.b, self.example = a, b, example

  def reset(self) -> str:
    how = (f"For example, for 12 * 34 you would write {call_text('12 * 34')} and I would "
           "reply 408. " if self.example else "")
    return (f"What is {self.a} * {self.b}? You may use a calculator: write "
            f"{call_text('...')} and I will reply with the value. {how}When you know the "
            "answer, reply with just the number.")

  def step(self, reply: str) -> base.HostStep:
    call = tool_call(reply)
    if call is not None:
      answer = run_call(call)
      return base.HostStep(obs=answer, reward=0.0, done=False,
                           info={"tool_call": 1.0, "tool_error": float(answer.startswith("Error")),
                                 "success": 0.0})
    correct = answers.strict_answer(reply) == self.a * self.b
    return base.HostStep(obs="", reward=float(correct), done=True,
                         info={"tool_call": 0.0, "tool_error": 0.0, "success": float(correct)})


# The worked examples' questions: their own stream, not the held-out one (env_loop.EVAL_TASKS_KEY).
DEMONSTRATION_SEED = 7


def demonstration(a: int, b: int, example: bool) -> list[dict[str, str]]:
  """One episode played right, as chat messages: the question, the call, the value, the
  answer."""
  value = str(a * b)
  return [{"role": "user", "content": CalculatorEpisode(a, b, example).reset()},
          {"role": "assistant", "content": call_text(f"{a} * {b}")},
          {"role": "user", "content": value},
          {"role": "assistant", "content": value}]


class Calculator:
  """The environment: questions of `digits`-digit factors (a host environment).

  `demonstrations` worked episodes go before every question as earlier chat turns
  (`preamble`): a 135M model copies the call's format from a conversation it has
  seen, where a format described in the question alone it does not write at all.
  """

  host = True

  def __init__(self, tokenizer=None, *, digits: int = 3, example: bool = True,
               demonstrations: int = 0):
    del tokenizer  # observations are text; the loop tokenizes them
    if not 1 <= digits <= 6:
      raise ValueError(f"calculator: digits must be in [1, 6], got {digits}")
    if not 0 <= demonstrations <= 8:
      raise ValueError(f"calculator: demonstrations must be in [0, 8], got {demonstrations}")
    self.digits, self.example = digits, example
    rng = np.random.default_rng(DEMONSTRATION_SEED)
    shown = [self.sample_task(rng) for _ in range(demonstrations)]
    self.preamble = tuple(m for t in shown for m in demonstration(t["a"], t["b"], example))

  def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
    low, high = 10 ** (self.digits - 1), 10 ** self.digits
    return {"a": int(rng.integers(low, high)), "b": int(rng.integers(low, high))}

  def answer(self, task: dict[str, Any]) -> str:
    """The product, the final answer (IGPO's information gain scores it)."""
    return str(int(task["a"]) * int(task["b"]))

  def episode(self, task: dict[str, Any]) -> CalculatorEpisode:
    return CalculatorEpisode(int(task["a"]), int(task["b"]), self.example)


@registry.register("env", "calculator")
def make(tokenizer, **options) -> Calculator:
  """A calculator tool for products the model cannot do in its head (host)."""
  return Calculator(tokenizer, **options)
