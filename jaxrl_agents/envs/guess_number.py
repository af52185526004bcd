"""Guess the number: the environment names a range, the agent guesses, it answers higher or lower.

The smallest multi-turn task where later turns must use earlier feedback: a
policy that ignores it guesses at random (success about K / range in K turns),
one that bisects always wins within ceil(log2(range + 1)) turns. Pure JAX:
the target is the task, every reply is read with `base.last_number` and every
observation is one of four pieces tokenized when the environment is made.

Reward: 1 on the turn the guess is right (the episode ends), else 0. A reply
without a number is an invalid action (counted in info["invalid"]); it costs a
turn and is told to answer with a number.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.envs import base

HIGHER, LOWER, CORRECT, INVALID = range(4)


class State(NamedTuple):
  target: jax.Array  # int32[]
  # The numbers still possible given the answers so far (the agent's state of
  # knowledge): what `state_key` and `potential` read.
  low: jax.Array  # int32[]
  high: jax.Array  # int32[]


class GuessNumber:
  """The environment (see the module docstring); `low`..`high` inclusive."""

  def __init__(self, tokenizer, *, low: int = 1, high: int = 16):
    if not 0 <= low < high < base.NUMBER_CAP:
      raise ValueError(f"guess_number needs 0 <= low < high < {base.NUMBER_CAP}, "
                       f"got low={low}, high={high}")
    self.low, self.high = low, high
    self.prompt = base.piece_table(tokenizer, [
        f"I am thinking of a whole number from {low} to {high}. Guess it: answer with just "
        "the number, and I will tell you whether mine is higher or lower."])
    self.replies = base.piece_table(tokenizer, [
        "Higher.", "Lower.", "Correct!", f"Answer with just a number from {low} to {high}."])
    self.obs_width = self.replies.ids.shape[-1]
    self.reader = base.number_reader(tokenizer)

  def sample_task(self, key: jax.Array) -> jax.Array:
    return jax.random.randint(key, (), self.low, self.high + 1, dtype=jnp.int32)

  def reset(self, key: jax.Array, task: jax.Array) -> tuple[State, base.Tokens]:
    del key  # the task decides everything
    return State(target=jnp.asarray(task, jnp.int32), low=jnp.int32(self.low),
                 high=jnp.int32(self.high)), base.row(self.prompt, 0)

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
  return GuessNumber(tokenizer, **options)
