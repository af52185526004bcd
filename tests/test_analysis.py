"""Run tables, smoothing, run comparison, warning signs and the plots command."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from jaxrl_agents.tools import analysis, plots
from jaxrl_agents.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(workdir, steps=20, length=lambda s: 10.0, entropy=lambda s: 2.0,
               reward=lambda s: s / 20, accuracy=(0.5, 0.6), batch=(2, 4)):
  writer = metrics_lib.MetricWriter(str(workdir), tensorboard=False)
  writer.write_scalars(0, {"accuracy": accuracy[0]}, kind="eval")
  for s in range(1, steps + 1):
    writer.write_scalars(s, {
        "reward_mean": reward(s), "reward/math_strict_mean": reward(s) / 2,
        "reward/short_reply_mean": 0.2, "accuracy": reward(s), "approx_kl": 0.01 * s,
        "entropy": entropy(s), "clip_frac": 0.1, "grad_norm": float("nan") if s == 3 else 1.0,
        "response_length": length(s), "truncated_frac": 0.0, "step_time_s": 2.0,
        "rollout_tokens_per_s": 100.0, "update_tokens_per_s": 50.0, "skipped_updates": 0})
    writer.write_samples(s, [{"prompt": "p", "completion": f"c{s}", "reward": reward(s)}])
  writer.write_scalars(steps, {"accuracy": accuracy[1]}, kind="eval")
  writer.close()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"prompts_per_step": batch[0], "group_size": batch[1]}, f)
  return str(workdir)


def test_load_run_tables(tmp_path):
  run = analysis.load_run(_write_run(tmp_path / "a"))
  assert run.name == "a" and list(run.train.index) == list(range(1, 21))
  assert list(run.eval.index) == [0, 20] and run.eval["accuracy"].tolist() == [0.5, 0.6]
  assert np.isnan(run.train.loc[3, "grad_norm"])  # logged as the string "nan"
  # tokens seen: 10 tokens x (2 prompts x 4 completions) per step, cumulated.
  np.testing.assert_allclose(run.train["tokens"].to_numpy(), 80 * np.arange(1, 21))
  np.testing.assert_allclose(run.train["wall_s"].iloc[-1], 40.0)
  assert len(run.samples) == 20 and run.samples["completion"].iloc[-1] == "c20"


def test_load_run_names_a_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
    analysis.load_run(str(tmp_path))


def test_smooth_is_bias_corrected_ema():
  s = pd.Series([1.0, 3.0, np.nan, 5.0])
  out = analysis.smooth(s, 0.5).to_numpy()
  # avg/norm: 1; (0.5*0.5 + 1.5)/(0.75) = 7/3; unchanged at NaN; (7/8 + 2.5)/(0.875)
  np.testing.assert_allclose(out, [1.0, 7 / 3, 7 / 3, (0.875 + 2.5) / 0.875])
  np.testing.assert_allclose(analysis.smooth(s, 0.0).to_numpy()[[0, 1, 3]], [1, 3, 5])
  with pytest.raises(ValueError, match=r"in \[0, 1\)"):
    analysis.smooth(s, 1.0)


def test_compare_aligns_runs_by_step_and_by_tokens(tmp_path):
  a = _write_run(tmp_path / "a", steps=4, batch=(2, 4))      # 80 tokens per step
  b = _write_run(tmp_path / "b", steps=2, batch=(4, 4))      # 160 tokens per step
  by_step = analysis.compare([a, b], "reward_mean")
  assert list(by_step.columns) == ["a", "b"] and list(by_step.index) == [1, 2, 3, 4]
  assert np.isnan(by_step.loc[3, "b"]) and by_step.loc[2, "b"] == 0.1
  by_tokens = analysis.compare([a, b], "reward_mean", x="tokens")
  assert list(by_tokens.index) == [80, 160, 240, 320]
  assert by_tokens.loc[160, "a"] == 0.1 and by_tokens.loc[160, "b"] == 0.05
  with pytest.raises(KeyError, match="has no train metric 'rewrd'"):
    analysis.compare([a], "rewrd")


def test_warnings_flag_hacking_and_collapse(tmp_path):
  healthy = analysis.load_run(_write_run(tmp_path / "ok", accuracy=(0.3, 0.5)))
  assert analysis.warnings(healthy) == []
  bad = analysis.load_run(_write_run(
      tmp_path / "bad", accuracy=(0.5, 0.3), length=lambda s: 30.0 if s < 10 else 5.0,
      entropy=lambda s: 2.0 if s < 10 else 0.01))
  text = " | ".join(analysis.warnings(bad))
  assert "reward hacking?" in text and "0.500 -> 0.300" in text
  assert "response length collapsed 30.0 -> 5.0" in text
  assert "entropy collapsed" in text


def test_plots_command_overlays_runs(tmp_path):
  a = _write_run(tmp_path / "a")
  b = _write_run(tmp_path / "b", reward=lambda s: 1 - s / 20)
  out = tmp_path / "png"
  proc = subprocess.run([sys.executable, "-m", "jaxrl_agents.tools.plots", a, b, "--out", str(out),
                         "--x", "tokens"], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  written = proc.stdout.split()
  names = {os.path.basename(p) for p in written}
  assert {"reward.png", "accuracy.png", "kl.png", "entropy.png", "length.png",
          "overview.png"} <= names
  assert "value.png" not in names  # no critic metrics in these runs
  for p in written:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 5000


def test_plots_errors_name_the_problem(tmp_path, capsys):
  assert plots.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
  assert "has no metrics.jsonl" in capsys.readouterr().err


def test_per_turn_metrics_become_a_table_and_heatmaps(tmp_path):
  workdir = str(tmp_path / "multi")
  writer = metrics_lib.MetricWriter(workdir, tensorboard=False)
  for s in range(1, 6):
    writer.write_scalars(s, {"reward_mean": 0.1 * s, "turn0/reward_mean": 0.1 * s,
                             "turn2/reward_mean": 0.3 * s, "turn1/reward_mean": 0.2 * s,
                             "turn0/advantage_mean": 0.0, "turn1/advantage_mean": 1.0})
  writer.close()
  run = analysis.load_run(workdir)
  table = analysis.turn_table(run, "reward_mean")
  assert list(table.columns) == [0, 1, 2] and list(table.index) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose(table.loc[5].to_numpy(), [0.5, 1.0, 1.5])
  assert analysis.turn_table(run, "value_mean").empty
  written = plots.plot_runs([workdir], str(tmp_path / "png"))
  assert {"turn_reward.png", "turn_advantage.png"} <= {os.path.basename(p) for p in written}
  # single-turn runs get no heatmaps
  single = plots.plot_runs([_write_run(tmp_path / "single")], str(tmp_path / "png1"))
  assert not any("turn_" in os.path.basename(p) for p in single)


def test_warnings_flag_a_run_without_learning_signal(tmp_path):
  """Every group tied (or a zero gradient) in each of the last NO_SIGNAL_STEPS steps: the run
  learns nothing, which `warnings` says; a critic's run with tied groups is not flagged."""
  n = metrics_lib.NO_SIGNAL_STEPS
  for name, extra, flagged in [
      ("tied", lambda s: {"zero_variance_groups": 1.0 if s > 20 - n else 0.5}, True),
      ("tied_once_less", lambda s: {"zero_variance_groups": 1.0 if s > 21 - n else 0.5}, False),
      ("zero_grad", lambda s: {"grad_norm": 0.0 if s > 20 - n else 1.0}, True),
      ("critic", lambda s: {"zero_variance_groups": 1.0, "value_loss": 0.3}, False)]:
    workdir = _write_run(tmp_path / name)
    writer = metrics_lib.MetricWriter(workdir, tensorboard=False)
    for s in range(21, 41):  # 20 more steps, after the helper's healthy ones
      writer.write_scalars(s, {"reward_mean": 0.5, "grad_norm": 1.0, **extra(s - 20)})
    writer.close()
    text = " | ".join(analysis.warnings(analysis.load_run(workdir)))
    assert ("no learning signal in the last" in text) == flagged, (name, text)


def test_no_signal_watch_warns_once_per_streak(caplog):
  from jaxrl_agents.rollout import records
  watch = records.NoSignalWatch()
  tied = {"zero_variance_groups": 1.0, "grad_norm": 0.0}
  varied = {"zero_variance_groups": 0.25, "grad_norm": 0.7}
  steps = [tied] * (metrics_lib.NO_SIGNAL_STEPS - 1) + [varied] + \
      [tied] * (metrics_lib.NO_SIGNAL_STEPS + 3)
  with caplog.at_level("WARNING", logger="jaxrl_agents.rollout.records"):
    for result in steps:
      assert watch(result) is result
  warned = [r for r in caplog.records if "no learning signal" in r.getMessage()]
  assert len(warned) == 1  # the first streak was one step short; the second warns once
