"""Run logging: metrics.jsonl, samples.jsonl and TensorBoard event files in the workdir.

metrics.jsonl has one JSON object per line, `{"step": s, "kind": k, ...}` with
kind "train" or "eval"; samples.jsonl has one line per logged completion. On
resume from a checkpoint at step s, lines for steps after s (written after the
checkpoint, and about to be written again) move to a `previous/` folder
(`truncate_after`), so a resumed run's files read as if it never stopped and
nothing written is lost; TensorBoard is told to hide its events after s
(`purge_step`) the same way.
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

# A run whose train records show no learning signal for this many steps in a row is warned
# about in its log (rollout/records.py) and by `analysis.warnings` (and so by the plots command).
NO_SIGNAL_STEPS = 5


def has_no_signal(record: Mapping[str, Any]) -> bool:
  """Whether a train record's update had nothing to learn from: a zero gradient, or every
  group's rewards tied (`zero_variance_groups` 1, so every group-relative advantage is 0)
  in a run without a critic (`value_loss`: a critic's advantages need no variance)."""
  tied = record.get("zero_variance_groups")
  grad_norm = record.get("grad_norm")
  all_tied = tied is not None and float(tied) >= 1.0 and "value_loss" not in record
  return all_tied or (grad_norm is not None and float(grad_norm) == 0.0)


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


def _split_file(path: str, step: int) -> tuple[list[dict], list[str]]:
  """(records of steps <= step, the other lines verbatim) of a JSONL log."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept, dropped = [], []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:  # a line cut short by a kill mid-write
        dropped.append(line)
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
    if record.get("step", 0) <= step:
      kept.append(record)
    else:
      dropped.append(line)
  return kept, dropped


class MetricWriter:
  """Appends scalars to metrics.jsonl and TensorBoard, and samples to samples.jsonl."""

  def __init__(self, workdir: str, tensorboard: bool = True, purge_step: int | None = None):
    """purge_step: TensorBoard hides this log's earlier events from that step on (a resume)."""
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.metrics_path = os.path.join(workdir, METRICS_FILE)
    self.samples_path = os.path.join(workdir, SAMPLES_FILE)
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported lazily: optional at analysis time

      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge_step)

  def truncate_after(self, step: int) -> str | None:
    """Moves records of steps > step (a resume from the checkpoint at `step`) to previous/.

    Returns the folder they went to, or None when there were none.
    """
    from jaxrl_agents.train import workdir as workdir_lib  # the layout of previous/ lives there

    dest = None
    for path in (self.metrics_path, self.samples_path):
      if not os.path.exists(path):
        continue
      kept, dropped = _split_file(path, step)
      if not dropped:
        continue
      dest = dest or workdir_lib.new_previous_dir(self.workdir)
      with open(os.path.join(dest, os.path.basename(path)), "w") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in dropped)
      tmp = path + ".tmp"
      with open(tmp, "w") as f:
        for r in kept:
          f.write(json.dumps(r) + "\n")
      os.replace(tmp, path)
    return dest

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


class SilentWriter:
  """A MetricWriter that writes nothing: every process but the first in a multi-process
  run (`distributed.is_main`) computes the same records and leaves the writing to it."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any], kind: str = "train") -> None:
    del step, scalars, kind

  def write_samples(self, step: int, samples: list[Mapping[str, Any]], kind: str = "train"
                    ) -> None:
    del step, samples, kind

  def close(self) -> None:
    pass
