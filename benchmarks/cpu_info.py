"""What CPU a benchmark ran on: machines of one kind differ (AVX2 only, or AVX-512 with AMX).

The same code runs 2-5x faster on some than on others, and bf16 is only fast
where the CPU has bf16 matrix units, so every benchmark records this next to
its figures.
"""

from __future__ import annotations

import os


def describe() -> dict:
  """{"cpu": model name, "cores": usable cores, "avx512": bool, "amx_bf16": bool}."""
  model, flags = "unknown", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
          model = value.strip()
        elif key.strip() == "flags" and not flags:
          flags = set(value.split())
  except OSError:  # not Linux: the figures still stand, without the CPU's name
    pass
  return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "avx512": "avx512f" in flags,
          "amx_bf16": "amx_bf16" in flags}
