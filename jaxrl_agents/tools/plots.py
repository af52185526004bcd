r"""PNG plots of one or more training runs, overlaid with a legend.

  python -m jaxrl_agents.tools.plots runs/grpo_a runs/grpo_b --out plots/ [--x tokens] \
      [--smooth 0.6]

Writes one PNG per panel group into --out (reward.png with the total and each
reward component, accuracy.png with training and held-out accuracy, then kl,
entropy, clipping, length, grad_norm, throughput), plus overview.png with the
main panels on one page. Panels a run did not log are left out. Multi-turn
runs (per-turn metrics logged as `turn<k>/reward_mean`, `turn<k>/advantage_mean`)
also get step x turn heatmaps, turn_reward.png and turn_advantage.png. Prints the
written paths, and any warning signs (`analysis.warnings`) on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxrl_agents.tools import analysis

# panel file name -> (title, [(kind, metric), ...]); a "reward/*" metric expands to components.
PANELS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward": ("reward (total and per component)", [("train", "reward_mean"),
                                                    ("train", "reward/*_mean")]),
    "accuracy": ("accuracy (train sampled, eval greedy)", [("train", "accuracy"),
                                                          ("eval", "accuracy")]),
    "kl": ("KL (to the sampling policy; to the reference)", [("train", "approx_kl"),
                                                             ("train", "kl")]),
    "entropy": ("policy entropy (nats/token)", [("train", "entropy")]),
    "clipping": ("clip fractions", [("train", "clip_frac"), ("train", "clip_frac_low"),
                                    ("train", "clip_frac_high"), ("train", "value_clip_frac")]),
    "length": ("response length (tokens) and truncated fraction",
               [("train", "response_length"), ("train", "truncated_frac")]),
    "grad_norm": ("gradient norm (before clipping)", [("train", "grad_norm")]),
    "throughput": ("throughput (tokens/s)", [("train", "rollout_tokens_per_s"),
                                             ("train", "update_tokens_per_s")]),
    "value": ("critic", [("train", "value_loss"), ("train", "value_mean")]),
}
# Per-turn metrics of multi-turn runs, drawn as step x turn heatmaps.
TURN_HEATMAPS = {"turn_reward": "reward_mean", "turn_advantage": "advantage_mean"}
OVERVIEW = ("reward", "accuracy", "kl", "entropy", "length", "grad_norm")
X_LABELS = {"step": "step", "tokens": "generated tokens", "wall_s": "wall-clock seconds"}


def _expand(run: analysis.Run, kind: str, metric: str) -> list[str]:
  frame = run.train if kind == "train" else run.eval
  if metric.endswith("*_mean"):
    prefix = metric[: -len("*_mean")]
    return sorted(c for c in frame.columns if c.startswith(prefix) and c.endswith("_mean"))
  return [metric] if metric in frame and frame[metric].notna().any() else []


def draw_panel(ax, runs: Sequence[analysis.Run], name: str, x: str = "step",
               smoothing: float = 0.6) -> bool:
  """Draws panel `name` (a PANELS key) for `runs` on a matplotlib axis.

  One colour per run, one line style per metric; held-out evaluations are
  drawn with markers. Returns False (and draws nothing) when no run logged
  any of the panel's metrics.
  """
  if name not in PANELS:
    raise ValueError(f"unknown panel {name!r}; panels are {sorted(PANELS)}")
  if x not in X_LABELS:
    raise ValueError(f"x must be one of {sorted(X_LABELS)}, got {x!r}")
  title, entries = PANELS[name]
  drawn = False
  for i, run in enumerate(runs):
    color = f"C{i % 10}"
    styles = iter(["-", "--", ":", "-."] * 4)
    for kind, pattern in entries:
      for metric in _expand(run, kind, pattern):
        frame = run.train if kind == "train" else run.eval
        y = frame[metric]
        if kind == "train" and smoothing:
          y = analysis.smooth(y, smoothing)
        xs = y.index if x == "step" else run.train[x].reindex(y.index, method="ffill").fillna(0)
        label = f"{run.name}: {kind} {metric}" if len(runs) > 1 else f"{kind} {metric}"
        marker = "o" if kind == "eval" else None
        ax.plot(xs, y.to_numpy(), linestyle=next(styles), marker=marker, color=color,
                label=label, linewidth=1.4)
        drawn = True
  if drawn:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(X_LABELS[x], fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return drawn


def draw_turn_heatmap(ax, run: analysis.Run, name: str) -> bool:
  """Heatmap of per-turn metric `name` (turn on y, step on x); False if not logged."""
  table = analysis.turn_table(run, name)
  if table.empty or table.shape[1] == 0:
    return False
  image = ax.imshow(table.to_numpy(dtype=float).T, aspect="auto", origin="lower",
                    cmap="viridis", interpolation="nearest",
                    extent=(table.index.min() - 0.5, table.index.max() + 0.5,
                            -0.5, table.shape[1] - 0.5))
  ax.figure.colorbar(image, ax=ax)
  ax.set_yticks(range(table.shape[1]), [str(t) for t in table.columns])
  ax.set_xlabel("step", fontsize=8)
  ax.set_ylabel("turn", fontsize=8)
  ax.set_title(f"{run.name}: per-turn {name}", fontsize=9)
  return True


def plot_runs(workdirs: Sequence[str], out: str, x: str = "step", smoothing: float = 0.6,
              names: Sequence[str] | None = None) -> list[str]:
  """Writes the PNG panels for `workdirs` into `out`; returns the written paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if x not in X_LABELS:
    raise ValueError(f"x must be one of {sorted(X_LABELS)}, got {x!r}")
  names = list(names) if names else [None] * len(workdirs)
  if len(names) != len(workdirs):
    raise ValueError(f"{len(names)} names for {len(workdirs)} workdirs")
  runs = [analysis.load_run(w, n) for w, n in zip(workdirs, names, strict=True)]
  os.makedirs(out, exist_ok=True)
  written = []
  for name in PANELS:
    fig, ax = plt.subplots(figsize=(7, 4))
    if draw_panel(ax, runs, name, x, smoothing):
      fig.tight_layout()
      path = os.path.join(out, f"{name}.png")
      fig.savefig(path, dpi=110)
      written.append(path)
    plt.close(fig)
  for run in runs:
    for file_name, metric in TURN_HEATMAPS.items():
      fig, ax = plt.subplots(figsize=(7, 4))
      if draw_turn_heatmap(ax, run, metric):
        fig.tight_layout()
        suffix = f"_{run.name}" if len(runs) > 1 else ""
        path = os.path.join(out, f"{file_name}{suffix}.png")
        fig.savefig(path, dpi=110)
        written.append(path)
      plt.close(fig)
  fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
  for ax, name in zip(axes.flat, OVERVIEW, strict=True):
    if not draw_panel(ax, runs, name, x, smoothing):
      ax.set_title(f"{PANELS[name][0]} (not logged)", fontsize=9)
  fig.suptitle(", ".join(r.name for r in runs))
  fig.tight_layout()
  path = os.path.join(out, "overview.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  written.append(path)
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxrl_agents.tools.plots",
      description="PNG plots of training runs (metrics.jsonl in each workdir), overlaid.")
  parser.add_argument("workdirs", nargs="+", help="run directories")
  parser.add_argument("--out", required=True, help="directory for the PNG files")
  parser.add_argument("--x", default="step", choices=sorted(X_LABELS),
                      help="x axis: step, generated tokens or wall-clock seconds")
  parser.add_argument("--smooth", type=float, default=0.6,
                      help="EMA weight for training curves, 0 = raw (default 0.6)")
  parser.add_argument("--names", nargs="*", help="legend labels, one per workdir")
  args = parser.parse_args(argv)
  try:
    paths = plot_runs(args.workdirs, args.out, x=args.x, smoothing=args.smooth,
                      names=args.names)
  except (FileNotFoundError, ValueError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for workdir in args.workdirs:
    for warning in analysis.warnings(analysis.load_run(workdir)):
      print(f"{workdir}: {warning}", file=sys.stderr)
  print("\n".join(paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
