"""The learning race's readouts, on hand-made evaluation curves, and its workdir handling."""

import importlib.util
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


@pytest.fixture
def race(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))  # learning_race imports its sibling cpu_info
  spec = importlib.util.spec_from_file_location("learning_race", BENCHMARKS / "learning_race.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def curve(*points):
  return [{"train_time_s": minutes * 60, "accuracy": acc} for minutes, acc in points]


def test_reach_is_the_first_crossing_and_hold_the_first_that_stays(race):
  # Crosses 0.75 at 10 minutes, dips at 15, is back from 20 on.
  evals = curve((0, 0.26), (5.1, 0.63), (10.2, 0.76), (15.1, 0.72), (20.1, 0.76), (30.0, 0.77))
  assert race.minutes_to_reach(evals, 0.75) == pytest.approx(10.2)
  assert race.minutes_to_hold(evals, 0.75) == pytest.approx(20.1)
  # Equal to the target counts as reaching it.
  assert race.minutes_to_reach(evals, 0.76) == pytest.approx(10.2)
  assert race.minutes_to_hold(evals, 0.76) == pytest.approx(20.1)


def test_a_curve_that_ends_below_the_target_never_holds_it(race):
  evals = curve((0, 0.26), (5, 0.80), (10, 0.70))
  assert race.minutes_to_reach(evals, 0.75) == pytest.approx(5)
  assert race.minutes_to_hold(evals, 0.75) is None
  assert race.minutes_to_reach(evals, 0.9) is None


def test_a_curve_above_the_target_from_the_start_holds_it_at_zero(race):
  evals = curve((0, 0.8), (5, 0.85))
  assert race.minutes_to_reach(evals, 0.75) == 0
  assert race.minutes_to_hold(evals, 0.75) == 0


def test_the_project_side_starts_over_unless_resumed(race, tmp_path):
  checkpoint = tmp_path / "ours" / "checkpoints" / "30"
  checkpoint.mkdir(parents=True)
  race.start_ours(str(tmp_path), resume=True)
  assert checkpoint.is_dir()  # kept for the trainer to continue from
  race.start_ours(str(tmp_path), resume=False)
  assert not (tmp_path / "ours").exists()
  race.start_ours(str(tmp_path), resume=False)  # nothing there: nothing to do


def test_paired_finals_hand_values_and_scipys_mcnemar(race):
  """Six questions only the project gets right, two only TRL, 70 both, 22 neither."""
  trl = [1] * 70 + [0] * 6 + [1] * 2 + [0] * 22
  ours = [1] * 70 + [1] * 6 + [0] * 2 + [0] * 22
  out = race.paired_finals(trl, ours)
  assert (out["n"], out["ours_only"], out["trl_only"]) == (100, 6, 2)
  assert out["difference"] == pytest.approx(0.04)
  # Differences: six +1, two -1, 92 zeros; sample variance (8 - 100 * 0.04**2) / 99.
  assert out["paired_se"] == pytest.approx(((8 - 0.16) / 99 / 100) ** 0.5, abs=1e-4)
  # Exact McNemar: 2 * P(X <= 2), X ~ Binomial(8, 1/2) = 2 * 37 / 256.
  assert out["mcnemar_p"] == pytest.approx(2 * 37 / 256, abs=1e-4)
  stats = pytest.importorskip("scipy.stats")
  assert out["mcnemar_p"] == pytest.approx(stats.binomtest(2, 8, 0.5).pvalue, abs=1e-4)
  assert out["paired_se"] == pytest.approx(
      stats.sem([o - t for t, o in zip(trl, ours, strict=True)]), abs=1e-4)
  # Symmetric, and no discordant question: no difference, p = 1.
  swapped = race.paired_finals(ours, trl)
  assert swapped["difference"] == pytest.approx(-0.04) and swapped["mcnemar_p"] == out["mcnemar_p"]
  same = race.paired_finals(trl, trl)
  assert same["difference"] == 0 and same["paired_se"] == 0 and same["mcnemar_p"] == 1.0
  with pytest.raises(ValueError, match="same questions"):
    race.paired_finals(trl, ours[:-1])


def test_accuracy_by_group_hand_values(race):
  groups = ["add1", "sub2", "add1", "sub2", "sub2", "mul_table"]
  correct = [1, 0, 1, 1, 0, 0]
  assert race.accuracy_by_group(correct, groups) == {
      "add1": 1.0, "sub2": pytest.approx(1 / 3, abs=1e-4), "mul_table": 0.0}
  assert list(race.accuracy_by_group(correct, groups)) == ["add1", "sub2", "mul_table"]
  with pytest.raises(ValueError, match="5 verdicts for 6 questions"):
    race.accuracy_by_group(correct[:-1], groups)
