"""Guess the number: the environment names a range, the agent guesses, it answers higher or lower.

The smallest multi-turn task where later turns must use earlier feedback: a
policy that ignores it guesses at random (success about K / range in K turns),
one that bisects always wins within ceil(log2(range + 1)) turns. Pure JAX:
the target is the task, every reply is read with `base.last_number` and every
observation is one of four pieces tokenized when the environment is made.

`answer(task)` is the number's text: IGPO's information gain (GRPO's
turn_credit "igpo") rewards a turn by how much the answer it drew raised the
policy's own probability of naming the number.

Reward: 1 on the turn the guess is right (the episode ends), else 0. A reply
without a number is an invalid action (counted in info["invalid"]); it costs a
turn and is told to answer with a number.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.envs import base

HIGHER, LOWER, CORRECT, INVALID = range(4)


def prompt_text(low: int, high: int) -> str:
  return (f"I am thinking of a whole number from {low} to {high}. Guess it: answer with just "
          "the number, and I will tell you whether mine is higher or lower.")


def reply_texts(low: int, high: int) -> list[str]:
  """The answers, indexed HIGHER, LOWER, CORRECT, INVALID."""
  return ["Higher.", "Lower.", "Correct!", f"Answer with just a number from {low} to {high}."]


class State(NamedTuple):
  target: jax.Array  # int32[]
  # The numbers still possible given the answers so far (the agent's state of
  # knowledge): what `state_key` and `potential` read.
  low: jax.Array  # int32[]
  high: jax.Array  # int32[]


class GuessNumber:
  """The environment (see the module docstring); `low`..`high` inclusive."""

  def __init__(self, tokenizer, *, low: int = 1, high: int = 16):
    self.check_range(low, high)
    self.low, self.high = low, high
    self.prompt = base.piece_table(tokenizer, [prompt_text(low, high)])
    self.replies = base.piece_table(tokenizer, reply_texts(low, high))
    self.obs_width = self.replies.ids.shape[-1]
    self.reader = base.number_reader(tokenizer)
    self.numbers = base.piece_table(tokenizer, [str(n) for n in range(low, high + 1)])

  @staticmethod
  def check_range(low: int, high: int) -> None:
    if not 0 <= low < high < base.NUMBER_CAP:
      raise ValueError(f"guess_number needs 0 <= low < high < {base.NUMBER_CAP}, "
                       f"got low={low}, high={high}")

  def sample_task(self, key: jax.Array) -> jax.Array:
    return jax.random.randint(key, (), self.low, self.high + 1, dtype=jnp.int32)

  def reset(self, key: jax.Array, task: jax.Array) -> tuple[State, base.Tokens]:
    del key  # the task decides everything
    return State(target=jnp.asarray(task, jnp.int32), low=jnp.int32(self.low),
                 high=jnp.int32(self.high)), base.row(self.prompt, 0)

  def answer(self, task: jax.Array) -> base.Tokens:
    """The gold answer, the number as digits (IGPO's information gain scores it)."""
    return base.row(self.numbers, task - self.low)

  def state_key(self, state: State) -> jax.Array:
    """The interval still possible: two turns from the same interval are the same state."""
    return state.low * (self.high + 1) + state.high

  def potential(self, state: State) -> jax.Array:
    """-log2(numbers still possible) / log2(numbers in the range): -1 at the start, 0 when
    one number is left (the bits of information still missing, as a fraction)."""
    left = (state.high - state.low + 1).astype(jnp.float32)
    return -jnp.log2(jnp.maximum(left, 1.0)) / jnp.log2(float(self.high - self.low + 1))

  def step(self, state: State, action: base.Tokens) -> base.EnvStep:
    guess, found = base.last_number(self.reader, action)
    correct = found & (guess == state.target)
    reply = jnp.where(~found, INVALID, jnp.where(correct, CORRECT,
                                                 jnp.where(guess < state.target, HIGHER, LOWER)))
    higher, lower = found & (guess < state.target), found & (guess > state.target)
    state = state._replace(
        low=jnp.where(higher, jnp.maximum(state.low, guess + 1), state.low),
        high=jnp.where(lower, jnp.minimum(state.high, guess - 1), state.high))
    return base.EnvStep(
        state=state, obs=base.row(self.replies, reply), reward=correct.astype(jnp.float32),
        done=correct, info={"invalid": (~found).astype(jnp.float32),
                            "success": correct.astype(jnp.float32)})


@registry.register("env", "guess_number")
def make(tokenizer, **options) -> GuessNumber:
  """Guess the number in a range from higher / lower feedback (JAX, lax.scan)."""
  return GuessNumber(tokenizer, **options)


class HostGuessNumber:
  """The same game as a host environment: the same texts and rules, stepped in Python on
  the decoded reply (`rollout.host_loop`). It plays the episodes the scan plays, token for
  token (tests/test_host_loop.py), so `benchmarks/multiturn.py` times the host loop
  against the scan on one game."""

  host = True

  def __init__(self, tokenizer=None, *, low: int = 1, high: int = 16):
    del tokenizer  # observations are text; the loop tokenizes them
    GuessNumber.check_range(low, high)
    self.low, self.high = low, high

  def sample_task(self, rng: np.random.Generator) -> int:
    return int(rng.integers(self.low, self.high + 1))

  def answer(self, target) -> str:
    return str(int(target))

  def episode(self, target) -> _HostEpisode:
    return _HostEpisode(int(target), self.low, self.high)


class _HostEpisode:
  def __init__(self, target: int, low: int, high: int):
    self.target, self.low, self.high = target, low, high

  def reset(self) -> str:
    return prompt_text(self.low, self.high)

  def step(self, reply: str) -> base.HostStep:
    texts = reply_texts(self.low, self.high)
    # linear; ASCII digits only and a minus sign right before them, as the JAX reader
    numbers = re.findall(r"-?[0-9]+", reply)
    if not numbers:
      return base.HostStep(texts[INVALID], 0.0, False, {"invalid": 1.0, "success": 0.0})
    sign, digits = (-1, numbers[-1][1:]) if numbers[-1].startswith("-") else (1, numbers[-1])
    guess = sign * (base.NUMBER_CAP if len(digits) > 6 else int(digits))  # as last_number
    if guess == self.target:
      return base.HostStep(texts[CORRECT], 1.0, True, {"invalid": 0.0, "success": 1.0})
    return base.HostStep(texts[HIGHER if guess < self.target else LOWER], 0.0, False,
                         {"invalid": 0.0, "success": 0.0})


@registry.register("env", "guess_number_host")
def make_host(tokenizer, **options) -> HostGuessNumber:
  """Guess the number as a host environment (the same texts and rules)."""
  return HostGuessNumber(tokenizer, **options)
