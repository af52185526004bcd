"""The run harness: workdir, resume, schedule, preemption and logging, for any trainer.

It knows nothing of rollouts, rewards or losses. A trainer (the RL loop in
`rl_loop`, and reward-model, preference or multi-turn trainers) gives it:

  init_state()                        the train state pytree (checkpointed whole)
  train_step(state, rng, progress)    -> StepResult(state, record, samples)
  evaluate(state)                     -> (record, samples), or None for no evaluation
  data                                an iterator state holder (get_state/set_state),
                                      checkpointed beside the train state
  nonfinite_count(state)              -> (consecutive, total) skipped updates, or None

and the harness runs `config.steps` steps in `workdir`:

  checkpoints/     Orbax: train state, data state, meta (config, seed, step, training time)
  config.json      the resolved config
  metrics.jsonl    one record per step (kind "train") and per evaluation (kind "eval")
  samples.jsonl    the train step's samples every `sample_every` steps, and eval samples
  tensorboard/     the same scalars as TensorBoard events

Schedule (all from the config): evaluate at step 0, every `eval_every` steps
and every `eval_every_s` seconds of training time, and at the end; checkpoint
every `checkpoint_every` steps, at the end, when the time budget
(`time_budget_s`) runs out and on SIGTERM (then exit 143). A resumed run
refuses a config that computes differently (`check_resumable`) and continues
exactly where the checkpoint left it: step keys derive from (seed, step).
Training time is the wall-clock of the train steps (compilation included,
evaluation and checkpointing excluded) and carries over a resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from jaxrl_agents import checkpointing
from jaxrl_agents import metrics as metrics_lib

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. too many non-finite updates in a row)."""


# ----------------------------------------------------------------------------
# Compile-time accounting: JAX reports the duration of every trace, lowering
# and backend compile; summing them per step separates compile from compute.

_COMPILE_SECONDS = [0.0]
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


def _on_duration(event: str, duration: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
  """Seconds spent tracing, lowering and compiling since the process started."""
  return _COMPILE_SECONDS[0]


class StepResult(NamedTuple):
  """What a train step returns: the new state, its scalars, and samples to log (may be [])."""
  state: Any
  record: dict[str, float]
  samples: list[dict]


# Keys that may change when a run resumes: they decide what is logged and
# saved, or how long the run goes on, not what it computes.
RESUMABLE_CHANGES = frozenset({
    "steps", "eval_every", "eval_size", "eval_batch_size", "checkpoint_every",
    "keep_checkpoints", "sample_every", "samples_per_log", "tensorboard",
    "max_consecutive_nonfinite", "time_budget_s", "eval_every_s"})


def config_to_dict(config) -> dict:
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") \
      else dict(config)


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resumable(saved: Mapping, current: Mapping, workdir: str) -> None:
  """Fails when the workdir's checkpoint was written under a config that computes differently.

  A resumed run must continue the run it resumes; to run a changed experiment,
  use a new workdir.
  """
  old, new = _flat(saved), _flat(current)
  changed = sorted(k for k in old.keys() | new.keys()
                   if old.get(k, "<unset>") != new.get(k, "<unset>")
                   and k not in RESUMABLE_CHANGES)
  if changed:
    details = "; ".join(f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}"
                        for k in changed[:8])
    raise ValueError(f"{workdir} holds a run with a different config ({details}); resume it "
                     "with its own config (see its config.json) or use a new workdir")
  if old.get("steps") != new.get("steps") and new.get("optimizer.decay", "constant") != \
      "constant":
    raise ValueError(f"{workdir}: changing steps ({old.get('steps')} -> {new.get('steps')}) "
                     f"would change the {new['optimizer.decay']} learning-rate schedule of the "
                     "run being resumed; use a new workdir")


class _Preemption:
  """Turns SIGTERM into a flag the loop checks between steps (TPU VMs get SIGTERM on preemption)."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True
    log.warning("SIGTERM received: checkpointing after the current step, then exiting")

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class _Run:
  """The mutable state of one run of the loop and the actions it schedules."""

  config: Any
  workdir: str
  evaluate: Callable[[Any], tuple[dict, list[dict]]] | None
  data: Any
  ckpt: checkpointing.Checkpointer
  writer: metrics_lib.MetricWriter
  state: Any = None
  step: int = 0
  train_time: float = 0.0
  last_eval: dict = dataclasses.field(default_factory=dict)
  next_timed_eval: float = math.inf

  @property
  def budget(self) -> float:
    return float(self.config.get("time_budget_s", 0.0) or 0.0)

  @property
  def eval_every_s(self) -> float:
    return float(self.config.get("eval_every_s", 0.0) or 0.0)

  def restore(self, init_state) -> None:
    """The latest readable checkpoint, or a fresh state (and fresh logs)."""
    self.state = init_state()
    restored = self.ckpt.restore_latest(self.state)
    if restored is not None:
      self.step, self.state, data_state, meta = restored
      self.train_time = float(meta.get("train_time_s", 0.0))
      self.data.set_state(data_state)
      log.info("resumed from step %d in %s", self.step, self.ckpt.directory)
    # Logs past the checkpoint (or of a run that left none) would be repeated.
    self.writer.truncate_after(self.step if restored is not None else -1)
    if self.eval_every_s:
      self.next_timed_eval = (math.floor(self.train_time / self.eval_every_s) + 1) \
          * self.eval_every_s

  def run_eval(self) -> None:
    if self.evaluate is None or not (self.config.eval_every or self.eval_every_s):
      return
    t0 = time.perf_counter()
    result, samples = self.evaluate(self.state)
    result = {**result, "eval_time_s": time.perf_counter() - t0, "train_time_s": self.train_time}
    self.writer.write_scalars(self.step, result, kind="eval")
    self.writer.write_samples(self.step, samples[:self.config.samples_per_log], kind="eval")
    log.info("eval at step %d: %s (%.1fs)", self.step,
             ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                       if k in ("accuracy", "reward_mean", "loss")), result["eval_time_s"])
    self.last_eval = result

  def save(self) -> None:
    self.ckpt.save(self.step, self.state, self.data.get_state(),
                   {"config": config_to_dict(self.config), "seed": self.config.seed,
                    "step": self.step, "train_time_s": self.train_time})

  def log_step(self, result: StepResult, seconds: float, compile_s: float) -> None:
    self.writer.write_scalars(self.step, {**result.record, "step_time_s": seconds,
                                          "train_time_s": self.train_time,
                                          "compile_time_s": compile_s})
    every = self.config.get("sample_every", 0)
    if every and self.step % every == 0 and result.samples:
      self.writer.write_samples(self.step, result.samples[:self.config.samples_per_log])

  def after_step(self) -> bool:
    """Evaluations and checkpoints due after a step; True when the time budget is spent."""
    c = self.config
    out_of_time = self.budget > 0 and self.train_time >= self.budget
    timed_eval = self.train_time >= self.next_timed_eval
    if timed_eval:
      self.next_timed_eval = (math.floor(self.train_time / self.eval_every_s) + 1) \
          * self.eval_every_s
    evaluated = (c.eval_every and self.step % c.eval_every == 0) or (timed_eval and not out_of_time)
    if evaluated:
      self.run_eval()
    if self.step % c.checkpoint_every == 0 or self.step == c.steps or out_of_time:
      self.save()
    if out_of_time:
      log.info("time budget of %.0f s reached at step %d", self.budget, self.step)
      if not evaluated:
        self.run_eval()
    return out_of_time


def run(config, workdir: str, *, init_state: Callable[[], Any],
        train_step: Callable[[Any, jax.Array, float], StepResult],
        evaluate: Callable[[Any], tuple[dict, list[dict]]] | None, data,
        nonfinite_count: Callable[[Any], tuple[int, int]] | None = None,
        postfix: Sequence[str] = (), finite_keys: Sequence[str] = (),
        progress: bool = True) -> dict:
  """Trains for config.steps steps in `workdir`, resuming from its latest checkpoint.

  Args:
    config: the experiment's ConfigDict: seed, steps, the schedule keys in the
      module docstring, samples_per_log, keep_checkpoints, tensorboard,
      max_consecutive_nonfinite.
    workdir: the run directory.
    init_state: () -> the initial train state (also the structure to restore into).
    train_step: (state, rng, progress) -> StepResult. rng derives from (seed,
      step); progress in [0, 1] is training time over the time budget when
      there is one, else steps over config.steps (a learning-rate clock).
    evaluate: state -> (scalars, samples), or None.
    data: the training data iterator, with get_state/set_state.
    nonfinite_count: state -> (consecutive, total) skipped non-finite updates;
      the run stops after config.max_consecutive_nonfinite in a row.
    postfix: record keys shown on the progress bar.
    finite_keys: record keys whose non-finite value stops the run (after it is logged).
    progress: show a tqdm progress bar on stderr.

  Returns:
    The last eval record ({} when evaluation is off).
  """
  from tqdm import tqdm

  os.makedirs(workdir, exist_ok=True)
  ckpt = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  saved = ckpt.latest_meta()
  if saved is not None:
    check_resumable(saved[1].get("config", {}), config_to_dict(config), workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_to_dict(config), f, indent=2)
  r = _Run(config, workdir, evaluate, data, ckpt,
           metrics_lib.MetricWriter(workdir, tensorboard=config.get("tensorboard", True)))
  r.restore(init_state)
  start_step, base_rng = r.step, jax.random.key(config.seed)
  if start_step == 0:
    r.run_eval()
  bar = tqdm(total=config.steps, initial=start_step, disable=not progress, file=sys.stderr,
             desc="train", dynamic_ncols=True)
  with _Preemption() as preemption:
    try:
      while r.step < config.steps:
        compile_before, t0 = compile_seconds(), time.perf_counter()
        result = train_step(r.state, jax.random.fold_in(base_rng, r.step),
                            r.train_time / r.budget if r.budget > 0 else r.step / config.steps)
        seconds = time.perf_counter() - t0
        r.state, r.step, r.train_time = result.state, r.step + 1, r.train_time + seconds
        r.log_step(result, seconds, compile_seconds() - compile_before)
        bar.set_postfix({k: f"{result.record[k]:.3f}" for k in postfix if k in result.record})
        bar.update(1)
        _check_finite(result.record, finite_keys, r.step)
        _check_nonfinite(nonfinite_count, r, config.max_consecutive_nonfinite)
        if r.after_step():
          break
        if preemption.requested:
          r.save()
          log.warning("checkpointed step %d after SIGTERM; exiting", r.step)
          raise SystemExit(143)
      else:  # the step budget ran out (not the time budget)
        if config.eval_every and r.step % config.eval_every != 0 and r.step > start_step:
          r.run_eval()
    finally:
      bar.close()
      r.writer.close()
      ckpt.close()
  return r.last_eval


def _check_finite(record: Mapping[str, float], keys: Sequence[str], step: int) -> None:
  for key in keys:
    if not math.isfinite(record[key]):
      raise TrainingStopped(f"non-finite {key} ({record[key]}) at step {step}")


def _check_nonfinite(nonfinite_count, r: _Run, limit: int) -> None:
  if nonfinite_count is None:
    return
  consecutive, _ = nonfinite_count(r.state)
  if consecutive >= limit:
    raise TrainingStopped(
        f"{consecutive} consecutive updates had a non-finite loss or gradient (step "
        f"{r.step}); stopping. The last good checkpoint is intact in {r.ckpt.directory}.")
