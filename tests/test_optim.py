"""Minibatch shuffling in `optim.minibatch_updates`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_agents import optim


def _minibatch_stats(group_size: int, *, rows=24, groups_of=4, epochs=3, minibatches=3):
  """Runs minibatch_updates with a loss that reports what each minibatch held."""
  batch = {"row": jnp.arange(rows), "group": jnp.arange(rows) // groups_of}

  def loss_fn(params, mb):
    g = mb["group"].reshape(-1, groups_of)
    whole = jnp.all(g == g[:, :1]).astype(jnp.float32)
    return jnp.sum(params["w"]) * 0.0, {"whole_groups": whole,
                                        "row_sum": jnp.sum(mb["row"]).astype(jnp.float32)}

  params = {"w": jnp.zeros(2)}
  tx = optax.sgd(0.1)
  _, _, metrics, n = optim.minibatch_updates(
      loss_fn, tx, params, tx.init(params), batch, jax.random.key(0), epochs=epochs,
      minibatches=minibatches, group_size=group_size)
  assert n == epochs * minibatches
  # Every row exactly once per epoch: the mean minibatch row-sum is the total over minibatches.
  np.testing.assert_allclose(metrics["row_sum"], sum(range(rows)) / minibatches)
  return float(metrics["whole_groups"])


def test_group_shuffle_keeps_groups_whole():
  assert _minibatch_stats(group_size=4) == 1.0


def test_row_shuffle_splits_groups():
  assert _minibatch_stats(group_size=1) < 1.0


def test_batch_must_split_into_whole_groups():
  with pytest.raises(ValueError, match="whole groups of 4"):
    _minibatch_stats(group_size=4, rows=24, minibatches=4)
