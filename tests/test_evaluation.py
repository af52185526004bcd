"""The evaluation harness: its estimators against brute force and hand-computed values, its
report against the replies' own verdicts, and the command end to end on the tiny model."""

import itertools
import json
import math
import os

import numpy as np
import pytest

from jaxrl_agents.evaluation import estimators, harness


@pytest.mark.parametrize("n, c, k", [(6, 0, 1), (6, 2, 3), (6, 5, 2), (8, 1, 8), (10, 3, 4),
                                     (5, 5, 5), (20, 7, 1)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_reply(n, c, k):
  replies = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(replies, k))
  brute = sum(any(s) for s in subsets) / len(subsets)
  assert estimators.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
  assert estimators.pass_at_k(n, c, k) == pytest.approx(
      1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_1_is_the_share_correct_and_bad_counts_are_refused():
  assert estimators.pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
  for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
    with pytest.raises(ValueError):
      estimators.pass_at_k(n, c, k)


def test_majority_verdict_votes_over_answers_not_replies():
  # "7" twice (wrong), "8" once (right), one reply without an answer
  assert estimators.majority_verdict(["7", None, "8", "7"], [0, 0, 1, 0]) == 0.0
  assert estimators.majority_verdict(["8", None, None, "7"], [1, 0, 0, 0]) == 1.0  # tie: first
  assert estimators.majority_verdict([None, None], [0, 0]) == 0.0
  with pytest.raises(ValueError):
    estimators.majority_verdict(["1"], [1, 0])


def test_bootstrap_interval_matches_the_normal_one_on_many_examples():
  rng = np.random.default_rng(0)
  values = (rng.random(2000) < 0.3).astype(float)
  low, high = estimators.bootstrap_interval(values)
  se = estimators.standard_error(values)
  assert se == pytest.approx(np.sqrt(0.3 * 0.7 / 2000), rel=0.05)
  assert low == pytest.approx(values.mean() - 1.96 * se, abs=0.004)
  assert high == pytest.approx(values.mean() + 1.96 * se, abs=0.004)


def test_the_report_is_computed_from_the_replies_verdicts(monkeypatch):
  """Replies given by hand (no model): greedy, pass@1, pass@k, maj@k, mean@k per grader and
  per group, each equal to the value computed by hand."""
  examples = [{"question": "q0", "answer": "7", "group": "a"},
              {"question": "q1", "answer": "3", "group": "b"}]
  greedy = ["Answer: 7", "the result is 3"]  # strict reads 7 / nothing; lenient 7 / 3
  sampled = ["Answer: 7", "Answer: 8", "Answer: 8", "7",      # example 0: 2 of 4 right
             "Answer: 1", "Answer: 2", "3 maybe", "x"]         # example 1: 0 strict, 1 lenient

  def fake_decode(params, model, exs, fmt, sampling, group, rng, batch_size, bar, label):
    return greedy if group == 1 else sampled

  monkeypatch.setattr(harness, "_decode", fake_decode)

  class Tok:
    pad_token_id = 0
  monkeypatch.setattr(harness.tokenizer_lib, "stop_token_ids", lambda tok: (1,))
  model = type("M", (), {"tokenizer": Tok()})()
  fmt = harness.TaskFormat("{question}", ("math_strict", "math_lenient"))
  result, samples = harness.evaluate(None, model, examples, fmt,
                                     harness.EvalSettings(k=4, temperature=1.0),
                                     progress=False)
  strict, lenient = result["graders"]["math_strict"], result["graders"]["math_lenient"]
  assert strict["greedy"]["mean"] == 0.5 and lenient["greedy"]["mean"] == 1.0
  assert strict["pass@1"]["mean"] == pytest.approx((2 / 4 + 0) / 2)
  assert strict["pass@k"]["mean"] == pytest.approx((1.0 + 0.0) / 2)
  # strict votes: example 0 reads 7, 8, 8, 7 -> tie, 7 first -> right; example 1: 1, 2,
  # None, None -> 1 -> wrong
  assert strict["maj@k"]["mean"] == pytest.approx(0.5)
  # lenient, example 1 reads 1, 2, 3, None: a tie, 1 first -> wrong
  assert lenient["maj@k"]["mean"] == pytest.approx(0.5)
  assert lenient["pass@k"]["mean"] == pytest.approx(1.0)
  assert strict["groups"] == {"a": {"greedy": 1.0, "pass@1": 0.5, "pass@k": 1.0, "mean@k": 0.5,
                                    "maj@k": 1.0},
                              "b": {"greedy": 0.0, "pass@1": 0.0, "pass@k": 0.0, "mean@k": 0.0,
                                    "maj@k": 0.0}}
  assert samples[1]["sample_verdicts"]["math_lenient"] == [0.0, 0.0, 1.0, 0.0]
  assert "| math_strict | 0.500 +- 0.500 |" in harness.table(result)


def test_settings_and_formats_name_their_problems():
  with pytest.raises(ValueError, match="temperature"):
    harness.EvalSettings(k=4, temperature=0.0).check()
  with pytest.raises(ValueError, match="nothing to evaluate"):
    harness.EvalSettings(greedy=False, k=0).check()
  with pytest.raises(KeyError, match="no prompt format"):
    harness.format_for("mystery")
  assert harness.format_for("reasoning_gym/gcd").graders[0] == "reasoning_gym_solved"


def test_the_command_evaluates_the_tiny_model_and_writes_its_report(tmp_path, capsys):
  pytest.importorskip("reasoning_gym")
  from jaxrl_agents.tools import evaluate
  out = str(tmp_path / "report.json")
  assert evaluate.main(["--task", "reasoning_gym/gcd,lcm", "--model", "tiny", "--size", "3",
                        "--task-option", "test_size=3", "--k", "2", "--temperature", "1.0",
                        "--max-new-tokens", "4", "--batch-size", "2", "--out", out]) == 0
  printed = capsys.readouterr().out
  assert "| reasoning_gym_solved |" in printed and "pass@2" in printed
  result = json.load(open(out))
  assert result["num_examples"] == 3 and result["settings"]["k"] == 2
  records = [json.loads(line) for line in open(os.path.splitext(out)[0] + ".samples.jsonl")]
  assert len(records) == 3 and all(len(r["samples"]) == 2 for r in records)
  # the report's figures are the records' verdicts averaged
  greedy = np.mean([r["greedy_verdicts"]["reasoning_gym_solved"] for r in records])
  assert result["graders"]["reasoning_gym_solved"]["greedy"]["mean"] == pytest.approx(greedy)
  with pytest.raises(SystemExit, match="holds no checkpoints"):
    evaluate.main(["--task", "gsm8k", "--workdir", str(tmp_path)])
