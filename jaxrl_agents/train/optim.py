"""The optimizer of the RL experiments: AdamW, warm-up + decay, clipping, non-finite skipping."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_agents.models import lora

SCHEDULES = ("constant", "cosine", "linear")
# What the decay runs on: applied optimizer updates (the run's step count), or the
# fraction of a time budget spent, so a time-budgeted run decays over its budget
# whatever its step rate on the machine.
CLOCKS = ("updates", "train_time")


def check_decay_over(decay_over: float, name: str = "decay_over") -> None:
  """Raises ValueError, naming the setting `name`, unless decay_over is a number in (0, 1]."""
  if isinstance(decay_over, bool) or not isinstance(decay_over, int | float) \
      or not 0.0 < decay_over <= 1.0:
    raise ValueError(f"{name} is the fraction of the run the decay spans: expected a "
                     f"number in (0, 1], got {decay_over!r}")


def learning_rate_schedule(
    learning_rate: float, total_updates: int, warmup_updates: int = 0,
    decay: str = "constant", end_fraction: float = 0.0, decay_over: float = 1.0
) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then constant, cosine or linear decay.

  Args:
    learning_rate: the peak rate.
    total_updates: optimizer updates in the whole run (steps x epochs x minibatches).
    warmup_updates: updates of linear warm-up.
    decay: one of SCHEDULES.
    end_fraction: final rate / peak rate for the decaying schedules.
    decay_over: the fraction of the updates after the warm-up that the decay spans;
      the rate then holds at end_fraction x peak.
  """
  if decay not in SCHEDULES:
    raise ValueError(f"unknown learning-rate decay {decay!r}; expected one of {SCHEDULES}")
  if learning_rate <= 0:
    raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
  check_decay_over(decay_over)
  warmup_updates = max(0, min(warmup_updates, total_updates))
  rest = max(1, round((total_updates - warmup_updates) * decay_over))
  if decay == "constant":
    after = optax.constant_schedule(learning_rate)
  elif decay == "cosine":
    after = optax.cosine_decay_schedule(learning_rate, rest, alpha=end_fraction)
  else:
    after = optax.linear_schedule(learning_rate, learning_rate * end_fraction, rest)
  if warmup_updates == 0:
    return after
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_updates)
  return optax.join_schedules([warmup, after], [warmup_updates])


def decay_factor(progress: jax.Array, decay: str, end_fraction: float = 0.0,
                 decay_over: float = 1.0) -> jax.Array:
  """Rate / peak rate at `progress` in [0, 1] of the run: 1 at 0, end_fraction from decay_over on.

  The same shapes as optax's cosine_decay_schedule (alpha = end_fraction) and
  linear_schedule, as functions of a fraction instead of an update count.
  """
  if decay not in SCHEDULES:
    raise ValueError(f"unknown learning-rate decay {decay!r}; expected one of {SCHEDULES}")
  check_decay_over(decay_over)
  p = jnp.clip(jnp.asarray(progress, jnp.float32) / decay_over, 0.0, 1.0)
  if decay == "constant":
    return jnp.ones_like(p)
  if decay == "cosine":
    return end_fraction + (1.0 - end_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
  return 1.0 - (1.0 - end_fraction) * p


class Optimizer(NamedTuple):
  """The optimizer and its learning rate.

  tx: AdamW with clipping, skipping non-finite updates; its own schedule holds
    the warm-up, and the decay when the clock is "updates".
  schedule: that schedule, by applied updates (for logging).
  scale: progress in [0, 1] -> factor on the updates: the decay when the clock
    is "train_time", else 1.
  """
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  scale: Callable[[jax.Array], jax.Array]


def _check_groups(groups: Mapping[str, Mapping[str, Any]], label_fn, settings: dict) -> None:
  if label_fn is None:
    raise ValueError("optimizer groups need a label_fn mapping params to group labels")
  for label, overrides in groups.items():
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
      raise ValueError(f"optimizer group {label!r}: unknown setting(s) {unknown}; "
                       f"settings: {sorted(settings)}")


# AdamW moves each weight by about the learning rate per update (Adam's normalized step),
# so a rate above this moves a weight by more than its own typical size every update:
# a run at 1e30 reached finite weights of 1e30 after one update, which no non-finite
# check sees. Refused up front; the export and the harness refuse absurd weights too.
MAX_LEARNING_RATE = 1.0


def check_learning_rate(rate, name: str = "learning_rate") -> None:
  """Raises ValueError unless `rate` is a finite number in (0, MAX_LEARNING_RATE]."""
  if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) \
      or not 0 < rate <= MAX_LEARNING_RATE:
    raise ValueError(f"{name} must be a finite number > 0 and at most {MAX_LEARNING_RATE:g} "
                     f"(AdamW moves each weight by about the rate per update), got {rate!r}")


def _check_rates(learning_rate, groups) -> None:
  """The main rate and each group's own (`check_learning_rate`)."""
  check_learning_rate(learning_rate)
  for label, overrides in (groups or {}).items():
    if "learning_rate" in overrides:
      check_learning_rate(overrides["learning_rate"], f"groups.{label}.learning_rate")


def make_optimizer(
    *, learning_rate: float, total_updates: int, warmup_updates: int = 0,
    decay: str = "constant", end_fraction: float = 0.0, clock: str = "updates",
    decay_over: float = 1.0, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float | None = 1.0,
    groups: Mapping[str, Mapping[str, Any]] | None = None,
    label_fn: Callable[[Any], Any] | None = None,
) -> Optimizer:
  """AdamW with global-norm clipping, wrapped in `optax.apply_if_finite`.

  With `groups` ({label: overrides of learning_rate, warmup_updates,
  end_fraction, weight_decay, b1, b2, eps}) and `label_fn` (params -> a
  pytree of labels), each group of parameters gets its own AdamW
  (`optax.multi_transform`): PPO's critic learns at its own rate. Parameters
  labelled "default" use the arguments above; clipping stays global.

  A non-finite gradient leaves params and moments untouched and is counted in
  the state (`notfinite_count`, `total_notfinite`), which the trainer reads to
  log skips and to stop the run after several in a row. optax would apply the
  update after `max_consecutive_errors` skips; that limit is set out of reach
  so a non-finite update is never applied.

  The decay spans the first `decay_over` of the clock (updates after the warm-up,
  or training time), then the rate holds at end_fraction x peak.

  With clock="train_time" the decay is a factor on the updates computed from
  the run's progress (see `minibatch_updates(lr_scale=...)`); AdamW's update,
  weight decay included, is linear in the rate, so this is the decayed rate.
  """
  if clock not in CLOCKS:
    raise ValueError(f"unknown learning-rate clock {clock!r}; expected one of {CLOCKS}")
  _check_rates(learning_rate, groups)
  if decay not in SCHEDULES:
    raise ValueError(f"unknown learning-rate decay {decay!r}; expected one of {SCHEDULES}")
  by_updates = clock == "updates"
  settings = dict(learning_rate=learning_rate, warmup_updates=warmup_updates,
                  end_fraction=end_fraction, weight_decay=weight_decay, b1=b1, b2=b2, eps=eps)

  def adamw(learning_rate, warmup_updates, end_fraction, weight_decay, b1, b2, eps):
    schedule = learning_rate_schedule(learning_rate, total_updates, warmup_updates,
                                      decay if by_updates else "constant", end_fraction,
                                      decay_over)
    return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay), schedule

  main, schedule = adamw(**settings)
  if groups:
    _check_groups(groups, label_fn, settings)
    transforms = {"default": main,
                  **{label: adamw(**{**settings, **dict(overrides)})[0]
                     for label, overrides in groups.items()}}
    main = optax.multi_transform(transforms, label_fn)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
  tx = optax.apply_if_finite(adapters_only(optax.chain(*parts, main)),
                             max_consecutive_errors=2**30)
  scale = jnp.ones_like if by_updates else functools.partial(
      decay_factor, decay=decay, end_fraction=end_fraction, decay_over=decay_over)
  return Optimizer(tx=tx, schedule=schedule, scale=scale)


def adapters_only(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` over the trainable part of LoRA params (`models/lora.py`): moments for the
  adapters only, zero updates for the frozen base weights. Params without adapters see
  `inner` itself, state included (so earlier checkpoints restore unchanged)."""

  def init(params):
    return inner.init(lora.trainable(params) if lora.has_adapters(params) else params)

  def update(updates, state, params=None):
    if not lora.has_adapters(updates):
      return inner.update(updates, state, params)
    part, state = inner.update(lora.trainable(updates), state,
                               None if params is None else lora.trainable(params))
    return lora.with_trainable(updates, part), state

  return optax.GradientTransformation(init, update)


def minibatch_updates(loss_fn, tx: optax.GradientTransformation, params, opt_state, batch,
                      rng: jax.Array, *, epochs: int, minibatches: int, group_size: int = 1,
                      lr_scale: jax.Array | float = 1.0):
  """`epochs` shuffled passes of `minibatches` optimizer updates over `batch`, in one lax.scan.

  Args:
    loss_fn: (params, minibatch) -> (loss, metrics dict).
    tx: the optimizer.
    params, opt_state: the trainable params and their optimizer state.
    batch: a pytree whose leaves all have the batch size as leading axis.
    rng: permutation key.
    epochs, minibatches: static counts; the batch size must divide by `minibatches`.
    group_size: shuffle whole groups of this many consecutive rows, never
      splitting one (for losses that share work within a group, like a
      group's common prompt); minibatches then hold whole groups.
    lr_scale: a factor on every update (a learning-rate decay driven from outside).

  Returns:
    (params, opt_state, metrics averaged over the updates, number of updates).
  """
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  if batch_size % (minibatches * group_size):
    raise ValueError(f"batch size {batch_size} is not divisible into minibatches={minibatches} "
                     f"of whole groups of {group_size}")
  groups = batch_size // group_size
  within = jnp.arange(group_size)
  orders = jnp.stack([
      (jax.random.permutation(k, groups)[:, None] * group_size + within).reshape(-1)
      for k in jax.random.split(rng, epochs)])
  orders = orders.reshape(epochs * minibatches, batch_size // minibatches)

  def step(carry, order):
    params, opt_state = carry
    mb = jax.tree.map(lambda x: x[order], batch)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    # A non-finite loss must skip the update even if the gradient happens to be finite.
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
    metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: (u * lr_scale).astype(u.dtype), updates)
    return (optax.apply_updates(params, updates), opt_state), metrics

  (params, opt_state), metrics = jax.lax.scan(step, (params, opt_state), orders)
  return params, opt_state, reduce_update_metrics(metrics), orders.shape[0]


def update_state(optimizer: Optimizer, loss_fn, state, batch, rng: jax.Array,
                 progress: jax.Array, *, epochs: int, minibatches: int, group_size: int = 1):
  """One rollout's updates (`minibatch_updates`) applied to an algorithm's state.

  `state` is any NamedTuple with `params`, `opt_state` and `updates` (int32[]
  optimizer updates so far, the schedule's position) fields, such as GRPO's
  and PPO's. `updates` counts applied updates, like the optimizer's own step
  count (skipped non-finite updates advance neither), so the logged
  `learning_rate` is the rate used.

  Returns:
    (the new state, metrics averaged over the updates, with `learning_rate`).
  """
  lr_scale = optimizer.scale(progress)
  params, opt_state, metrics, n = minibatch_updates(
      loss_fn, optimizer.tx, state.params, state.opt_state, batch, rng, epochs=epochs,
      minibatches=minibatches, group_size=group_size, lr_scale=lr_scale)
  metrics["learning_rate"] = optimizer.schedule(state.updates) * lr_scale
  skipped = opt_state.total_notfinite - state.opt_state.total_notfinite
  return state._replace(params=params, opt_state=opt_state,
                        updates=state.updates + n - skipped), metrics


def nonfinite_count(state) -> tuple[int, int]:
  """(consecutive, total) non-finite updates skipped so far, read from a train state whose
  `opt_state` comes from `make_optimizer` (the harness's `nonfinite_count` callback)."""
  return int(state.opt_state.notfinite_count), int(state.opt_state.total_notfinite)


def reduce_update_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """One value per metric over the updates of a step: max for `*_max`, else the mean.

  NaN-aware, so one skipped (non-finite) update does not blank the step's
  metrics; a step whose updates were all skipped logs NaN.
  """
  return {k: (jnp.nanmax(v) if k.endswith("_max") else jnp.nanmean(v))
          for k, v in metrics.items()}


def polyak_average(average, params, updates: jax.Array, decay: float):
  """The exponential moving average of the parameters after `updates` optimizer updates
  (Polyak averaging): decay_n * average + (1 - decay_n) * params with decay_n =
  min(decay, (1 + n) / (10 + n)), the warm-up of TensorFlow's ExponentialMovingAverage,
  so the first updates are not averaged with the starting point at full weight.

  Averaging the iterates of a noisy optimizer removes part of its noise without lowering
  its learning rate (the evaluated policy of `GRPOSettings.ema_decay`)."""
  n = jnp.asarray(updates, jnp.float32)
  decay_n = jnp.minimum(jnp.float32(decay), (1.0 + n) / (10.0 + n))
  moved = optax.incremental_update(params, average, 1.0 - decay_n)
  return jax.tree.map(lambda m, a: m.astype(a.dtype), moved, average)  # a bf16 average stays
