"""Training runs as tidy tables: load workdirs, smooth, align runs, flag suspicious dynamics.

```
from jaxrl_agents.tools import analysis

run = analysis.load_run("runs/grpo_arithmetic")
run.train          # one row per step: reward, accuracy, KL, entropy, clip fractions, ...
run.eval           # one row per held-out evaluation
run.samples        # one row per logged completion
table = analysis.compare(["runs/a", "runs/b"], "reward_mean", x="tokens")
analysis.warnings(run)   # reward hacking / collapse signs, in words
```
Only the workdir's files are read (metrics.jsonl, samples.jsonl, config.json),
so this works on a laptop with a run copied from a TPU VM, without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from jaxrl_agents.train import metrics as metrics_lib


@dataclasses.dataclass
class Run:
  """One workdir's records.

  Attributes:
    name: a label for legends (the workdir's base name unless given).
    workdir: the directory.
    config: the resolved config (config.json), {} if absent.
    train: one row per training step, indexed by step, with a cumulative
      `tokens` column (generated tokens seen so far).
    eval: one row per held-out evaluation, indexed by step.
    samples: one row per logged completion (columns step, kind, prompt, completion, ...).
  """

  name: str
  workdir: str
  config: dict
  train: pd.DataFrame
  eval: pd.DataFrame
  samples: pd.DataFrame


def _numeric(frame: pd.DataFrame) -> pd.DataFrame:
  """Columns stored as strings ("nan", "inf") back to floats."""
  for col in frame.columns:
    if frame[col].dtype == object and col not in ("kind", "prompt", "completion", "answer"):
      converted = pd.to_numeric(frame[col], errors="coerce")
      if converted.notna().any() or frame[col].isin(["nan", "inf", "-inf"]).any():
        frame[col] = converted
  return frame


def load_run(workdir: str, name: str | None = None) -> Run:
  """Reads a workdir written by `harness.run` (any trainer)."""
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} has no {metrics_lib.METRICS_FILE}: not a training run "
                            "directory (or the run has not logged a step yet)")
  records = pd.DataFrame(metrics_lib.read_jsonl(path))
  if records.empty:
    records = pd.DataFrame(columns=["step", "kind"])

  def table(kind):
    rows = _numeric(records[records["kind"] == kind].drop(columns="kind").copy())
    rows = rows.dropna(axis=1, how="all")
    if "step" not in rows:  # no record of this kind (e.g. no evaluation yet)
      return pd.DataFrame(index=pd.Index([], name="step", dtype=int))
    return rows.set_index("step").sort_index()

  train, evals = table("train"), table("eval")
  samples = pd.DataFrame(metrics_lib.read_jsonl(os.path.join(workdir, metrics_lib.SAMPLES_FILE)))
  config = {}
  if os.path.exists(os.path.join(workdir, "config.json")):
    with open(os.path.join(workdir, "config.json")) as f:
      config = json.load(f)
  # Generated tokens per step = mean completion length x sampled rows (prompts x group).
  batch = (config.get("prompts_per_step", 1) * config.get("oversample", 1)
           * config.get("group_size", 1))
  if "response_length" in train:
    train["tokens"] = (train["response_length"] * batch).cumsum()
  if "step_time_s" in train:
    train["wall_s"] = train["step_time_s"].cumsum()
  return Run(name=name or os.path.basename(os.path.normpath(workdir)), workdir=workdir,
             config=config, train=train, eval=evals, samples=samples)


def smooth(series: pd.Series, weight: float = 0.6) -> pd.Series:
  """TensorBoard-style exponential moving average with bias correction (weight in [0, 1))."""
  if not 0 <= weight < 1:
    raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
  values = series.to_numpy(dtype=float)
  out = np.empty_like(values)
  avg, norm = 0.0, 0.0
  for i, v in enumerate(values):
    if np.isfinite(v):
      avg = weight * avg + (1 - weight) * v
      norm = weight * norm + (1 - weight)
    out[i] = avg / norm if norm else np.nan
  return pd.Series(out, index=series.index, name=series.name)


X_AXES = ("step", "tokens", "wall_s")

# Multi-turn runs log per-turn scalars as "turn<k>/<name>" (k = 0, 1, ...), for
# example turn0/reward_mean, turn1/advantage_mean.
_TURN_PREFIX = "turn"


def turn_table(run: Run, name: str) -> pd.DataFrame:
  """Per-turn metric `name` as a table: one row per step, one column per turn (0, 1, ...).

  Empty when the run logged no per-turn values of `name` (single-turn runs).
  """
  columns = {}
  for col in run.train.columns:
    head, _, tail = col.partition("/")
    if tail == name and head.startswith(_TURN_PREFIX) and head[len(_TURN_PREFIX):].isdigit():
      columns[int(head[len(_TURN_PREFIX):])] = run.train[col]
  if not columns:
    return pd.DataFrame(index=run.train.index)
  table = pd.DataFrame(columns).sort_index(axis=1)
  table.columns.name = "turn"
  return table


def compare(runs: Sequence[Run | str], metric: str, x: str = "step", kind: str = "train"
            ) -> pd.DataFrame:
  """One column per run of `metric`, indexed by `x` (step, tokens seen or wall seconds).

  Runs are aligned on the union of their x values (NaN where a run has no
  record), so runs of different lengths or batch sizes sit on one axis.
  """
  if x not in X_AXES:
    raise ValueError(f"x must be one of {X_AXES}, got {x!r}")
  columns = {}
  for run in runs:
    run = load_run(run) if isinstance(run, str) else run
    frame = run.train if kind == "train" else run.eval
    if metric not in frame:
      raise KeyError(f"run {run.name!r} has no {kind} metric {metric!r}; it has "
                     f"{sorted(frame.columns)}")
    if x == "step":
      series = frame[metric]
    else:
      if x not in run.train:
        raise KeyError(f"run {run.name!r} cannot be aligned by {x!r}")
      axis = run.train[x].reindex(frame.index, method="ffill").fillna(0.0)
      series = pd.Series(frame[metric].to_numpy(), index=axis.to_numpy())
    name = run.name
    while name in columns:
      name += "'"
    columns[name] = series
  table = pd.concat(columns, axis=1).sort_index()
  table.index.name = x
  return table


def warnings(run: Run, window: int = 5) -> list[str]:
  """Signs of reward hacking or collapse, as sentences (empty when nothing stands out).

  Checks: no learning signal (`metrics.has_no_signal`) in each of the last
  `metrics.NO_SIGNAL_STEPS` steps; training reward rising while held-out accuracy falls;
  response length collapsing (< 1/3 of its start) or exploding (> 3x); entropy collapsing
  below 5% of its start; most completions hitting the token budget; skipped
  (non-finite) updates.
  """
  out = []
  t = run.train
  if len(t) >= metrics_lib.NO_SIGNAL_STEPS:
    recent = t.iloc[-metrics_lib.NO_SIGNAL_STEPS:]
    if all(metrics_lib.has_no_signal(row.dropna().to_dict()) for _, row in recent.iterrows()):
      out.append(f"no learning signal in the last {metrics_lib.NO_SIGNAL_STEPS} steps (every "
                 "group's rewards tied, or a zero gradient): the reward never varies within a "
                 "group, so nothing is learned; check the reward, the grader and the task")
  if len(t) < 2 * window:
    return out

  def start_end(col):
    return float(t[col].iloc[:window].mean()), float(t[col].iloc[-window:].mean())

  if "reward_mean" in t and len(run.eval) >= 2 and "accuracy" in run.eval:
    r0, r1 = start_end("reward_mean")
    a0, a1 = float(run.eval["accuracy"].iloc[0]), float(run.eval["accuracy"].iloc[-1])
    if r1 > r0 and a1 < a0:
      out.append(f"reward hacking? training reward rose {r0:.3f} -> {r1:.3f} while held-out "
                 f"accuracy fell {a0:.3f} -> {a1:.3f}")
  if "response_length" in t:
    l0, l1 = start_end("response_length")
    if l0 > 0 and l1 < l0 / 3:
      out.append(f"response length collapsed {l0:.1f} -> {l1:.1f} tokens")
    elif l0 > 0 and l1 > 3 * l0:
      out.append(f"response length exploded {l0:.1f} -> {l1:.1f} tokens")
  if "entropy" in t:
    e0, e1 = start_end("entropy")
    if e0 > 0 and e1 < 0.05 * e0:
      out.append(f"entropy collapsed {e0:.3f} -> {e1:.3f} nats/token: exploration has stopped")
  if "truncated_frac" in t:
    _, tr = start_end("truncated_frac")
    if tr > 0.5:
      out.append(f"{tr:.0%} of recent completions hit the token budget (max_new_tokens)")
  if "skipped_updates" in t and t["skipped_updates"].iloc[-1] > 0:
    out.append(f"{int(t['skipped_updates'].iloc[-1])} updates were skipped as non-finite")
  return out
