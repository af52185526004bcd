"""The run harness: workdir, resume, schedule, preemption and logging, for any trainer.

It knows nothing of rollouts, rewards or losses. A trainer (experiments/grpo.py, ppo.py,
and the reward-model, preference and SFT trainers, each owning its step) gives it:

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
  run.lock         the live run's pid, host and start (`workdir.WorkdirLock`)
  previous/TIME/   files a resume or start_over moved aside

Schedule (all from the config): evaluate at step 0, every `eval_every` steps
and every `eval_every_s` seconds of training time, and at the end; checkpoint
every `checkpoint_every` steps, at the end, when the time budget
(`time_budget_s`) runs out and on SIGTERM (then exit 143). A resumed run
refuses a config that computes differently (`check_resumable`) and continues
exactly where the checkpoint left it: step keys derive from (seed, step).
Training time is the wall-clock of the train steps (compilation included,
evaluation and checkpointing excluded) and carries over a resume; a run
resumed with its time budget spent takes no further step. With
`config.mesh` naming more than one device, the train state is placed on that
mesh by `sharding.RULES` (and restored onto it), so a resume may use another mesh.

What a run guarantees about its workdir:
  * one writer: a second run on a live workdir fails at once naming the first
    (`workdir.WorkdirLock`); a lock left by a killed run is taken over with a warning;
  * nothing written is deleted: logs that no checkpoint can continue are refused
    unless `config.start_over` is set, which moves the old run's files to
    `previous/<time>/`; on resume, log lines past the checkpoint move there too;
  * checkpoints are verified against SHA-256 digests taken at save time; a damaged one
    is set aside and the previous one used (`checkpointing`);
  * no checkpoint is written while updates are being skipped as non-finite, so
    the newest checkpoint after such a stop predates the streak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
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

from jaxrl_agents import registry
from jaxrl_agents.parallel import distributed, sharding
from jaxrl_agents.train import checkpointing, precompile
from jaxrl_agents.train import metrics as metrics_lib
from jaxrl_agents.train import workdir as workdir_lib

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. too many non-finite updates in a row)."""


# ----------------------------------------------------------------------------
# Compile-time accounting: JAX reports the duration of every trace, lowering
# and backend compile, in the thread that does it; summing them per step
# separates compile from compute. The part done in the background compile
# thread (`precompile`) ran beside the step's other work, not before it.

_COMPILE_SECONDS = {"all": 0.0, "background": 0.0}
_COMPILE_LOCK = threading.Lock()
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


def _on_duration(event: str, duration: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    background = threading.current_thread().name == precompile.THREAD_NAME
    with _COMPILE_LOCK:
      _COMPILE_SECONDS["all"] += duration
      if background:
        _COMPILE_SECONDS["background"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
  """Seconds spent tracing, lowering and compiling since the process started, in any thread."""
  return _COMPILE_SECONDS["all"]


def background_compile_seconds() -> float:
  """The part of `compile_seconds()` spent in the background compile thread."""
  return _COMPILE_SECONDS["background"]


class StepResult(NamedTuple):
  """What a train step returns: the new state, its scalars, and samples to log (may be [])."""
  state: Any
  record: dict[str, float]
  samples: list[dict]


class ResumeRules(NamedTuple):
  """Which config changes a resumed run accepts (`check_resumable`).

  resumable: flat keys ("mesh.data") that may change on resume: they decide what is logged
    and saved, or how long the run goes on, not what it computes.
  backward_defaults: keys added to the configs after runs existed, with the value that
    reproduces those runs: a checkpoint whose config lacks one resumes under that value.

  The harness has its own (`RUN_RULES`, the keys it reads); a trainer passes its
  experiment's to `run`, and the two are merged.
  """
  resumable: frozenset = frozenset()
  backward_defaults: Mapping[str, Any] = {}

  def merged(self, other: ResumeRules) -> ResumeRules:
    return ResumeRules(self.resumable | other.resumable,
                       {**self.backward_defaults, **other.backward_defaults})


# The run schedule and the mesh: what the harness itself reads.
RUN_RULES = ResumeRules(resumable=frozenset({
    "steps", "eval_every", "eval_size", "eval_batch_size", "checkpoint_every",
    "keep_checkpoints", "sample_every", "samples_per_log", "tensorboard",
    "max_consecutive_nonfinite", "time_budget_s", "eval_every_s", "start_over",
    # The device mesh: a run may resume on more or fewer devices (the numbers then
    # differ by float summation order only).
    "mesh.data", "mesh.fsdp", "mesh.tensor"}), backward_defaults={"imports": []})

# What a run writes at the top of its workdir (what `start_over` moves aside).
RUN_FILES = ("checkpoints", metrics_lib.METRICS_FILE, metrics_lib.SAMPLES_FILE, "tensorboard",
             "config.json")


def config_to_dict(config) -> dict:
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") \
      else dict(config)


def flat_config(config) -> dict[str, Any]:
  """The config as one level of dotted keys ("optimizer.learning_rate": 2e-5, ...)."""
  return _flat(config_to_dict(config))


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resumable(saved: Mapping, current: Mapping, workdir: str,
                    rules: ResumeRules = RUN_RULES) -> None:
  """Fails when the workdir's checkpoint was written under a config that computes differently
  (by `rules`: the harness's and the experiment's, merged by `run`).

  A resumed run must continue the run it resumes; to run a changed experiment,
  use a new workdir.
  """
  old, new = ({**rules.backward_defaults, **_flat(d)} for d in (saved, current))
  changed = sorted(k for k in old.keys() | new.keys()
                   if old.get(k, "<unset>") != new.get(k, "<unset>")
                   and k not in rules.resumable)
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


def _has_logs(workdir: str) -> bool:
  """Whether the workdir holds a run's metrics, samples or TensorBoard events."""
  for name in (metrics_lib.METRICS_FILE, metrics_lib.SAMPLES_FILE):
    path = os.path.join(workdir, name)
    if os.path.exists(path) and os.path.getsize(path) > 0:
      return True
  tb = os.path.join(workdir, "tensorboard")
  return os.path.isdir(tb) and bool(os.listdir(tb))


def _unresumable_logs(workdir: str, why: str) -> ValueError:
  return ValueError(
      f"{workdir} holds the logs of a run that cannot be resumed ({why}); its logs are untouched. "
      f"Set config.start_over=True (--config.start_over=True) to move that run's files to "
      f"{os.path.join(workdir, workdir_lib.PREVIOUS_DIR)}/ and start again, or use a new workdir")


def validate_run_keys(config) -> None:
  """Checks the config keys the harness reads; trainers call it before loading a model.
  First imports the config's `imports` (user modules that register names)."""
  registry.import_modules(config.get("imports", ()))
  limit = config.get("max_consecutive_nonfinite", 1)
  if not isinstance(limit, int) or limit < 1:
    raise ValueError(f"config.max_consecutive_nonfinite must be an integer >= 1 (updates "
                     f"skipped in a row before the run stops), got {limit!r}")
  for key, least, meaning in _SCHEDULE_KEYS:
    value = config.get(key, least)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"config.{key} must be an integer >= {least} ({meaning}), got {value!r}")
  for key in ("eval_every_s", "time_budget_s"):
    value = config.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
        or value == float("inf"):
      raise ValueError(f"config.{key} must be >= 0 and finite (0 turns it off), got {value!r}")


# The schedule's integer keys: the least value each takes, and what it means.
_SCHEDULE_KEYS = (
    ("steps", 0, "training steps"),
    ("eval_every", 0, "steps between evaluations; 0: by time or at the end only"),
    ("sample_every", 0, "steps between logged samples; 0: none"),
    ("samples_per_log", 0, "replies logged each time"),
    ("checkpoint_every", 0, "steps between checkpoints"),
    ("eval_size", 0, "held-out examples"),
    ("eval_batch_size", 1, "examples decoded together in an evaluation"),
)


def _start_over(config, workdir: str, ckpt: checkpointing.Checkpointer,
                rules: ResumeRules) -> bool:
  """Moves the previous run aside for config.start_over; False when this run already did.

  A run started over writes start_over=True into its checkpoints, so the same
  command relaunched after a preemption resumes it instead of starting over
  again (and again).
  """
  saved = ckpt.latest_meta()
  if saved is not None:
    saved_config = saved[1].get("config", {})
    try:
      check_resumable(saved_config, config_to_dict(config), workdir, rules)
      relaunch = bool(saved_config.get("start_over"))
    except ValueError:
      relaunch = False
    if relaunch:
      log.warning("start_over: %s holds the run this config started over (checkpoint step %d, "
                  "written with start_over=True); resuming it. To start over again, use a new "
                  "workdir", workdir, saved[0])
      return False
  dest = workdir_lib.move_aside(workdir, RUN_FILES)
  if dest:
    log.warning("start_over: moved the previous run's files in %s to %s", workdir, dest)
  return True


def _logs_without_checkpoint(config, workdir: str, rules: ResumeRules) -> None:
  """Logs but no checkpoint: a rerun of the same config moves them aside, anything else stops.

  A run stopped before its first checkpoint left them; rerunning the same
  config starts that run again, so its logs go to previous/ (with a warning).
  Under another config (or none recorded) the user decides.
  """
  aside = sorted(glob.glob(os.path.join(workdir, "checkpoints", "*.unreadable*")))
  if aside:
    raise _unresumable_logs(workdir, f"its checkpoints were unreadable and are set aside "
                            f"({', '.join(os.path.basename(p) for p in aside[:4])})")
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      check_resumable(json.load(f), config_to_dict(config), workdir, rules)
  except (OSError, ValueError) as e:
    raise _unresumable_logs(workdir, f"it left no checkpoint, and {e}") from None
  dest = workdir_lib.move_aside(workdir, [n for n in RUN_FILES if n != "checkpoints"])
  log.warning("%s: the logs of a run of this config that stopped before its first checkpoint "
              "moved to %s; starting again", workdir, dest)


@dataclasses.dataclass
class _Run:
  """The mutable state of one run of the loop and the actions it schedules."""

  config: Any
  workdir: str
  evaluate: Callable[[Any], tuple[dict, list[dict]]] | None
  data: Any
  ckpt: checkpointing.Checkpointer
  nonfinite_count: Callable[[Any], tuple[int, int]] | None
  eval_log: Sequence[str] | None = None  # the eval record keys the log line shows
  frozen_digests: Mapping[str, str] = dataclasses.field(default_factory=dict)
  writer: metrics_lib.MetricWriter | None = None
  state: Any = None
  step: int = 0
  train_time: float = 0.0
  last_eval: dict = dataclasses.field(default_factory=dict)
  last_eval_step: int = -1
  next_timed_eval: float = math.inf

  @property
  def budget(self) -> float:
    return float(self.config.get("time_budget_s", 0.0) or 0.0)

  @property
  def eval_every_s(self) -> float:
    return float(self.config.get("eval_every_s", 0.0) or 0.0)

  def restore(self, init_state) -> None:
    """The latest readable checkpoint, or a fresh state; then opens the logs to continue."""
    self.state = init_state()
    restored = self.ckpt.restore_latest(self.state)
    if restored is not None:
      self.step, self.state, data_state, meta = restored
      _check_frozen(meta.get("frozen_digests"), self.frozen_digests, self.step, self.workdir)
      self.train_time = float(meta.get("train_time_s", 0.0))
      _restore_data(self.data, data_state, self.step)
      log.info("resumed from step %d in %s", self.step, self.ckpt.directory)
    elif _has_logs(self.workdir):  # every checkpoint was damaged (and set aside)
      raise _unresumable_logs(self.workdir, "no checkpoint is readable: they were set aside as "
                              "checkpoints/N.unreadable")
    # Log lines past the checkpoint would be repeated: they move aside, and
    # TensorBoard hides its events from the next step on.
    main = distributed.is_main()
    moved = metrics_lib.MetricWriter(
        self.workdir, tensorboard=False).truncate_after(self.step) if main else None
    distributed.barrier("logs truncated")  # every process then reads the same logs
    evals = [rec for rec in metrics_lib.read_jsonl(
        os.path.join(self.workdir, metrics_lib.METRICS_FILE)) if rec.get("kind") == "eval"]
    if evals:  # what `run` returns if the resumed run evaluates no more
      last = max(evals, key=lambda rec: rec["step"])
      self.last_eval_step = last["step"]
      self.last_eval = {k: v for k, v in last.items() if k not in ("step", "kind")}
    if moved:
      log.warning("log lines after step %d (written after the checkpoint) moved to %s",
                  self.step, moved)
    self.writer = metrics_lib.MetricWriter(
        self.workdir, tensorboard=self.config.get("tensorboard", True),
        purge_step=self.step + 1 if restored is not None else None) if main \
        else metrics_lib.SilentWriter()
    if self.eval_every_s:
      self.next_timed_eval = (math.floor(self.train_time / self.eval_every_s) + 1) \
          * self.eval_every_s

  def skipping_updates(self) -> int:
    """How many updates in a row were just skipped as non-finite (0 when none or not tracked)."""
    return self.nonfinite_count(self.state)[0] if self.nonfinite_count else 0

  def run_eval(self) -> None:
    if self.evaluate is None or not (self.config.eval_every or self.eval_every_s):
      return
    t0 = time.perf_counter()
    result, samples = self.evaluate(self.state)
    result = {**result, "eval_time_s": time.perf_counter() - t0, "train_time_s": self.train_time}
    self.writer.write_scalars(self.step, result, kind="eval")
    self.writer.write_samples(self.step, samples[:self.config.samples_per_log], kind="eval")
    shown = {k: v for k, v in result.items() if isinstance(v, (int, float))
             and (k in self.eval_log if self.eval_log is not None else not k.endswith("_s"))}
    log.info("eval at step %d: %s (%.1fs)", self.step,
             ", ".join(f"{k} {v:.3f}" for k, v in shown.items()), result["eval_time_s"])
    self.last_eval, self.last_eval_step = result, self.step

  def save(self) -> bool:
    """Checkpoints the current step, unless updates are being skipped (see the module doc)."""
    skipped = self.skipping_updates()
    if skipped:
      log.warning("not checkpointing step %d: the last %d updates were skipped as non-finite",
                  self.step, skipped)
      return False
    absurd = checkpointing.absurd_weight(self.state)
    if absurd:  # finite but blown up: never kept as the run's newest checkpoint
      steps = self.ckpt.steps()
      where = (f"the newest checkpoint, step {steps[-1]}, predates it" if steps else
               "no checkpoint was written before it")
      raise TrainingStopped(f"step {self.step}: weight {absurd[0]} holds {absurd[1]:.3g} (not "
                            f"finite, or > {checkpointing.ABSURD_WEIGHT:g}): the run diverged; "
                            f"not checkpointed, stopping: {where} ({self.ckpt.directory}).")
    self.ckpt.save(self.step, self.state, self.data.get_state(),
                   {"config": config_to_dict(self.config), "seed": self.config.seed,
                    "step": self.step, "train_time_s": self.train_time,
                    "frozen_digests": dict(self.frozen_digests)})
    return True

  def log_step(self, result: StepResult, seconds: float, compile_s: float,
               background_compile_s: float) -> None:
    self.writer.write_scalars(self.step, {**result.record, "step_time_s": seconds,
                                          "train_time_s": self.train_time,
                                          "compile_time_s": compile_s,
                                          "background_compile_time_s": background_compile_s})
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
        eval_log: Sequence[str] | None = None, progress: bool = True,
        on_exit: Callable[[], None] | None = None, resume_rules: ResumeRules | None = None,
        frozen: Mapping[str, Any] | None = None) -> dict:
  """Trains for config.steps steps in `workdir`, resuming from its latest checkpoint.

  Args:
    config: the experiment's ConfigDict (seed, steps, the schedule keys in the module
      docstring, samples_per_log, keep_checkpoints, tensorboard, max_consecutive_nonfinite).
    workdir: the run directory.
    init_state: () -> the initial train state (also the structure to restore into).
    train_step: (state, rng, progress) -> StepResult. rng derives from (seed,
      step); progress in [0, 1] is training time over the time budget when
      there is one, else steps over config.steps (a learning-rate clock).
    evaluate: state -> (scalars, samples), or None.
    data: the training data iterator, with get_state/set_state.
    nonfinite_count: state -> (consecutive, total) skipped non-finite updates;
      the run stops after config.max_consecutive_nonfinite in a row.
    postfix, finite_keys: record keys shown on the progress bar; whose non-finite value
      stops the run (after it is logged).
    eval_log: the eval record keys its log line shows (None: every scalar but timings).
    progress: show a tqdm progress bar on stderr.
    on_exit: called when the loop ends, however it ends, while the workdir is still
      locked: where a trainer stops its background work.
    resume_rules: the experiment's config keys that may change on resume, and the values
      of keys older runs lack (`ResumeRules`), beside the harness's own (`RUN_RULES`).
    frozen: {description: params, or a function returning them} of the models the run
      reads from outside its workdir and keeps fixed (DPO's reference, a reward model).
      Their digests go into every checkpoint; a resume whose models differ is refused,
      naming them (the checkpoint alone cannot restore what they computed).

  Returns the last eval record ({} when evaluation is off).
  """
  _check_before_writing(config, workdir)
  rules = RUN_RULES.merged(resume_rules or ResumeRules())
  # With several processes (`distributed`), the first holds the lock and writes the logs;
  # all of them run the same steps and write the checkpoints together.
  main = distributed.is_main()
  with workdir_lib.WorkdirLock(workdir) if main else contextlib.nullcontext():
    ckpt = _start_over_if_asked(config, workdir, rules)
    try:
      _check_workdir(config, workdir, ckpt, rules, main)
      r = _Run(config, workdir, evaluate, data, ckpt, nonfinite_count, eval_log,
               frozen_digests=_frozen_digests(frozen or {}))
      mesh = sharding.for_config(config)  # the state lives sharded by the rules on it
      r.restore(lambda: sharding.shard(init_state(), mesh))
      if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
          json.dump(config_to_dict(config), f, indent=2)
      _loop_then_close(r, train_step, postfix, finite_keys, progress and main, on_exit)
    finally:
      ckpt.close()
  return r.last_eval


def _disk_full(e: BaseException) -> bool:
  """Whether `e`, or an error it was raised from or during, is "no space left on device"
  (libraries wrap it: a checkpoint writer's error may only say so in its cause)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or \
        "No space left on device" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def _check_before_writing(config, workdir: str) -> None:
  """What must hold before a run writes anything: its keys, a workdir that is not a model
  directory, every process started with the same config."""
  validate_run_keys(config)
  workdir_lib.check_not_foreign(workdir)
  distributed.check_same_config(flat_config(config))


def _loop_then_close(r: _Run, train_step, postfix, finite_keys, progress: bool,
                     on_exit: Callable[[], None] | None) -> None:
  """`_loop`, then the trainer's `on_exit` and the log writer's close, however it ends; a
  full disk ends it with one message (TrainingStopped)."""
  try:
    try:
      _loop(r, train_step, postfix, finite_keys, progress)
    finally:
      try:
        if on_exit is not None:
          on_exit()
      finally:
        r.writer.close()  # a full disk may fail this too
  except Exception as e:
    if not _disk_full(e):
      raise
    raise TrainingStopped(
        f"{r.workdir}: no space left on its device (while writing at step {r.step}: {e}). "
        "Free space and run the same command again: it resumes from the newest complete "
        "checkpoint (an incomplete one is never read)") from e


def _frozen_digests(frozen: Mapping[str, Any]) -> dict[str, str]:
  return {name: checkpointing.base_digest(value() if callable(value) else value)
          for name, value in frozen.items()}


def _check_frozen(saved: Mapping[str, str] | None, now: Mapping[str, str], step: int,
                  workdir: str) -> None:
  """Refuses a resume whose fixed outside models differ from the ones the run was trained
  with (checkpoints from before digests were recorded resume with a warning)."""
  if saved is None:
    if now:
      log.warning("%s: checkpoint step %d predates digests of %s; resuming unchecked",
                  workdir, step, ", ".join(now))
    return
  changed = sorted(name for name in saved.keys() | now.keys() if saved.get(name) != now.get(name))
  if changed:
    raise ValueError(f"{workdir}: the run was trained (to step {step}) with a different "
                     f"{' and '.join(changed)} than the one loaded now; resuming would mix two "
                     "runs. Load what it was trained with, or use a new workdir")


def _check_workdir(config, workdir: str, ckpt: checkpointing.Checkpointer,
                   rules: ResumeRules, main: bool) -> None:
  """Refuses a checkpoint of a config that computes differently, and logs that no checkpoint
  can continue (`_logs_without_checkpoint`); every process waits for the check."""
  saved = ckpt.latest_meta()
  if saved is not None:
    check_resumable(saved[1].get("config", {}), config_to_dict(config), workdir, rules)
  elif not ckpt.steps() and _has_logs(workdir) and main:
    _logs_without_checkpoint(config, workdir, rules)
  distributed.barrier("workdir checked")


def _start_over_if_asked(config, workdir: str, rules: ResumeRules
                         ) -> checkpointing.Checkpointer:
  """The run's Checkpointer, after moving the previous run aside for config.start_over
  (the first process moves; the others wait for it)."""
  ckpt = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  if not config.get("start_over", False):
    return ckpt
  moved = _start_over(config, workdir, ckpt, rules) if distributed.is_main() else True
  distributed.barrier("start_over")
  if moved:
    ckpt.close()  # its directory moved: open a fresh one
    ckpt = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  return ckpt


def _loop(r: _Run, train_step, postfix: Sequence[str], finite_keys: Sequence[str],
          progress: bool) -> None:
  """Steps until config.steps, the time budget, SIGTERM or a stop (see `run`)."""
  from tqdm import tqdm

  config = r.config
  start_step, base_rng = r.step, jax.random.key(config.seed)
  # Step 0, or a scheduled evaluation lost to a crash right after its checkpoint.
  scheduled = start_step == config.steps or (
      config.eval_every and start_step % config.eval_every == 0)
  if start_step == 0 or (scheduled and r.last_eval_step != start_step):
    r.run_eval()
  if r.budget > 0 and r.train_time >= r.budget:  # resumed after its time budget ran out
    log.info("time budget of %.0f s already spent at step %d", r.budget, r.step)
    if r.last_eval_step != r.step:  # an end-of-run evaluation lost to a crash
      r.run_eval()
    return
  # A time-budgeted run ends when its training seconds run out: its bar counts those.
  timed = r.budget > 0
  bar = tqdm(total=round(r.budget) if timed else config.steps,
             initial=min(round(r.train_time), round(r.budget)) if timed else start_step,
             unit="s" if timed else "it", disable=not progress, file=sys.stderr,
             desc="train (seconds of the time budget)" if timed else "train",
             dynamic_ncols=True)
  with _Preemption() as preemption:
    try:
      while r.step < config.steps:
        compile_before, background_before = compile_seconds(), background_compile_seconds()
        t0 = time.perf_counter()
        result = train_step(r.state, jax.random.fold_in(base_rng, r.step),
                            r.train_time / r.budget if r.budget > 0 else r.step / config.steps)
        # Every process decides the schedule (evaluations, checkpoints, the time budget,
        # SIGTERM) from the first process's clock and any process's SIGTERM, in lockstep.
        seconds, stop = distributed.agree(time.perf_counter() - t0, preemption.requested)
        preemption.requested = stop
        r.state, r.step, r.train_time = result.state, r.step + 1, r.train_time + seconds
        r.log_step(result, seconds, compile_seconds() - compile_before,
                   background_compile_seconds() - background_before)
        shown = {k: f"{result.record[k]:.3f}" for k in postfix if k in result.record}
        bar.set_postfix({"step": r.step, **shown} if timed else shown)
        bar.update(min(round(r.train_time), round(r.budget)) - bar.n if timed else 1)
        _check_finite(result.record, finite_keys, r.step)
        _check_nonfinite(r, config.max_consecutive_nonfinite)
        if r.after_step():
          break
        if preemption.requested:
          if r.save():
            log.warning("checkpointed step %d after SIGTERM; exiting", r.step)
          else:
            log.warning("SIGTERM: exiting after step %d (newest checkpoint: step %s)", r.step,
                        (r.ckpt.steps() or ["none"])[-1])
          raise SystemExit(143)
      else:  # the step budget ran out (not the time budget)
        if r.last_eval_step != r.step:  # the end of the run is always evaluated
          r.run_eval()
    finally:
      bar.close()


def _restore_data(data, state, step: int) -> None:
  """data.set_state(state), or an error naming the mismatch (a state from another pipeline)."""
  expected = data.get_state()
  shape_differs = isinstance(expected, Mapping) and (
      not isinstance(state, Mapping) or set(state) != set(expected))
  try:
    if shape_differs:
      raise KeyError(f"expected keys {sorted(expected)}")
    data.set_state(state)
  except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
    raise ValueError(
        f"the data-iterator state in checkpoint step {step} ({str(state)[:200]}) does not fit "
        f"this run's data pipeline ({type(data).__name__}: {type(e).__name__}: {e}); the "
        "workdir was written by another task or loader: use a new workdir") from None


def _check_finite(record: Mapping[str, float], keys: Sequence[str], step: int) -> None:
  for key in keys:
    if not math.isfinite(record[key]):
      raise TrainingStopped(f"non-finite {key} ({record[key]}) at step {step}")


def _check_nonfinite(r: _Run, limit: int) -> None:
  consecutive = r.skipping_updates()
  if consecutive >= limit:
    steps = r.ckpt.steps()
    where = (f"the newest checkpoint, step {steps[-1]}, predates the streak"
             if steps else "no checkpoint was written before it")
    raise TrainingStopped(
        f"{consecutive} consecutive updates had a non-finite loss or gradient (step "
        f"{r.step}); stopping: {where} ({r.ckpt.directory}).")
