"""Run logging: metrics.jsonl, samples.jsonl and TensorBoard event files in the workdir.

metrics.jsonl has one JSON object per line, `{"step": s, "kind": k, ...}` with
kind "train" or "eval"; samples.jsonl has one line per logged completion. On
resume from a checkpoint at step s, lines for steps after s are dropped first
(`truncate_after`), so a resumed run's files read as if it never stopped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _plain(value: Any) -> Any:
  """JSON-friendly scalars: numpy/jax scalars to float/int, NaN/inf kept as strings."""
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_plain(v) for v in value]
  if isinstance(value, str | bool) or value is None:
    return value
  arr = np.asarray(value)
  if arr.ndim == 0:
    x = arr.item()
    if isinstance(x, float) and not math.isfinite(x):
      return str(x)
    return x
  return _plain(arr.tolist())


def read_jsonl(path: str) -> list[dict]:
  """All records of a JSONL file (empty if the file does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _truncate_file(path: str, step: int) -> None:
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  records = []
  for i, line in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:  # a line cut short by a kill mid-write
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
  records = [r for r in records if r.get("step", 0) <= step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


class MetricWriter:
  """Appends scalars to metrics.jsonl and TensorBoard, and samples to samples.jsonl."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self.samples_path = os.path.join(workdir, SAMPLES_FILE)
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported lazily: optional at analysis time

      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Drops records of steps > step (a resume from the checkpoint at `step`)."""
    for path in (self.metrics_path, self.samples_path):
      if os.path.exists(path):
        _truncate_file(path, step)

  def write_scalars(self, step: int, scalars: Mapping[str, Any], kind: str = "train") -> None:
    record = {"step": int(step), "kind": kind, **_plain(dict(scalars))}
    with open(self.metrics_path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for name, value in record.items():
        if name in ("step", "kind") or not isinstance(value, int | float):
          continue
        self._tb.add_scalar(f"{kind}/{name}", value, global_step=int(step))
      self._tb.flush()

  def write_samples(self, step: int, samples: list[Mapping[str, Any]], kind: str = "train"
                    ) -> None:
    with open(self.samples_path, "a") as f:
      for sample in samples:
        f.write(json.dumps({"step": int(step), "kind": kind, **_plain(dict(sample))}) + "\n")

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
