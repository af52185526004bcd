"""The next step's rollout sampled while this step's update runs (one step off-policy).

With `config.overlap`, step t's update (on the rollout of step t) and step
t+1's rollout run at the same time: the rollout samples with the policy the
update starts from, so every rollout is one update behind the policy it
trains, as in PipelineRL and AReaL. The sampler recorded the log-probability
of each token under the policy that drew it, and `losses/off_policy.py`
corrects for the lag if asked (`config.off_policy.correction`).

What makes it resume exactly (a run stopped at any step, then resumed, logs
what an uninterrupted run logs):
  * the train state carries the policy that samples the next rollout
    (`OverlapState.behavior_params`, the params before the last update), so a
    resumed run samples that rollout again, with the same policy;
  * each rollout's key derives from (seed, its step) (`rollout_key`);
  * the data iterator reports the position of the batches the updates used
    (`Lookahead.get_state`), not of one drawn ahead for a rollout in flight.

The rollout runs in one background thread. On a CPU the sampler's jitted
calls and the update's run at the same time (JAX releases the GIL while a
computation runs), host-side reward scoring too; on one accelerator the two
share its compute stream, so there the overlap hides host work (tokenizing,
rewards, dispatch) rather than device time. The pipeline is drained before an
evaluation (rewards and the sampler's host state are not shared across
threads; the wait counts as evaluation time) and at the end. One process, one
device: several processes would have to dispatch the two threads' collectives
in the same order.

Memory: the train state holds a second copy of the policy (`behavior_params`,
checkpointed too), and during an update a third (the copy the next rollout
samples with) is alive beside it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents.train import harness

log = logging.getLogger(__name__)

# Tag of the rollout keys' stream, folded into the seed's key before the step: these
# keys are not the harness's per-step keys (which fold the step in once).
_ROLLOUT_STREAM = 0x0F1A


class OverlapState(NamedTuple):
  """The train state of an overlapped run.

  Attributes:
    train: the algorithm's own state.
    behavior_params: the policy that samples the next rollout: the policy
      params before the last update (the initial params before the first).
    step: int32[] steps done.
  """

  train: Any
  behavior_params: Any
  step: jax.Array


def copy_params(params):
  """A copy the update's donation of the train state cannot delete."""
  return jax.tree.map(jnp.copy, params)


def rollout_key(seed: int, step: int) -> jax.Array:
  """The key of step `step`'s rollout (whichever thread samples it)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _ROLLOUT_STREAM), step)


def check_supported(config, mesh) -> None:
  """Refuses settings the overlap does not support yet, naming them."""
  if jax.process_count() > 1:
    raise ValueError("config.overlap runs on one process: with several, the rollout thread's "
                     "and the update's collectives could be dispatched in different orders")
  if mesh is not None and mesh.size > 1:
    raise ValueError(f"config.overlap runs on one device; config.mesh names {mesh.size}")


class Lookahead:
  """A data iterator whose saved position leaves out the batch drawn ahead.

  `draw_ahead()` takes the next batch for a rollout that runs during this
  step's update; the position `get_state()` reports stays that of the batches
  the updates used until that rollout is consumed (`consumed_ahead()`), so a
  checkpoint taken while it is in flight resumes by drawing it again.
  """

  def __init__(self, data):
    self._data = data
    self._before_ahead = None  # the position before the batch in flight, if one is

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._data)

  def draw_ahead(self):
    self._before_ahead = copy.deepcopy(self._data.get_state())
    return next(self._data)

  def consumed_ahead(self) -> None:
    self._before_ahead = None

  def get_state(self):
    return self._data.get_state() if self._before_ahead is None else self._before_ahead

  def set_state(self, state) -> None:
    self._before_ahead = None
    self._data.set_state(state)


class Pipeline:
  """At most one rollout in flight, sampled by `collect(params, examples, key)`."""

  def __init__(self, collect, data: Lookahead, seed: int):
    self._collect, self._data, self._seed = collect, data, seed
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "overlapped-rollout")
    self._pending: tuple[int, concurrent.futures.Future] | None = None

  def _timed_collect(self, params, examples, step: int):
    t0 = time.perf_counter()
    r, extra = self._collect(params, examples, rollout_key(self._seed, step))
    return r, extra, time.perf_counter() - t0

  def take(self, step: int, behavior_params) -> tuple[Any, dict, float]:
    """Step `step`'s rollout: the one in flight, or sampled now with `behavior_params`.

    Returns (rollout, the collector's scalars, seconds it took to sample).
    """
    if self._pending is not None:
      pending_step, future = self._pending
      if pending_step != step:
        raise RuntimeError(f"the rollout in flight is step {pending_step}'s, not step {step}'s")
      self._pending = None
      self._data.consumed_ahead()
      return future.result()
    return self._timed_collect(behavior_params, next(self._data), step)

  def start(self, step: int, params) -> None:
    """Samples step `step`'s rollout with `params` in the background."""
    if self._pending is not None:
      raise RuntimeError(f"step {self._pending[0]}'s rollout is still in flight")
    examples = self._data.draw_ahead()
    self._pending = (step, self._executor.submit(self._timed_collect, params, examples, step))

  def drain(self) -> None:
    """Waits for the rollout in flight (kept for `take`, which raises what it raised)."""
    if self._pending is not None:
      concurrent.futures.wait([self._pending[1]])

  def close(self) -> None:
    """Waits for a rollout in flight (a running one cannot be cancelled) and stops the thread.

    A run that stops with one in flight (the time budget, SIGTERM, an error) has
    checkpointed without it: its resume samples it again.
    """
    if self._pending is not None:
      step, future = self._pending
      if not future.done():
        log.info("waiting for step %d's rollout, in flight, before exiting", step)
      if future.exception() is not None:
        log.warning("step %d's rollout, in flight when the run stopped, failed: %r", step,
                    future.exception())
    self._executor.shutdown(wait=True, cancel_futures=True)
    self._pending = None


def run(config, workdir: str, *, collect, data, init_state, initial_params, policy_params,
        update_step, evaluate, nonfinite_count, progress: bool = True, **harness_kwargs
        ) -> dict:
  """`harness.run` with each step's update overlapped with the next step's rollout.

  The experiment's pieces, for its own train state (`OverlapState.train` here):
    collect(params, examples, rng) -> (rollout, extra scalars)
    init_state() -> the train state; initial_params: the policy the first rollout samples
    policy_params(state) -> the policy inside the train state
    update_step(state, rollout, extra, prepare_rng, update_rng, progress, rollout_s, wait_s)
        -> harness.StepResult
    evaluate(state) -> (record, samples), or None
    nonfinite_count(state) -> (consecutive, total) skipped updates
  """
  lookahead = Lookahead(data)
  pipeline = Pipeline(collect, lookahead, config.seed)

  def overlapped_step(state: OverlapState, rng, progress_fraction):
    # The experiment's split of the step key; the rollout's key is `rollout_key` (either
    # thread samples it).
    _, prepare_rng, update_rng = jax.random.split(rng, 3)
    step, t0 = int(state.step), time.perf_counter()
    r, extra, rollout_s = pipeline.take(step, state.behavior_params)
    wait_s = time.perf_counter() - t0
    # The update donates the train state: the next rollout samples from a copy.
    sampler_params = copy_params(policy_params(state.train))
    if step + 1 < config.steps:
      pipeline.start(step + 1, sampler_params)
    result = update_step(state.train, r, extra, prepare_rng, update_rng, progress_fraction,
                         rollout_s, wait_s)
    return result._replace(state=OverlapState(
        train=result.state, behavior_params=sampler_params, step=state.step + 1))

  def overlapped_eval(state: OverlapState):
    pipeline.drain()  # the rewards' host state is not shared across threads
    return evaluate(state.train)

  return harness.run(
      config, workdir,
      init_state=lambda: OverlapState(train=init_state(),
                                      behavior_params=copy_params(initial_params),
                                      step=jnp.zeros((), jnp.int32)),
      train_step=overlapped_step, evaluate=None if evaluate is None else overlapped_eval,
      data=lookahead, nonfinite_count=lambda state: nonfinite_count(state.train),
      progress=progress, on_exit=pipeline.close, **harness_kwargs)
