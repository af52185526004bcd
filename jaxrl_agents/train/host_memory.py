"""Keep freed host memory in the process, so XLA:CPU does not fault its temporaries in anew.

On every execution XLA:CPU allocates one buffer for all of an executable's temporaries
(5.25 GB for SmolLM2's train step at 8 x 256 tokens) and frees it at the end. glibc
serves a request that large with `mmap` and gives it back with `munmap`, so the next
execution touches fresh pages: 1.4M page faults on every step, about 1.5 s of a 13 s
step on a 2-core EPYC. With glibc told to serve every request from one heap (one arena,
no `mmap`) and never to give the heap's top back (no trimming), the freed buffer stays
mapped and the next execution reuses its pages.

The price, and why it is not the default everywhere:
- the process keeps its peak heap for its lifetime instead of returning it between calls;
- with one arena, threads that allocate at the same time wait for each other. The GRPO
  experiment compiles its first update in a background thread while the sampler
  compiles (`precompile.py`), and there the first iteration took 34-38 s instead of
  28 s, with no gain in the steady state (its temporaries are small).
So experiments choose it (`--host_memory=retain`: the default of the SFT, reward-model
and DPO experiments, where it was measured to pay).

`retain_freed_memory` must run before XLA starts its threads (before the first
computation): a thread that already has an arena of its own keeps it, and its large
requests go on being mapped and unmapped (so may a new thread that inherits the arena
of one that exited). `RETAIN_FREED_MEMORY_ENV`, set before a process starts, is the
strict form. `release_freed_memory` hands the free part of the heap back at once.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# The same settings as environment variables, which glibc reads when a process starts:
# for a process that does not call retain_freed_memory (a benchmark's baseline, to
# compare systems on equal terms). The variable is read as an unsigned size, so "never
# trim" is a huge number there rather than -1.
RETAIN_FREED_MEMORY_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                           "MALLOC_TRIM_THRESHOLD_": str(2**62)}


def is_glibc() -> bool:
  """Whether this process runs on glibc (the only malloc these settings are for)."""
  return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  if not is_glibc():
    return None
  libc = ctypes.CDLL("libc.so.6")
  libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
  return libc


def retain_freed_memory() -> bool:
  """Tells glibc's malloc to keep freed memory for reuse; True if every setting took
  effect (False off Linux/glibc)."""
  libc = _glibc()
  if libc is None:
    return False
  # mallopt takes an int; glibc reads the trim threshold as size_t, so -1 means "never".
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  applied = [libc.mallopt(param, value) == 1 for param, value in settings]  # each one tried
  return all(applied)


def release_freed_memory() -> bool:
  """Hands the heap's free pages back to the system now (glibc's `malloc_trim`, which
  works whatever the trim threshold); True if any were released."""
  libc = _glibc()
  return libc is not None and libc.malloc_trim(0) == 1
