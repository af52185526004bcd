"""Who owns a run directory, and moving an old run's files aside instead of deleting them.

`WorkdirLock` makes a workdir single-writer: two runs on one workdir would
interleave metrics.jsonl, overwrite each other's config.json and silently
skip each other's checkpoint steps. The lock is an advisory `flock` on
`<workdir>/run.lock`, which the kernel releases when its process dies however it
dies, so a lock left by a killed run is never mistaken for a live one; the
file also names the holder (pid, host, start time) for the error message and
for the warning when a dead run's lock is taken over.

`check_not_foreign` refuses a directory that holds something other than a run (a model
directory, an export) before a run writes into it: a run's config.json would replace
the model's.

`move_aside` is how a run "starts over": the previous run's files go to
`<workdir>/previous/<UTC time>/`, never to the bin.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Sequence

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
PREVIOUS_DIR = "previous"


class WorkdirBusy(RuntimeError):
  """Another live process is running in this workdir."""


# Files a run never writes at the top of its workdir and model directories hold: weights
# (Hugging Face, PEFT, GGUF, PyTorch), tokenizers, an Orbax checkpoint's own top level.
_MODEL_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt")
_MODEL_NAMES = frozenset({
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
    "adapter_config.json", "special_tokens_map.json", "_METADATA", "_CHECKPOINT_METADATA",
    "manifest.ocdbt", "model.safetensors.index.json"})


def _model_config(path: str) -> bool:
  """Whether config.json is a model's (Hugging Face's keys), not a run's."""
  try:
    with open(path, "rb") as f:
      config = json.loads(f.read(1 << 20))
  except (OSError, ValueError):
    return True  # not a run's: a run writes JSON it can read back
  return not isinstance(config, dict) or "model_type" in config or "architectures" in config


def check_not_foreign(workdir: str) -> None:
  """Raises ValueError, naming what it found, if `workdir` is a file or a directory holding a
  model (weights, a tokenizer, a model's config.json): a run there would overwrite it."""
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} is a file, not a directory")
  if not os.path.isdir(workdir):
    return
  names = os.listdir(workdir)
  found = sorted(n for n in names if n in _MODEL_NAMES or n.endswith(_MODEL_SUFFIXES))
  if "config.json" in names and _model_config(os.path.join(workdir, "config.json")):
    found.insert(0, "config.json (a model's, not a run's)")
  if found:
    raise ValueError(f"workdir {workdir!r} holds {', '.join(found[:4])}: a model directory or an "
                     "export, not a run. A run writes its own config.json there; use a new "
                     "workdir (the model can stay where it is as --config.model)")


def _holder_text(info: dict) -> str:
  return (f"process {info.get('pid', '?')} on host {info.get('host', '?')} "
          f"(started {info.get('started', '?')})")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


class WorkdirLock:
  """Holds `<workdir>/run.lock` for the life of a `with` block; refuses a workdir in use."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: int | None = None

  def _read(self, fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", "replace").strip()
    try:
      info = json.loads(text) if text else {}
    except json.JSONDecodeError:
      info = None
    if not isinstance(info, dict):
      return {"pid": "?", "host": "?", "started": f"unreadable lock file: {text[:80]!r}"}
    return info

  def __enter__(self) -> WorkdirLock:
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = self._read(fd)
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      raise WorkdirBusy(f"{self.workdir} is in use by {_holder_text(holder)}; wait for it to "
                        "finish, stop it, or use another workdir") from None
    previous = self._read(fd)
    if previous:
      same_host = previous.get("host") == socket.gethostname()
      pid = previous.get("pid")
      if same_host and isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
        # flock free but the named process lives: a filesystem without flock. Be safe.
        os.close(fd)
        raise WorkdirBusy(f"{self.workdir} names live {_holder_text(previous)} in {self.path}; "
                          "if that process is not a run, delete the lock file")
      log.warning("%s: taking over the lock of %s, which is no longer running (it did not "
                  "exit cleanly)", self.workdir, _holder_text(previous))
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is None:
      return
    # An empty file marks a clean exit. The file itself stays: unlinking it
    # would let a waiting process lock a name that no longer exists.
    os.ftruncate(self._fd, 0)
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None


def new_previous_dir(workdir: str) -> str:
  """A new, empty `<workdir>/previous/<UTC time>/` for files a run will no longer use."""
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
  dest = os.path.join(workdir, PREVIOUS_DIR, stamp)
  n = 1
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(workdir, PREVIOUS_DIR, f"{stamp}.{n}")
  os.makedirs(dest)
  return dest


def move_aside(workdir: str, names: Sequence[str]) -> str | None:
  """Moves the existing `names` (files or directories) of `workdir` to a new previous/ folder.

  Returns the destination, or None when none of them existed.
  """
  present = [n for n in names if os.path.lexists(os.path.join(workdir, n))]
  if not present:
    return None
  dest = new_previous_dir(workdir)
  for name in present:
    os.rename(os.path.join(workdir, name), os.path.join(dest, name))
  return dest
