"""Several processes, one program: JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same experiment script. Each owns the devices of its
host; together they form one global mesh (`sharding.mesh_from_config` over
`jax.devices()`), and every jitted computation runs on all of them (SPMD). Every
process reads the same batch of prompts (a few hundred bytes) and builds the
global arrays from the same host values (`jax.device_put` onto a global
sharding takes each process's own shards of them); the rollout's rows split
over the devices like any batch. A global array comes back whole with
`to_host` (decoding the replies: cheap). The costly host work, scoring replies
with string rewards and sandboxed checks, is split: `split_rows` has each
process score its own share of the rows and gathers the scores. Random streams
do not depend on the mesh (`jax_threefry_partitionable`, on by default in this
JAX).

What a process writes: checkpoints are written by all of them together (Orbax
coordinates the shards); metrics, samples, TensorBoard events, config.json, the
run lock and the progress bar are process 0's alone (`is_main`).

`initialize_from_env` starts the runtime from the environment:
  JAXRL_COORDINATOR=host:port JAXRL_NUM_PROCESSES=N JAXRL_PROCESS_ID=i
      explicit (the local launcher `launch.local` sets these);
  JAXRL_DISTRIBUTED=auto
      `jax.distributed.initialize()` finds the cluster itself (SLURM's variables, a
      TPU VM pod's metadata); the SLURM and TPU launchers set this;
and does nothing when neither is set (one process: nothing changes).
  JAXRL_INIT_TIMEOUT_S=seconds
      how long the processes wait for each other to connect (default 300, JAX's); past
      it JAX ends them (SIGABRT), after a log line naming the coordinator and the wait.
Process 0 hosts the coordinator: a port already taken on its host is named at once.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

COORDINATOR, NUM_PROCESSES, PROCESS_ID = \
    "JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID"
AUTO = "JAXRL_DISTRIBUTED"
INIT_TIMEOUT = "JAXRL_INIT_TIMEOUT_S"


def _int_var(environ: Mapping[str, str], name: str) -> int:
  value = environ.get(name, "")
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{COORDINATOR} is set, so {name} must be an integer; got "
                     f"{value!r}") from None


def settings_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
  """The `jax.distributed.initialize` arguments the environment asks for ({} for
  auto-detection), or None for a single process. Raises ValueError naming a bad variable."""
  coordinator = environ.get(COORDINATOR, "")
  if coordinator:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"{COORDINATOR} must be host:port, got {coordinator!r}")
    count, index = _int_var(environ, NUM_PROCESSES), _int_var(environ, PROCESS_ID)
    if count < 1 or not 0 <= index < count:
      raise ValueError(f"{PROCESS_ID}={index} must be in [0, {NUM_PROCESSES}={count})")
    return {"coordinator_address": coordinator, "num_processes": count, "process_id": index,
            **_timeout(environ)}
  auto = environ.get(AUTO, "")
  if auto not in ("", "auto"):
    raise ValueError(f"{AUTO} must be 'auto' or unset, got {auto!r}")
  return _timeout(environ) if auto else None


def _timeout(environ: Mapping[str, str]) -> dict[str, int]:
  value = environ.get(INIT_TIMEOUT, "")
  if not value:
    return {}
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"{INIT_TIMEOUT} must be a whole number of seconds >= 1, got {value!r}")
  return {"initialization_timeout": int(value)}


def _check_port_free(coordinator: str) -> None:
  """Process 0 serves the coordinator at `coordinator`: a port another program holds would
  end it inside the runtime (a segfault) and leave the others waiting; named here."""
  host, _, port = coordinator.rpartition(":")
  with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("" if host in ("localhost", "0.0.0.0") else host.strip("[]"), int(port)))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise RuntimeError(f"process 0 hosts the coordinator at {coordinator}, and port "
                           f"{port} is already in use on this host; pick another port in "
                           f"{COORDINATOR}") from None
      # Another host's address (process 0 runs elsewhere from the one launching): not ours.


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> bool:
  """Starts `jax.distributed` when the environment asks for it (see the module doc);
  returns whether it did. Call it before anything else touches JAX's devices."""
  settings = settings_from_env(environ)
  if settings is None:
    return False
  # CPU devices exchange collectives over gloo (TCP): the default has none across
  # processes. (Only the CPU client reads this; GPUs and TPUs use their own.)
  if settings.get("process_id") == 0:
    _check_port_free(settings["coordinator_address"])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Past the wait, JAX ends the process (SIGABRT) saying that "another task died": this
  # line, before it, says what it was waiting for.
  log.info("jax.distributed: %s; waiting up to %d s for all processes to connect (%s)",
           f"process {settings['process_id']} of {settings['num_processes']} at coordinator "
           f"{settings['coordinator_address']}" if "process_id" in settings
           else "an auto-detected cluster", settings.get("initialization_timeout", 300),
           INIT_TIMEOUT)
  jax.distributed.initialize(**settings)
  log.info("process %d of %d; %d local and %d global devices", jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def is_main() -> bool:
  """Whether this process writes the run's logs (process 0; always so with one process)."""
  return jax.process_index() == 0


def to_host(x: Any) -> np.ndarray:
  """A (global) array's whole value on this host as numpy: gathered from the other
  processes when this one holds only some of its shards."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier of this name (nothing with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def agree(seconds: float, flag: bool) -> tuple[float, bool]:
  """(the first process's `seconds`, whether any process's `flag` is set), the same on
  every process: a run's schedule is decided from these, so the processes never part
  ways over a clock or a signal (one process: the values as given)."""
  if jax.process_count() == 1:
    return seconds, flag
  from jax.experimental import multihost_utils

  gathered = np.asarray(multihost_utils.process_allgather(
      np.array([seconds, float(flag)], np.float64)))
  return float(gathered[0, 0]), bool(gathered[:, 1].any())


def check_same_config(flat: Mapping[str, Any]) -> None:
  """Raises ValueError on every process, naming the keys, unless all processes hold the same
  flat config: processes started with different settings would otherwise train a silent
  mixture (each computes its share under its own learning rate) or crash far from the
  cause. A digest is compared first; only on a mismatch are the configs gathered."""
  if jax.process_count() == 1:
    return
  import hashlib
  import json

  from jax.experimental import multihost_utils

  text = json.dumps(flat, sort_keys=True, default=repr).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest))
  if (digests == digests[0]).all():
    return
  sizes = np.asarray(multihost_utils.process_allgather(np.array([len(text)], np.int32)))[:, 0]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:len(text)] = np.frombuffer(text, np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(padded))
  configs = [json.loads(bytes(everyone[i, :sizes[i]])) for i in range(len(sizes))]
  first = configs[0]
  lines = []
  for i, other in enumerate(configs[1:], start=1):
    keys = sorted(k for k in first.keys() | other.keys()
                  if first.get(k, "<unset>") != other.get(k, "<unset>"))
    if keys:
      lines.append(f"process {i}: " + "; ".join(
          f"{k} = {other.get(k, '<unset>')!r} (process 0: {first.get(k, '<unset>')!r})"
          for k in keys[:4]))
  raise ValueError("the processes of this run were started with different configs; start "
                   "every process with the same flags. " + " | ".join(lines[:4]))


class SplitRows:
  """A host function of rows (a reward or a grader: `fn(completions, examples)` returning
  f32[B], or (f32[B], {name: f32[B]})) computed by each process on its own contiguous
  share of the B rows, the results gathered back whole on every process.

  The host work of a step (string rewards, sandboxed checks) thus splits over the
  processes as the device work splits over the mesh. The function is pure per row, so
  the gathered values are those of one process computing every row. A `time_limit`
  reward's `last_timeouts` is summed over the processes. Use `split_rows`, which returns
  `fn` itself with one process.
  """

  def __init__(self, fn: Callable[..., Any]):
    self.fn = fn
    self.last_timeouts = 0

  def __call__(self, completions: Sequence[str], examples: Sequence[Any]):
    from jax.experimental import multihost_utils

    rows, count, index = len(completions), jax.process_count(), jax.process_index()
    share = -(-rows // count)
    lo, hi = min(index * share, rows), min((index + 1) * share, rows)
    result = self.fn(list(completions[lo:hi]), list(examples[lo:hi]))
    total, components = result if isinstance(result, tuple) else (result, None)
    names = sorted(components or {})
    # One f32[share, 1 + M] block per process (padded to `share` rows), then one gather.
    block = np.zeros((share, 1 + len(names)), np.float32)
    block[:hi - lo, 0] = np.asarray(total, np.float32)
    for j, name in enumerate(names):
      block[:hi - lo, 1 + j] = np.asarray(components[name], np.float32)
    timeouts = int(getattr(self.fn, "last_timeouts", 0))
    gathered = np.asarray(multihost_utils.process_allgather(block))
    self.last_timeouts = int(np.asarray(multihost_utils.process_allgather(
        np.array([timeouts], np.int64))).sum())
    whole = gathered.reshape(count * share, 1 + len(names))[:rows]
    if components is None:
      return whole[:, 0]
    return whole[:, 0], {name: whole[:, 1 + j] for j, name in enumerate(names)}


def split_rows(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`SplitRows(fn)` with several processes; `fn` itself with one."""
  return SplitRows(fn) if jax.process_count() > 1 else fn
