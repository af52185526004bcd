"""host_memory: a large buffer freed by one XLA execution is reused by the next one."""

import os
import subprocess
import sys

import pytest

from jaxrl_agents.train import host_memory

# Calls a jitted function whose 64 MiB output is freed before the next call, and prints
# the page faults (ru_minflt) of five calls after ten warm-up calls (the heap grows to a
# few such buffers at first, as the runtime frees them a little late).
_PROBE = """
import ctypes, resource, sys, time
# 4 KiB pages only: with transparent huge pages on "always" a buffer faults far fewer times.
ctypes.CDLL("libc.so.6").prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from jaxrl_agents.train import host_memory
if sys.argv[1] == "retain":
  assert host_memory.retain_freed_memory()
import jax, jax.numpy as jnp
double = jax.jit(lambda x: x * 2.0 + 1.0)
x = jnp.ones((16 * 2**20,), jnp.float32)
def call():
  y = double(x)
  y.block_until_ready()
  del y
  time.sleep(0.05)  # the runtime frees the output on its own thread
for _ in range(10):
  call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  call()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
_PAGES_PER_CALL = 64 * 2**20 // 4096


def _faults(mode: str, **malloc_env) -> int:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
  r = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                     timeout=120, env={**env, **malloc_env, "XLA_FLAGS": ""})
  assert r.returncode == 0, r.stderr
  return int(r.stdout.split()[-1])


@pytest.mark.skipif(not host_memory.is_glibc(), reason="the setting is glibc's")
def test_freed_xla_buffers_are_reused_without_page_faults():
  retained = _faults("retain")
  system = _faults("system")
  # The output is allocated on one of XLA's threads, in an arena of its own unless there
  # is only one: there, no mmap and no trimming alone do not stop the faults.
  own_arenas = _faults("system", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**62))
  # glibc's defaults map and unmap the buffer on every call: every page faults again.
  assert system >= 5 * _PAGES_PER_CALL * 0.9, system
  assert own_arenas >= 5 * _PAGES_PER_CALL * 0.9, own_arenas
  assert retained < _PAGES_PER_CALL // 4, retained
