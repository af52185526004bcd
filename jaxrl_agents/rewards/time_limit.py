"""A time limit on every host reward call: a completion scored past it gets 0 and is counted.

Rewards run on the host over text the policy wrote, and the policy is
optimised against them: a reply that makes a reward slow (a regex that
backtracks, a parser on deep nesting) would stall every step it appears in.
The readers of this package are linear in the reply's length, but a reward
brought by a user need not be, so

    reward_fn = TimeLimited(from_config({"math_strict": 1.0}), seconds=10.0)

scores each completion in a worker process and gives up on one that takes
longer than `seconds`: that completion scores 0 (its total and every
component), the worker is killed and restarted, and the step goes on. The
other completions of the batch score as usual, since each is scored by its
own call, `reward([completion], [example], **row_kwargs)`; this assumes, as
every registered reward does, that a completion's score does not depend on
the rest of its batch.

Why a process: a Python thread cannot be stopped, and SIGALRM reaches only the
main thread and waits for a C call (a regex match) to return. The worker is
started with "spawn", never fork: the trainer runs JAX's threads, and a fork
of a multi-threaded process can deadlock in the child. One worker serves every
`TimeLimited` of the Python process: it starts at the first call and stays,
so its start-up (a fresh interpreter importing the rewards, under a second;
not the running script, see `_main_module_hidden`) is paid once, and again
only after a timeout; start-up and loading a reward do not count against the
limit.

What the worker needs and what comes back:
* The reward must pickle (registered rewards, `functools.partial` of them,
  and the combinators of `combine.py` built from them do). One that does not
  pickle or does not load in the worker runs in-process, without a limit,
  with a warning logged once.
* An exception raised by the reward comes back as the same exception type
  with its message, noted with the completion's index and the worker's
  traceback: a malformed example is a user error, not a timeout.
* Keyword arguments with one entry per completion (a sequence or array of
  length B, e.g. `lengths=`) are split per completion; any other value goes
  to every call unchanged.

How the count reaches the caller: the total and components are exactly what
the reward returns, with the timed-out rows set to 0, and nothing is added to
them (a combinator's components are logged as rewards and read by name by
component advantages). The count is kept on the wrapper instead:
`last_timeouts` (int) and `last_timed_out` (bool[B]) describe its latest
call, and `timeouts(reward_fn)` reads it for any reward (0 for one without a
limit); `rollout.records` logs it as the metric "reward_timeouts".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents.rewards._checks import as_rewards, check_batch
from jaxrl_agents.rewards.combine import CombinedReward

log = logging.getLogger(__name__)

_CONTEXT = multiprocessing.get_context("spawn")
# Starting the worker (a fresh interpreter and its imports) and loading a reward are
# not scoring: they get this long, on a slow machine under load, before it is an error.
_STARTUP_TIMEOUT_S = 300.0
_TIMED_OUT = object()  # a completion's result when its scoring ran past the limit
_NOT_LOADED = object()  # ... when the worker cannot load the reward
_keys = itertools.count()
_warned: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    log.warning(message)


# ----------------------------------------------------------------------------
# The worker process.


def _serve(conn) -> None:
  """The worker's loop: load rewards by key, score one completion per request.

  Replies ("ok", result) or ("error", pickled exception, traceback text). Ends
  when the parent's end of the pipe closes (the parent exited or killed it).
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
  _die_with_parent()
  rewards: dict[int, Any] = {}
  while True:
    try:
      request = conn.recv_bytes()
    except (EOFError, OSError):
      return
    try:
      kind, key, *args = pickle.loads(request)  # here, so that a bad request is answered
      if kind == "load":
        rewards[key] = pickle.loads(args[0])
        result = None
      else:
        completions, examples, kwargs = args
        result = rewards[key](completions, examples, **kwargs)
      conn.send(("ok", result))
    except Exception as e:  # noqa: BLE001 (every error goes back to the caller)
      conn.send(("error", _portable(e), traceback.format_exc()))


def _die_with_parent() -> None:
  """Asks Linux to SIGKILL the worker when the trainer dies (kill -9, OOM), so a reward
  stuck in a loop does not keep a core busy forever. Elsewhere the worker ends when its
  current call returns and it finds the pipe closed."""
  if not sys.platform.startswith("linux"):
    return
  try:
    import ctypes
    import os

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the trainer died before the request above took effect
      os._exit(0)
  except (OSError, AttributeError):
    pass


def _portable(e: Exception) -> bytes:
  """`e` pickled, or a RuntimeError with its type and message if it does not round-trip."""
  try:
    payload = pickle.dumps(e)
    pickle.loads(payload)
    return payload
  except Exception:  # noqa: BLE001 (an exception class with a custom __init__, say)
    return pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))


_WAIT_SLICE_S = 0.25


class _Worker:
  """The shared worker process, its end of the pipe and the reward keys it has loaded."""

  def __init__(self):
    self.conn, child = _CONTEXT.Pipe()
    self.process = _CONTEXT.Process(target=_serve, args=(child,), daemon=True,
                                    name="reward-time-limit-worker")
    with _main_module_hidden():
      self.process.start()
    child.close()
    self.loaded: set[int] = set()

  def request(self, message: tuple, seconds: float):
    """The worker's reply to `message`, or _TIMED_OUT if none came within `seconds`."""
    self.conn.send(message)
    deadline = time.monotonic() + seconds
    try:
      # Waited in slices: a Ctrl-C that the kernel hands to another thread (XLA's, say)
      # interrupts no wait of this one, and is acted on between slices.
      while not self.conn.poll(min(max(deadline - time.monotonic(), 0.0), _WAIT_SLICE_S)):
        if time.monotonic() >= deadline:
          return _TIMED_OUT
      return self.conn.recv()
    except (EOFError, OSError):
      self.process.join(5.0)
      raise RuntimeError(f"the reward worker died (exit code {self.process.exitcode}) while "
                         f"handling a {message[0]!r} request") from None
    except BaseException:
      # Interrupted (Ctrl-C) between the request and its reply: the reply would
      # answer the next request instead. Only a new worker starts in step.
      self.kill()
      raise

  def kill(self) -> None:
    self.process.kill()
    self.process.join(5.0)
    self.conn.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
  """Starts processes that do not import the running script as their own `__main__`.

  Spawn imports the parent's main module in the child so that functions
  defined there unpickle. The worker needs none (a reward it cannot load runs
  in-process), and the import would run a script without an
  `if __name__ == "__main__"` guard a second time, or import all of JAX for an
  experiment script. Spawn reads `sys.modules["__main__"]` only while it starts
  the child; a bare module there has neither the file nor the name it looks for.
  """
  main = sys.modules["__main__"]
  sys.modules["__main__"] = types.ModuleType("__main__")
  try:
    yield
  finally:
    sys.modules["__main__"] = main


_worker: _Worker | None = None
_lock = threading.Lock()


def _running_worker() -> _Worker:
  global _worker
  if _worker is None or not _worker.process.is_alive():
    _worker = _Worker()
  return _worker


def _discard_worker() -> None:
  global _worker
  if _worker is not None:
    _worker.kill()
    _worker = None


def _in_worker(key: int, payload: bytes, message: tuple, seconds: float):
  """The reply to a scoring `message` for the reward `key`, or _TIMED_OUT (worker restarted).

  Raises:
    _LoadError: the reward does not load in the worker.
  """
  with _lock:
    worker = _running_worker()
    if key not in worker.loaded:
      _load(worker, key, payload)
    try:
      reply = worker.request(message, seconds)
    except RuntimeError:
      _discard_worker()
      raise
    if reply is _TIMED_OUT:
      _discard_worker()  # it may be stuck in C code: only killing it stops it
    return reply


def _load(worker: _Worker, key: int, payload: bytes) -> None:
  """Loads a pickled reward in the worker (which may still be starting) under `key`."""
  try:
    reply = worker.request(("load", key, payload), _STARTUP_TIMEOUT_S)
  except RuntimeError as e:  # it died starting
    _discard_worker()
    raise _LoadError(str(e)) from e
  if reply is _TIMED_OUT:
    _discard_worker()
    raise _LoadError(f"no reply in {_STARTUP_TIMEOUT_S:.0f} s")
  if reply[0] != "ok":  # the worker is fine; this reward's module does not import there, say
    raise _LoadError(reply[2].strip().splitlines()[-1])
  worker.loaded.add(key)


class _LoadError(Exception):
  """The reward could not be loaded in the worker."""


# ----------------------------------------------------------------------------
# The wrapper.


class TimeLimited:
  """A reward whose every completion must be scored within `seconds` (see the module docstring).

  Called like the reward it wraps, `fn(completions, examples, **kwargs)`, and
  returns what it returns (f32[B], or (total f32[B], {name: f32[B]}) for a
  combinator), with completions scored past the limit set to 0.

  Args:
    reward: a picklable reward function or combinator.
    seconds: the limit per completion, > 0.

  Attributes:
    last_timed_out: bool[B], which completions of the latest call ran past the limit.
    last_timeouts: how many did.
  """

  def __init__(self, reward, seconds: float):
    if not callable(reward):
      raise TypeError(f"TimeLimited needs a callable reward, got {reward!r}")
    if isinstance(seconds, bool) or not (isinstance(seconds, int | float) and seconds > 0
                                         and math.isfinite(seconds)):
      raise ValueError(f"the reward time limit must be a finite number of seconds > 0, "
                       f"got {seconds!r}")
    self.reward = reward
    self.seconds = float(seconds)
    self.name = getattr(getattr(reward, "func", reward), "__name__", type(reward).__name__)
    self.last_timed_out = np.zeros(0, bool)
    self._key = next(_keys)
    self._payload = self._pickled(reward)
    # A combinator's component names, to fill a call whose every completion timed out.
    self._returns_components = isinstance(reward, CombinedReward)
    self._component_names = reward.names if self._returns_components else ()

  def _pickled(self, reward) -> bytes | None:
    try:
      return pickle.dumps(reward)
    except Exception as e:  # noqa: BLE001 (pickling raises several types)
      self._run_in_process(f"it cannot be pickled ({type(e).__name__}: {e})")
      return None

  def _run_in_process(self, reason: str) -> None:
    self._payload = None
    _warn_once(f"reward {self.name} runs in-process with NO time limit: {reason}. Define it "
               f"at module level (or register it) so that a worker process can load it.")

  @property
  def last_timeouts(self) -> int:
    """How many completions of the latest call ran past the limit (and scored 0)."""
    return int(self.last_timed_out.sum())

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any):
    check_batch(f"time-limited {self.name}", completions, examples)
    batch = len(completions)
    self.last_timed_out = np.zeros(batch, bool)
    if self._payload is None or batch == 0:
      return self.reward(completions, examples, **kwargs)
    results = []
    for i in range(batch):
      result = self._score_one(completions, examples, kwargs, i, batch)
      if result is _NOT_LOADED:  # the whole batch runs in-process
        return self.reward(completions, examples, **kwargs)
      results.append(result)
    return self._assemble(results, batch)

  def _score_one(self, completions, examples, kwargs, i: int, batch: int):
    """The reward of completion i alone, _TIMED_OUT, or _NOT_LOADED."""
    row_kwargs = {k: _row(v, i, batch) for k, v in kwargs.items()}
    message = ("score", self._key, [completions[i]],
               None if examples is None else [examples[i]], row_kwargs)
    try:
      reply = _in_worker(self._key, self._payload, message, self.seconds)
    except _LoadError as e:
      self._run_in_process(f"the worker cannot load it ({e})")
      return _NOT_LOADED
    if reply is _TIMED_OUT:
      self.last_timed_out[i] = True
      log.warning("reward %s: completion %d (%d characters, starting %r) ran past the %.3g s "
                  "limit; it scores 0", self.name, i, len(completions[i]),
                  completions[i][:60], self.seconds)
      return _TIMED_OUT
    if reply[0] == "error":
      error = pickle.loads(reply[1])
      error.add_note(f"(raised by reward {self.name} on completion {i} in the reward worker)\n"
                     f"{reply[2]}")
      raise error
    return reply[1]

  def _assemble(self, results: list, batch: int):
    """The batch's f32[B] (or (total, components)) from one result per completion."""
    scored = [r for r in results if r is not _TIMED_OUT]
    if scored:
      self._returns_components = isinstance(scored[0], tuple)
    if not self._returns_components:
      return as_rewards([0.0 if r is _TIMED_OUT else self._single(r, "reward") for r in results])
    if scored:
      self._component_names = tuple(scored[0][1])
    total = as_rewards([0.0 if r is _TIMED_OUT else self._single(r[0], "total")
                        for r in results])
    components = {name: as_rewards([0.0 if r is _TIMED_OUT else self._single(r[1][name], name)
                                    for r in results])
                  for name in self._component_names}
    return total, components

  def _single(self, value, what: str) -> float:
    if value is None:
      raise TypeError(f"reward {self.name} returned None for one completion; a reward returns "
                      "f32[B]")
    value = np.asarray(value, np.float32).reshape(-1)
    if value.shape != (1,):
      raise ValueError(f"reward {self.name} returned {value.size} {what} values for one "
                       f"completion, expected 1")
    return float(value[0])

  def __repr__(self) -> str:
    return f"TimeLimited({self.reward!r}, seconds={self.seconds})"


def _row(value: Any, i: int, batch: int) -> Any:
  """Entry i of a per-completion keyword value (length B), else the value itself."""
  if isinstance(value, str | bytes | Mapping):
    return value
  if isinstance(value, Sequence) and len(value) == batch:
    return value[i:i + 1]
  if hasattr(value, "__array__"):
    array = np.asarray(value)
    if array.ndim >= 1 and array.shape[0] == batch:
      return array[i:i + 1]
  return value


def timeouts(reward_fn) -> int:
  """Completions of `reward_fn`'s latest call that ran past its time limit; 0 without one."""
  return int(getattr(reward_fn, "last_timeouts", 0))  # a TimeLimited, or a sum of rewards
