"""Process rewards: Monte-Carlo step values on a chain with known values; Clip and Delta."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.rewards import process_rewards as pr


def test_mc_step_values_match_the_known_values_of_a_toy_chain():
  """A reply of K steps, each right with probability p given a right prefix; the answer is
  right iff every step is. From a right prefix ending at step k, a continuation succeeds
  with probability p^(K - k - 1): the estimates from M continuations agree within 4
  standard errors."""
  k_steps, m, p = 5, 4000, 0.8
  rng = jax.random.key(0)
  # continuation m from step k draws the K - k - 1 remaining steps
  draws = jax.random.bernoulli(rng, p, (1, k_steps, m, k_steps))
  remaining = jnp.arange(k_steps)[None, :, None, None] < jnp.arange(k_steps)[None, None, None, :]
  successes = jnp.all(draws | ~remaining, axis=-1)
  step_mask = jnp.ones((1, k_steps), bool)
  values = np.asarray(pr.mc_step_values(successes, step_mask))[0]
  expected = p ** (k_steps - 1 - np.arange(k_steps))
  se = np.sqrt(expected * (1 - expected) / m)
  assert np.all(np.abs(values - expected) <= 4 * se + 1e-9), (values, expected)
  assert values[-1] == 1.0  # the full right reply is right
  masked = pr.mc_step_values(successes, jnp.asarray([[True, True, False, False, False]]))
  assert np.all(np.asarray(masked)[0, 2:] == 0)


def test_clip_and_delta_by_hand():
  r = jnp.asarray([[0.9, 0.4, 0.7, 0.0], [0.2, 0.6, 0.0, 0.0]])
  mask = jnp.asarray([[True, True, True, False], [True, True, False, False]])
  np.testing.assert_allclose(np.asarray(pr.clip_rewards(r, mask, threshold=0.5)),
                             [[0.0, -0.1, 0.0, 0.0], [-0.3, 0.0, 0.0, 0.0]], atol=1e-7)
  np.testing.assert_allclose(np.asarray(pr.delta_rewards(r, mask)),
                             [[0.5, -0.3, 0.7, 0.0], [-0.4, 0.6, 0.0, 0.0]], atol=1e-7)
  with pytest.raises(ValueError, match="step_mask"):
    pr.clip_rewards(r, mask[:, :3])


@pytest.mark.parametrize("transform", ["clip", "delta"])
def test_repeating_a_step_never_raises_the_total(transform):
  """For every reply of up to 4 steps with rewards on a grid, and every step repeated once
  in place: the transformed total of the longer reply is at most the original's (raw sums
  would grow by the repeated step's reward)."""
  grid = [0.0, 0.3, 0.9]
  fn = {"clip": lambda r, m: pr.clip_rewards(r, m, threshold=0.5),
        "delta": pr.delta_rewards}[transform]
  width = 5
  originals, repeated = [], []
  for n in range(1, 5):
    for rewards in itertools.product(grid, repeat=n):
      for j in range(n):
        originals.append(list(rewards))
        repeated.append(list(rewards[:j + 1]) + list(rewards[j:]))

  def totals(rows):
    r = np.zeros((len(rows), width), np.float32)
    m = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
      r[i, :len(row)], m[i, :len(row)] = row, True
    return np.asarray(fn(jnp.asarray(r), jnp.asarray(m)).sum(axis=1))
  before, after = totals(originals), totals(repeated)
  assert np.all(after <= before + 1e-6)
  raw_gain = [sum(b) - sum(a) for a, b in zip(originals, repeated, strict=True)]
  assert max(raw_gain) > 0  # the raw sum does reward the repetition


def test_aggregate_by_hand():
  r = jnp.asarray([[0.9, 0.2, 0.7], [0.6, 0.8, 0.0]])
  mask = jnp.asarray([[True, True, True], [True, True, False]])
  np.testing.assert_allclose(pr.aggregate(r, mask, "min"), [0.2, 0.6])
  np.testing.assert_allclose(pr.aggregate(r, mask, "last"), [0.7, 0.8])
  np.testing.assert_allclose(pr.aggregate(r, mask, "clip", threshold=0.5), [-0.3, 0.0],
                             atol=1e-7)
  # A repeated good step never raises the clip or min total.
  more = jnp.asarray([[0.9, 0.2, 0.7, 0.7]])
  assert pr.aggregate(more, jnp.ones((1, 4), bool), "clip") <= pr.aggregate(r[:1], mask[:1],
                                                                             "clip")
  with pytest.raises(ValueError, match="aggregation"):
    pr.aggregate(r, mask, "sum")
