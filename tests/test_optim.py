"""Minibatch shuffling in `optim.minibatch_updates`; the parameters' moving average."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_agents.train import optim


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


@pytest.mark.parametrize("decay, reference", [
    ("cosine", lambda peak, n: optax.cosine_decay_schedule(peak, n, alpha=0.1)),
    ("linear", lambda peak, n: optax.linear_schedule(peak, 0.1 * peak, n)),
    ("constant", lambda peak, n: optax.constant_schedule(peak))])
def test_decay_factor_matches_optax_schedules_by_fraction(decay, reference):
  n, peak = 40, 3e-4
  schedule = reference(peak, n)
  for k in (0, 1, 10, 20, 33, 40):
    np.testing.assert_allclose(optim.decay_factor(k / n, decay, end_fraction=0.1) * peak,
                               schedule(k), rtol=1e-5)
  # Progress past the end stays at the end rate.
  np.testing.assert_allclose(optim.decay_factor(1.7, decay, 0.1) * peak, schedule(n), rtol=1e-5)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_over_part_of_the_run_then_holds(decay):
  """decay_over=0.25: the whole decay in the first quarter, then the end rate."""
  n, peak = 40, 3e-4
  whole = optim.learning_rate_schedule(peak, n // 4, decay=decay, end_fraction=0.1)
  part = optim.learning_rate_schedule(peak, n, decay=decay, end_fraction=0.1, decay_over=0.25)
  for k in (0, 3, 5, 10):
    np.testing.assert_allclose(part(k), whole(k), rtol=1e-6)
    np.testing.assert_allclose(optim.decay_factor(k / n, decay, 0.1, decay_over=0.25) * peak,
                               whole(k), rtol=1e-5)
  for k in (11, 25, 40):
    np.testing.assert_allclose(part(k), 0.1 * peak, rtol=1e-5)
    np.testing.assert_allclose(optim.decay_factor(k / n, decay, 0.1, decay_over=0.25), 0.1,
                               rtol=1e-5)
  # Halfway through the cosine's span: (1 + cos(pi / 2)) / 2 of the way down.
  if decay == "cosine":
    np.testing.assert_allclose(optim.decay_factor(0.125, decay, 0.1, decay_over=0.25),
                               0.1 + 0.9 * 0.5, rtol=1e-6)
  for bad in (0.0, -0.5, 1.5, float("nan"), "0.5", None):
    with pytest.raises(ValueError, match="decay_over"):
      optim.make_optimizer(learning_rate=1e-3, total_updates=n, decay=decay, decay_over=bad)


def test_train_time_clock_scales_adamw_updates_like_a_smaller_rate():
  """AdamW (with weight decay) at rate r, scaled by s, equals AdamW at rate r * s."""
  params = {"w": jnp.array([0.5, -1.0, 2.0])}
  batch = {"x": jnp.arange(8.0).reshape(4, 2)}

  def loss_fn(p, mb):
    return jnp.sum(jnp.square(p["w"][:2] * mb["x"] - 1.0)) + p["w"][2] ** 2, {}

  def run(opt, scale):
    out, _, _, _ = optim.minibatch_updates(loss_fn, opt.tx, params, opt.tx.init(params), batch,
                                           jax.random.key(0), epochs=2, minibatches=2,
                                           lr_scale=scale)
    return out["w"]

  timed = optim.make_optimizer(learning_rate=1e-2, total_updates=4, decay="cosine",
                               clock="train_time", weight_decay=0.1, grad_clip=None)
  scale = timed.scale(jnp.float32(0.5))
  np.testing.assert_allclose(scale, 0.5, rtol=1e-6)
  plain = optim.make_optimizer(learning_rate=5e-3, total_updates=4, weight_decay=0.1,
                               grad_clip=None)
  np.testing.assert_allclose(run(timed, scale), run(plain, 1.0), rtol=1e-6)
  # On the updates clock the decay lives in the optax schedule and the scale is 1.
  stepped = optim.make_optimizer(learning_rate=1e-2, total_updates=4, decay="cosine")
  assert float(stepped.scale(jnp.float32(0.5))) == 1.0 and float(stepped.schedule(2)) < 1e-2
  with pytest.raises(ValueError, match="unknown learning-rate clock 'wall'"):
    optim.make_optimizer(learning_rate=1e-2, total_updates=4, clock="wall")


@pytest.mark.parametrize("updates, decay, weight", [
    (0, 0.99, 1 / 10),     # warm-up: (1 + 0) / (10 + 0) caps the decay
    (90, 0.99, 91 / 100),  # still in the warm-up
    (90, 0.5, 0.5),        # past it: the decay itself
])
def test_polyak_average_weighs_the_previous_average_by_the_warmed_up_decay(updates, decay,
                                                                          weight):
  average = {"w": jnp.full((3,), 2.0), "b": jnp.zeros((), jnp.bfloat16)}
  params = {"w": jnp.full((3,), 12.0), "b": jnp.ones((), jnp.bfloat16)}
  moved = optim.polyak_average(average, params, jnp.int32(updates), decay)
  np.testing.assert_allclose(moved["w"], weight * 2.0 + (1 - weight) * 12.0, rtol=1e-6)
  assert moved["b"].dtype == jnp.bfloat16  # the average keeps its dtype
  np.testing.assert_allclose(float(moved["b"]), 1 - weight, rtol=1e-2)
