"""Ahead-of-time compilation in a background thread, for a jitted function's likely shapes.

A run's first update cannot compile until its first rollout has been sampled:
the update's shapes come from the rollout. On XLA:CPU that compile is the
largest part of the first step (tracing, lowering and 15 s of XLA compilation
for SmolLM2's update, against 6 s for the sampler's), and it runs on one
core. When the batch's shapes can be predicted before sampling (a
single-turn step: the prompts' width plus the full reply budget), the update
can be traced and compiled in a thread while the main thread compiles and
runs the rollout: the XLA compiler releases the GIL, so on two cores the two
compiles proceed side by side.

`Precompiled` wraps a jitted function. `start(*specs)` begins compiling it
for arguments shaped like `specs` (arrays or `jax.ShapeDtypeStruct`s);
calling it with arguments of those exact shapes, dtypes and tree structure
waits for that compile and runs the compiled executable; any other call goes
to the jitted function as before. Results are the same either way (the same
program, compiled once). The compiled executable is kept and reused for its
shapes: calling the jitted function again for them would trace and lower it
again (seconds for a 30-layer update), even with the compile itself cached.

Compiles may be started on a guess (shapes a run will likely reach later):
one the thread has not begun when a call needs it is withdrawn and the call
compiles on its own thread, rather than waiting behind the guesses queued
before it; a start for shapes already called does nothing.

One device only: the compiled executable takes the default placement.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import jax

Signature = tuple[Any, tuple[tuple[tuple[int, ...], Any, bool], ...]]


def signature(args: tuple, kwargs: dict | None = None) -> Signature:
  """What a compiled executable is specific to: the tree structure (static fields included)
  and each leaf's shape, dtype and weak type."""
  leaves, treedef = jax.tree.flatten((args, kwargs or {}))
  return treedef, tuple(_leaf_type(x) for x in leaves)


def _leaf_type(x) -> tuple[tuple[int, ...], Any, bool]:
  if isinstance(x, jax.ShapeDtypeStruct):
    return tuple(x.shape), x.dtype, bool(x.weak_type)
  aval = jax.typeof(x)  # a Python scalar is weakly typed, a NumPy array is not
  return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def spec_of(tree):
  """`jax.ShapeDtypeStruct`s of a pytree's arrays (other leaves as they are): what tracing
  reads, so a compile can start without holding arrays another thread may donate."""
  def one(x):
    if isinstance(x, jax.Array):
      aval = jax.typeof(x)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=aval.weak_type)
    return x
  return jax.tree.map(one, tree)


_QUEUE: queue.Queue | None = None
_RUNNING: concurrent.futures.Future | None = None  # the compile the thread is in
# The background compile thread's name: the run harness counts the compile time spent
# in it apart (metrics `background_compile_time_s`).
THREAD_NAME = "precompile"


def _submit(fn: Callable[[], Any]) -> concurrent.futures.Future:
  """Runs fn in the one background compile thread, after what was submitted before it.

  One thread, so compiles queue in the order they were started (the first one
  needed first) and use one core at most. A daemon thread: a run stopping
  (preemption) does not wait for the compiles queued; at exit it waits for the one
  under way only (`_drain`).
  """
  global _QUEUE
  if _QUEUE is None:
    _QUEUE = queue.Queue()
    threading.Thread(target=_work, args=(_QUEUE,), name=THREAD_NAME, daemon=True).start()
    atexit.register(_drain, _QUEUE)
  future = concurrent.futures.Future()
  _QUEUE.put((fn, future))
  return future


def _work(jobs: queue.Queue) -> None:
  global _RUNNING
  while True:
    fn, future = jobs.get()
    if not future.set_running_or_notify_cancel():
      continue  # withdrawn before it began (`Precompiled.__call__`), or the process exits
    _RUNNING = future
    try:
      future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
      future.set_exception(e)
    finally:
      _RUNNING = None


def _drain(jobs: queue.Queue) -> None:
  """At exit: withdraws the queued compiles and waits for the one under way, which would
  otherwise still be inside the compiler while the interpreter and the backend shut down
  (a crash at exit, after the run's work is saved). Compiles started on a guess
  (GRPO's `pack_compile_ahead`) may still be queued when a run ends."""
  while True:
    try:
      _, future = jobs.get_nowait()
    except queue.Empty:
      break
    future.cancel()
  running = _RUNNING
  if running is not None:
    concurrent.futures.wait([running])


class Precompiled:
  """A jitted function that can compile ahead of its first call, in a background thread.

  Args:
    jitted: the `jax.jit`-wrapped function (its donation and static arguments hold).
    name: what log messages call it.
  """

  def __init__(self, jitted: Callable, name: str):
    self._jitted = jitted
    self._name = name
    self._compiled: dict[Signature, concurrent.futures.Future] = {}
    self._called: set[Signature] = set()  # shapes the jitted function compiled on call
    self.hits = 0  # calls answered by an ahead-of-time compile (tests and logs read it)
    self.withdrawn = 0  # started compiles a call needed before the thread began them

  def start(self, *args, **kwargs) -> None:
    """Begins compiling for arguments shaped like these (returns at once; a second start
    for the same shapes, or a start for shapes already called, does nothing)."""
    key = signature(args, kwargs)
    if key in self._compiled or key in self._called:
      return
    args, kwargs = spec_of((args, kwargs))
    self._compiled[key] = _submit(lambda: self._jitted.trace(*args, **kwargs).lower().compile())

  def __call__(self, *args, **kwargs):
    key = signature(args, kwargs)
    future = self._compiled.get(key)
    if future is not None and future.cancel():  # still queued: compiling here is sooner
      del self._compiled[key]
      self.withdrawn += 1
      future = None
    if future is None:
      self._called.add(key)
      return self._jitted(*args, **kwargs)
    try:
      compiled = future.result()
    except Exception as e:  # noqa: BLE001 - the call below raises it again if it is real
      logging.warning("ahead-of-time compile of %s failed (%s: %s); compiling on call",
                      self._name, type(e).__name__, e)
      self._compiled = {k: f for k, f in self._compiled.items() if f is not future}
      return self._jitted(*args, **kwargs)
    self.hits += 1
    return compiled(*args, **kwargs)

  def wait(self) -> None:
    """Blocks until every started compile has finished (or failed)."""
    concurrent.futures.wait(list(self._compiled.values()))
