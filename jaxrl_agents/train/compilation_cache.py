"""JAX's persistent compilation cache in a directory only this user can write.

A cache entry is a compiled program that JAX loads and runs: whoever can write the
cache directory can make a run execute their code. So the cache must be private to
the user who runs: the directory owned by them and writable by nobody else, and no
directory above it that others could rename it out of (writable by others without the
sticky bit that /tmp has). `private_cache_dir` creates it that way or says why a
directory is not private. A damaged entry is not a security problem: JAX warns and
compiles the program again (tests/test_faults.py).
"""

from __future__ import annotations

import os
import stat

CACHE_NAME = ".jax_compilation_cache"


def default_private_dir() -> str:
  """The fallback: the user's own cache directory ($XDG_CACHE_HOME or ~/.cache)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxrl_agents", "jax_compilation_cache")


def why_not_private(directory: str) -> str | None:
  """None when `directory` (an existing path) is private to this user, else the reason."""
  real = os.path.realpath(directory)
  try:
    st = os.stat(real)
  except OSError as e:
    return f"it cannot be read ({e.strerror})"
  if not stat.S_ISDIR(st.st_mode):
    return "it is not a directory"
  if st.st_uid != os.geteuid():
    return f"it is owned by user id {st.st_uid}, not by this user ({os.geteuid()})"
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    return f"others may write to it (mode {stat.S_IMODE(st.st_mode):o})"
  parent = os.path.dirname(real)
  while True:
    pst = os.stat(parent)
    shared = pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX
    if shared:
      return (f"{parent} above it may be written by others (mode "
              f"{stat.S_IMODE(pst.st_mode):o}, no sticky bit), who could put another "
              "directory in its place")
    if parent == os.path.dirname(parent):
      return None
    parent = os.path.dirname(parent)


def private_cache_dir(directory: str) -> str | None:
  """Creates `directory` (mode 0700, parents as needed) unless it exists; returns None when it
  is private to this user (`why_not_private`), else the reason it is not."""
  try:
    os.makedirs(directory, mode=0o700, exist_ok=True)
  except OSError as e:
    return f"it cannot be created ({e.strerror})"
  return why_not_private(directory)
