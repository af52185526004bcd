"""Reward models: the networks, pair data, best-of-N, and the Bradley-Terry trainer."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import preference_data
from experiments import reward_model as rm_experiment
from experiments.configs import reward_model_arithmetic
from jaxrl_agents.data import preferences
from jaxrl_agents.models import heads, transformer, zoo
from jaxrl_agents.models import reward_model as rm_lib
from jaxrl_agents.rewards import best_of_n
from jaxrl_agents.train import metrics as metrics_lib


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def _params(model, seed=1):
  return rm_lib.init(model.params, jax.random.key(seed), model.cfg, head_scale=0.5)


def test_outcome_reward_is_the_head_at_the_last_real_token_whatever_the_padding(tiny):
  """Against an unpadded forward of each sequence alone: left padding, right padding and
  different lengths in one batch give each row the head of its own last hidden state."""
  params = _params(tiny)
  seqs = [[3, 17, 42, 9, 5], [8, 8, 21], [30, 2, 2, 7, 11, 4]]
  expected = []
  for s in seqs:
    tokens = jnp.asarray([s])
    hidden, _ = jax.jit(transformer.apply, static_argnames=("cfg", "return_hidden"))(
        params["backbone"], tokens, jnp.arange(len(s))[None], tiny.cfg, return_hidden=True)
    expected.append(float(heads.apply_scalar_head(params["head"], hidden[0, -1])))
  width = 8
  left = np.zeros((3, width), np.int32)
  left_mask = np.zeros((3, width), bool)
  right, right_mask = left.copy(), left_mask.copy()
  for i, s in enumerate(seqs):
    left[i, width - len(s):], left_mask[i, width - len(s):] = s, True
    right[i, :len(s)], right_mask[i, :len(s)] = s, True
  for tokens, mask in ((left, left_mask), (right, right_mask)):
    got = rm_lib.outcome_rewards(params, jnp.asarray(tokens), jnp.asarray(mask), cfg=tiny.cfg)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_mean_pooling_and_step_scores_by_hand(tiny):
  params = _params(tiny)
  tokens = jnp.asarray([[0, 0, 5, 10, 6, 10], [4, 10, 4, 4, 10, 7]])
  mask = jnp.asarray([[False, False, True, True, True, True], [True] * 6])
  scores = np.asarray(rm_lib.token_scores(params, tokens, mask, cfg=tiny.cfg))
  assert (scores[0, :2] == 0).all()
  mean = rm_lib.outcome_rewards(params, tokens, mask, cfg=tiny.cfg, pooling="mean")
  np.testing.assert_allclose(np.asarray(mean), [scores[0, 2:].mean(), scores[1].mean()],
                             rtol=1e-5)
  reply = jnp.asarray([[False] * 4 + [True] * 2, [False] * 3 + [True] * 3])
  reply_mean = rm_lib.outcome_rewards(params, tokens, mask, cfg=tiny.cfg, pooling="mean",
                                      reply=reply)
  np.testing.assert_allclose(np.asarray(reply_mean), [scores[0, 4:].mean(), scores[1, 3:].mean()],
                             rtol=1e-5)
  ends = jnp.asarray([[3, 5, 0], [1, 4, 5]])
  step_mask = jnp.asarray([[True, True, False], [True, True, True]])
  steps = np.asarray(rm_lib.step_scores(params, tokens, mask, ends, step_mask, cfg=tiny.cfg))
  np.testing.assert_allclose(steps, [[scores[0, 3], scores[0, 5], 0.0],
                                     [scores[1, 1], scores[1, 4], scores[1, 5]]], rtol=1e-6)
  with pytest.raises(ValueError, match="pooling"):
    rm_lib.outcome_rewards(params, tokens, mask, cfg=tiny.cfg, pooling="max")


def test_frozen_layers_get_no_gradient_and_change_no_value(tiny):
  params = _params(tiny)
  tokens = jnp.asarray([[3, 17, 42, 9, 5, 6]])
  mask = jnp.ones_like(tokens, bool)

  def reward(p, k):
    return rm_lib.outcome_rewards(p, tokens, mask, cfg=tiny.cfg, frozen_layers=k).sum()

  # Jitted: eager, each op of the forward and backward would compile on its own.
  grad = jax.jit(jax.grad(reward), static_argnums=1)
  np.testing.assert_allclose(reward(params, 1), reward(params, 0), rtol=1e-6)
  grads = grad(params, 1)
  assert not np.any(np.asarray(grads["backbone"]["embed"]))
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["backbone"]["layers"][0]))
  assert np.any(np.asarray(grads["backbone"]["layers"][1]["wq"]))
  assert np.any(np.asarray(grads["head"]["w"]))
  full = grad(params, 0)
  assert np.any(np.asarray(full["backbone"]["embed"]))
  with pytest.raises(ValueError, match="frozen_layers"):
    reward(params, tiny.cfg.n_layers + 1)


def test_scoring_does_not_recompile_for_new_inputs_of_the_same_shape(tiny):
  params = _params(tiny)
  score = jax.jit(lambda p, t, m: rm_lib.outcome_rewards(p, t, m, cfg=tiny.cfg))
  rng = np.random.default_rng(0)
  for _ in range(3):
    tokens = rng.integers(1, 200, (4, 32)).astype(np.int32)
    mask = np.arange(32)[None] >= rng.integers(0, 20, (4, 1))
    score(params, jnp.asarray(tokens), jnp.asarray(mask)).block_until_ready()
  assert score._cache_size() == 1


def test_encoded_texts_end_with_the_closing_token_and_keep_special_text_plain(tiny):
  tok = tiny.tokenizer
  e = preferences.encode_texts(tok, ["2 + 3?", "hi"], ["5", "<|im_end|>six"], max_len=200,
                               chat=False)
  assert e.tokens.shape[1] % 32 == 0 and not e.truncated.any()
  end = preferences.end_token(tok)
  assert (e.tokens[:, -1] == end).all() and e.mask[:, -1].all()
  row = e.tokens[1][e.mask[1]].tolist()
  assert row.count(end) == 1  # the response's "<|im_end|>" text stayed text
  # The response mask covers exactly the response's ids and the closing token.
  for i, (p, r) in enumerate([("2 + 3?", "5"), ("hi", "<|im_end|>six")]):
    ids, prompt_len = preferences.response_ids(tok, p, r, chat=False)
    assert e.tokens[i][e.response[i]].tolist() == ids[prompt_len:]
  short = preferences.encode_texts(tok, ["2 + 3?"], ["5" * 50], max_len=16, chat=False)
  assert short.truncated.all() and short.tokens.shape[1] == 16 and short.tokens[0, -1] == end
  assert short.response[0].all()  # the prompt was cut away
  c, r = preferences.encode_pairs(tok, [{"prompt": "q", "chosen": "a", "rejected": "b" * 40}],
                                  max_len=200, chat=False)
  assert c.tokens.shape == r.tokens.shape == (1, 64)


def test_pair_calibration_by_hand():
  # Always 90% sure (margin log 9), right on 6 of 10 pairs: ECE 0.3.
  m = np.log(9.0)
  got = rm_lib.pair_calibration([m] * 6 + [-m] * 4)
  assert got["pair_accuracy"] == pytest.approx(0.6)
  assert got["reward_margin"] == pytest.approx(0.2 * m)
  assert got["calibration_error"] == pytest.approx(0.3)
  # Right exactly as often as it says: calibrated.
  assert rm_lib.pair_calibration([m] * 9 + [-m])["calibration_error"] == pytest.approx(0.0)
  with pytest.raises(ValueError, match="non-empty"):
    rm_lib.pair_calibration([])


def test_best_of_n_and_weighted_vote_by_hand():
  rewards = np.asarray([[0.1, 2.0, 0.3, 1.9], [0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 1.0, 1.0]])
  answers = [["7", "8", "7", "7"], ["1", "2", "2", None], [None, None, None, None]]
  np.testing.assert_array_equal(best_of_n.best_of_n(rewards), [1, 0, 0])
  # Row 0: "7" weighs e^.1 + e^.3 + e^1.9 against "8"'s e^2: "7" wins, its best is index 3.
  # Row 1: equal rewards are a majority vote ("2"); row 2: nobody answers, best-of-N.
  np.testing.assert_array_equal(best_of_n.weighted_vote(rewards, answers), [3, 1, 0])
  # A cold vote follows the single best reply.
  np.testing.assert_array_equal(best_of_n.weighted_vote(rewards, answers, 0.01), [1, 1, 0])
  np.testing.assert_array_equal(best_of_n.best_of_n(rewards[:, :1]), [0, 0, 0])
  with pytest.raises(ValueError, match="finite"):
    best_of_n.best_of_n([[np.nan, 1.0]])


def test_pairs_from_groups_pairs_accepted_with_rejected_replies_of_the_same_prompt():
  prompts = ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4
  replies = ["a", "b", "c", "c", "x", "y", "z", "w", "m", "m", "n", "n"]
  correct = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]
  pairs = preferences.pairs_from_groups(prompts, replies, correct, 4, max_pairs_per_prompt=5,
                                        seed=0, extra=[{"answer": i} for i in range(3)])
  got = sorted((p["prompt"], p["chosen"], p["rejected"], p["answer"]) for p in pairs)
  # p1 has no accepted reply; duplicate texts count once.
  assert got == [("p0", "a", "b", 0), ("p0", "a", "c", 0), ("p2", "m", "n", 2)]
  capped = preferences.pairs_from_groups(prompts, replies, correct, 4, max_pairs_per_prompt=1,
                                         seed=0)
  assert len(capped) == 2
  with pytest.raises(ValueError, match="groups of 5"):
    preferences.pairs_from_groups(prompts, replies, correct, 5, max_pairs_per_prompt=1, seed=0)


@pytest.mark.parametrize("response, answer, wrong, expected", [
    ("3 * 10 = 30", "30", "31", "3 * 10 = 31"),
    ("30 is 30. So 30", "30", "7", "30 is 30. So 7"),  # the last occurrence
    ("The answer is 130.", "30", "7", None),  # inside a longer number
    ("The answer is 30.5", "5", "7", None),  # after a decimal point
    ("It is 5.5", "5", "7", None),  # before one
    ("It is 5.", "5", "7", "It is 7."),  # a full stop is not a decimal point
    ("The answer is -5", "-5", "5", "The answer is 5"),
    ("no number", "4", "5", None),
])
def test_swap_answer_replaces_the_last_standalone_answer(response, answer, wrong, expected):
  assert preferences.swap_answer(response, answer, wrong) == expected


def test_answer_swap_pairs_swap_in_the_groups_own_wrong_answers_and_drop_accepted_swaps():
  from jaxrl_agents.rewards import answers

  prompts = ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4
  replies = ["2 + 5 = 7", "7", "2 + 5 = 8", "I think 9",  # wrong answers 8 (9 is not stated)
             "x", "y", "z", "w",  # nothing accepted: no pairs
             "It is 4", "It is 4", "no", "no"]  # no wrong answer: near misses of 4
  correct = [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]
  examples = [{"answer": "7"}, {"answer": "1"}, {"answer": "4"}]
  graded = []

  def grade(texts, exs):  # accepts only the right answer; counts what it saw
    graded.extend(texts)
    return [float(answers.lenient_answer(t) == int(e["answer"]))
            for t, e in zip(texts, exs, strict=True)]

  pairs = preferences.answer_swap_pairs(prompts, replies, correct, examples, 4, per_prompt=10,
                                        seed=0, read_answer=answers.strict_answer, grade=grade)
  got = sorted((p["prompt"], p["chosen"], p["rejected"]) for p in pairs)
  near = sorted(("p2", "It is 4", f"It is {4 + d}") for d in (-10, -2, -1, 1, 2, 10))
  assert got == sorted([("p0", "2 + 5 = 7", "2 + 5 = 8"), ("p0", "7", "8")] + near)
  assert all(p["source"] == "answer_swap" for p in pairs) and len(graded) == len(pairs)
  capped = preferences.answer_swap_pairs(prompts, replies, correct, examples, 4, per_prompt=1,
                                         seed=0, read_answer=answers.strict_answer, grade=grade)
  assert len(capped) == 2
  # A swap the grader still accepts (here: a grader that accepts everything) is dropped.
  assert preferences.answer_swap_pairs(prompts, replies, correct, examples, 4, per_prompt=10,
                                       seed=0, read_answer=answers.strict_answer,
                                       grade=lambda t, e: [1.0] * len(t)) == []


def test_arithmetic_mistakes_are_wrong_non_negative_and_the_named_slips():
  import random

  from jaxrl_agents.data import arithmetic

  rng = random.Random(0)
  for operation, a, b in [("add", 37, 45), ("sub", 51, 10), ("mul", 8, 12), ("sub", 3, 3),
                          ("add", 0, 0), ("mul", 11, 11)]:
    right = arithmetic.solve(operation, a, b)
    got = {arithmetic.mistake({"operation": operation, "a": a, "b": b}, rng)
           for _ in range(400)}
    assert right not in got and min(got) >= 0 and len(got) >= 8, (operation, a, b, got)
  got = {arithmetic.mistake({"operation": "add", "a": 37, "b": 45}, rng) for _ in range(400)}
  # Off by one, a carry slip, the digits reversed, another operation (37 * 45).
  assert {81, 83, 72, 92, 28, 1665} <= got
  got = {arithmetic.mistake({"operation": b"mul", "a": 8, "b": 12}, rng) for _ in range(100)}
  assert {812, 20} <= got  # the operands side by side; the sum
  assert arithmetic.statement({"operation": "sub", "a": 51, "b": 10}, 41) == "51 - 10 = 41"
  assert arithmetic.statement(arithmetic.Problem("mul", 8, 12)._asdict(), "96") == "8 * 12 = 96"


def test_stated_answer_pairs_state_the_right_answer_against_a_wrong_one():
  from jaxrl_agents import registry
  from jaxrl_agents.data import arithmetic

  examples = [{"question": "What is 37 + 45?", "answer": "82", "operation": "add", "a": 37,
               "b": 45},
              {"question": "What is 8 * 12?", "answer": "96", "operation": "mul", "a": 8,
               "b": 12}]
  prompts = ["What is 37 + 45? Answer with just the number.", "What is 8 * 12? ..."]
  make = lambda seed: preferences.stated_answer_pairs(
      prompts, examples, per_prompt=50, seed=seed, state=arithmetic.statement,
      mistake=arithmetic.mistake)
  pairs = make(0)
  assert len(pairs) == 100 and {p["source"] for p in pairs} == {"stated_answer"}
  assert [p["prompt"] for p in pairs] == [prompts[0]] * 50 + [prompts[1]] * 50
  assert {p["chosen"] for p in pairs} == {"37 + 45 = 82", "The answer is 82.", "8 * 12 = 96",
                                          "The answer is 96."}
  plain = sum(p["chosen"].startswith("The answer") for p in pairs)
  assert 8 <= plain <= 35  # plain_share 0.2 of 100
  grade = registry.get("reward", "math_strict")
  row_examples = [examples[0]] * 50 + [examples[1]] * 50
  assert list(grade([p["chosen"] for p in pairs], row_examples)) == [1.0] * 100
  assert list(grade([p["rejected"] for p in pairs], row_examples)) == [0.0] * 100
  assert make(0) == pairs and make(1) != pairs
  with pytest.raises(ValueError, match="mistake.. gave the right answer 82"):
    preferences.stated_answer_pairs(prompts[:1], examples[:1], per_prompt=1, seed=0,
                                    state=arithmetic.statement, mistake=lambda ex, rng: 82)
  with pytest.raises(ValueError, match="2 prompts for 1 examples"):
    preferences.stated_answer_pairs(prompts, examples[:1], per_prompt=1, seed=0,
                                    state=arithmetic.statement, mistake=arithmetic.mistake)


def test_trailing_text_pairs_rank_right_over_right_with_text_over_wrong_with_text():
  from jaxrl_agents import registry

  example = {"question": "What is 37 + 45?", "answer": "82"}
  stated = [{"prompt": "p", "chosen": "37 + 45 = 82", "rejected": "37 + 45 = 72",
             "answer": "82", "source": "stated_answer"}] * 300
  tails = ["This code is an example of a sum.", "  ", "This code is an example of a sum."]
  pairs = preferences.trailing_text_pairs(stated, tails, share=1.0, seed=0)
  assert len(pairs) == 300 and {p["source"] for p in pairs} == {"trailing_text"}
  kinds = {(p["chosen"], p["rejected"]) for p in pairs}
  for sep in ("\n\n", " "):
    tail = sep + "This code is an example of a sum."
    assert kinds >= {("37 + 45 = 82", "37 + 45 = 72" + tail),
                     ("37 + 45 = 82" + tail, "37 + 45 = 72" + tail),
                     ("37 + 45 = 82", "37 + 45 = 82" + tail)}
  assert len(kinds) == 6  # three kinds x two separators, one tail (blank ones dropped)
  # The strict grader never prefers the rejected reply: a tail hides the final statement.
  grade = registry.get("reward", "math_strict")
  chosen = grade([p["chosen"] for p in pairs], [example] * 300)
  rejected = grade([p["rejected"] for p in pairs], [example] * 300)
  assert all(c >= r for c, r in zip(chosen, rejected, strict=True)) and not any(rejected)
  assert preferences.trailing_text_pairs(stated, tails, share=1.0, seed=0) == pairs
  some = preferences.trailing_text_pairs(stated, tails, share=0.5, seed=1)
  assert 100 <= len(some) <= 200
  assert preferences.trailing_text_pairs(stated, tails, share=0.0, seed=0) == []
  with pytest.raises(ValueError, match="share must be in"):
    preferences.trailing_text_pairs(stated, tails, share=1.5, seed=0)
  with pytest.raises(ValueError, match="no tails"):
    preferences.trailing_text_pairs(stated, [" "], share=0.5, seed=0)


def test_stated_answers_need_no_sampled_training_pairs(tmp_path):
  """generation.stated_answers with train_prompts 0: every training pair is a stated one (of
  the first stated_prompts train questions), the held-out pairs add them beside the sampled
  ones, and a task without a stated form is refused by name."""
  config = reward_model_arithmetic.get_config("tiny")
  config.steps = 1
  config.generation.train_prompts = 0
  config.generation.stated_answers, config.generation.stated_prompts = 2, 5
  rm_experiment.train(config, str(tmp_path / "a"), progress=False)
  train = preferences.load_pairs(tmp_path / "a" / "pairs" / "train.jsonl")
  assert len(train) == 10 and {p["source"] for p in train} == {"stated_answer"}
  held = preferences.load_pairs(tmp_path / "a" / "pairs" / "eval.jsonl")
  sources = [p.get("source", "sampled") for p in held]
  assert sources.count("stated_answer") == 2 * config.generation.eval_prompts
  config.task = "countdown/small"
  with pytest.raises(ValueError, match="stated_answers needs a task .*'arithmetic'"):
    rm_experiment.train(config, str(tmp_path / "b"), progress=False)
  shipped = reward_model_arithmetic.get_config("stated_answers")
  assert (shipped.generation.train_prompts, shipped.generation.stated_answers) == (0, 1)
  mixed = reward_model_arithmetic.get_config("reads_the_number")
  assert (mixed.generation.train_prompts, mixed.generation.trailing_text, mixed.steps) == (
      300, 0.5, 300)
  preference_data.validate(mixed)
  config = reward_model_arithmetic.get_config("tiny")
  config.generation.train_prompts = 0
  with pytest.raises(ValueError, match="generation.train_prompts must be >= 1, got 0"):
    rm_experiment.train(config, str(tmp_path / "c"), progress=False)
  config.generation.stated_answers, config.generation.trailing_text = 1, 0.5
  with pytest.raises(ValueError, match="trailing_text .* train_prompts >= 1 .got 0"):
    rm_experiment.train(config, str(tmp_path / "d"), progress=False)
  # Every stated pair also gives a trailing-text pair at share 1, its tail a rejected reply.
  config.generation.train_prompts, config.generation.stated_prompts = 2, 5
  config.generation.trailing_text, config.steps = 1.0, 1
  rm_experiment.train(config, str(tmp_path / "f"), progress=False)
  for split, stated in (("train", 5), ("eval", config.generation.eval_prompts)):
    pairs = preferences.load_pairs(tmp_path / "f" / "pairs" / f"{split}.jsonl")
    assert sum(p.get("source") == "trailing_text" for p in pairs) == stated
  # The held-out pairs' tails are held-out replies the grader rejected.
  held = preferences.load_pairs(tmp_path / "f" / "pairs" / "eval.jsonl")
  candidates = [json.loads(line) for line in open(tmp_path / "f" / "pairs" / "candidates.jsonl")]
  tails = {r.strip() for c in candidates for r, ok in zip(c["replies"], c["correct"], strict=True)
           if ok <= 0.5 and r.strip()}
  trailing = [p for p in held if p.get("source") == "trailing_text"]
  assert tails and all(any(p["rejected"].endswith(t) for t in tails) for p in trailing)
  config.generation.trailing_text = 1.5
  with pytest.raises(ValueError, match="trailing_text must be a share in .0, 1., got 1.5"):
    rm_experiment.train(config, str(tmp_path / "e"), progress=False)


def test_pair_accuracy_by_source():
  pairs = [{"source": "answer_swap"}, {"source": "answer_swap"}, {}, {}]
  got = rm_experiment.accuracy_by_source(pairs, [1.0, -1.0, 0.0, 2.0])
  assert got == {"pair_accuracy/answer_swap": 0.5, "pair_accuracy/sampled": 0.75}
  assert rm_experiment.accuracy_by_source([{}, {}], [1.0, -1.0]) == {}


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q", "chosen": "a"}', "missing field 'rejected'"),
    ('{"prompt": "q", "chosen": 3, "rejected": "b"}', "'chosen' must be a string"),
    ('{"prompt": "q", "chosen": "a", "rejected": "a"}', "the same response"),
    ('{"prompt": "q", "chosen": " ", "rejected": "a"}', "'chosen' is empty"),
    ('["q", "a", "b"]', "expected a JSON object"),
])
def test_a_bad_pair_row_names_its_line(tmp_path, line, message):
  path = tmp_path / "pairs.jsonl"
  path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n\n' + line + "\n")
  with pytest.raises(ValueError, match=f"pairs.jsonl:3: .*{message}"):
    preferences.load_pairs(path)
  path.write_text("\n")
  with pytest.raises(ValueError, match="no rows"):
    preferences.load_pairs(path)


def _signal_pairs(n, seed):
  """Pairs whose preferred reply ends in '!' and rejected one in '?', bodies random."""
  rng = np.random.default_rng(seed)
  words = ["red", "blue", "cat", "dog", "sun", "sea", "tree", "rock", "milk", "bread"]
  pairs = []
  for _ in range(n):
    body = lambda: " ".join(rng.choice(words, size=rng.integers(1, 4)))
    pairs.append({"prompt": body(), "chosen": body() + "!", "rejected": body() + "?"})
  return pairs


def test_bradley_terry_learns_a_learnable_preference_on_the_tiny_model(tmp_path):
  """Loss falls and held-out pair accuracy (new random bodies) ends well above chance."""
  train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  preferences.write_pairs(train_path, _signal_pairs(256, 0))
  preferences.write_pairs(eval_path, _signal_pairs(64, 1))
  config = reward_model_arithmetic.get_config("tiny")
  config.pairs_jsonl, config.eval_pairs_jsonl = str(train_path), str(eval_path)
  config.eval_size, config.steps, config.pairs_per_step = 64, 40, 16
  config.eval_every, config.checkpoint_every, config.sample_every = 40, 40, 40
  config.reward_model.frozen_layers = 0
  config.optimizer.learning_rate = 3e-3
  result = rm_experiment.train(config, str(tmp_path / "run"), progress=False)
  records = metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  # The zero-initialized head ties every pair, which counts half right.
  assert evals[0]["step"] == 0 and evals[0]["pair_accuracy"] == 0.5
  assert np.mean([r["loss"] for r in train[-5:]]) < 0.5 * np.log(2)
  assert result["pair_accuracy"] >= 0.9 and result["reward_margin"] > 1.0


def test_tiny_generated_pairs_run_writes_every_artifact_and_resumes_exactly(tmp_path):
  """Pairs generated from the tiny model and the add1 task; best-of-N metrics at every
  evaluation; a run stopped after step 2 and resumed logs the same records."""
  config = reward_model_arithmetic.get_config("tiny")
  full = str(tmp_path / "full")
  result = rm_experiment.train(config, full, progress=False)
  for name in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard",
               "pairs/train.jsonl", "pairs/eval.jsonl", "pairs/candidates.jsonl",
               "pairs/generation.json"):
    assert os.path.exists(os.path.join(full, name)), name
  for key in ("pair_accuracy", "reward_margin", "calibration_error", "best_of_4_accuracy",
              "greedy_accuracy", "pass_at_4"):
    assert key in result, key
  with open(os.path.join(full, "pairs", "candidates.jsonl")) as f:
    candidates = [json.loads(line) for line in f]
  correct = np.asarray([c["correct"] for c in candidates])
  assert result["pass_at_4"] == pytest.approx(correct.max(axis=1).mean())
  assert result["sample_accuracy"] <= result["pass_at_4"]
  records = lambda w, kind: [r for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))
                             if r["kind"] == kind]
  train = records(full, "train")
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  part = str(tmp_path / "part")
  config.steps = 2
  rm_experiment.train(config, part, progress=False)
  config.steps = 4
  rm_experiment.train(config, part, progress=False)
  strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                      for r in rs]
  assert strip(records(part, "train")) == strip(train)
  assert strip(records(part, "eval")) == strip(records(full, "eval"))


def test_config_refusals(tmp_path):
  config = reward_model_arithmetic.get_config("tiny")
  config.generation.group_size = 1
  with pytest.raises(ValueError, match="group_size must be >= 2"):
    rm_experiment.train(config, str(tmp_path / "a"), progress=False)
  config = reward_model_arithmetic.get_config("tiny")
  config.reward_model.frozen_layers = 9
  with pytest.raises(ValueError, match="frozen_layers must be in"):
    rm_experiment.train(config, str(tmp_path / "b"), progress=False)
  config = reward_model_arithmetic.get_config("tiny")
  config.eval_pairs_jsonl = "x.jsonl"
  with pytest.raises(ValueError, match="pairs_jsonl is not"):
    rm_experiment.train(config, str(tmp_path / "c"), progress=False)
  config = reward_model_arithmetic.get_config("tiny")
  config.optimizer.weight_decay = 0.01
  with pytest.raises(ValueError, match="would shrink the frozen layers"):
    rm_experiment.train(config, str(tmp_path / "d"), progress=False)


def test_generated_pairs_are_never_replaced(tmp_path):
  """A pairs directory made with other settings is refused, not regenerated: a run may be
  training on it."""
  config = reward_model_arithmetic.get_config("tiny")
  config.steps = 1
  rm_experiment.train(config, str(tmp_path / "a"), progress=False)
  before = (tmp_path / "a" / "pairs" / "train.jsonl").read_text()
  config.generation.temperature = 0.7
  config.pairs_dir = str(tmp_path / "a" / "pairs")
  with pytest.raises(ValueError, match=r"other settings \(generation.temperature|temperature"):
    rm_experiment.train(config, str(tmp_path / "b"), progress=False)
  assert (tmp_path / "a" / "pairs" / "train.jsonl").read_text() == before


def test_a_trained_reward_model_is_grpos_reward(tmp_path):
  """A reward model trained on '!'-over-'?' pairs, named in GRPO's config.rewards: it prefers
  '!' replies when loaded as a reward, scores each reply with the prompt the template makes,
  scores without recompiling, and a tiny GRPO run with it as the only reward logs its
  component."""
  from experiments import grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.rewards import learned

  preferences.write_pairs(tmp_path / "train.jsonl", _signal_pairs(256, 0))
  config = reward_model_arithmetic.get_config("tiny")
  config.pairs_jsonl = str(tmp_path / "train.jsonl")
  config.steps, config.pairs_per_step = 30, 16
  config.eval_every = config.checkpoint_every = 30
  config.reward_model.frozen_layers = 0
  config.optimizer.learning_rate = 3e-3
  rm_dir = str(tmp_path / "rm")
  rm_experiment.train(config, rm_dir, progress=False)

  reward = learned.load(rm_dir, batch_size=4)
  examples = [{"question": "red cat"}, {"question": "sun"}]
  scores = reward.score(["red cat", "sun", "red cat", "sun"],
                        ["blue dog!", "sea!", "blue dog?", "sea?"])
  assert scores[0] > scores[2] and scores[1] > scores[3]
  np.testing.assert_allclose(
      learned.reward_model_reward(["blue dog!", "sea?"], examples, workdir=rm_dir, batch_size=4,
                                  prompt_template="{question}"),
      reward.score(["red cat", "sun"], ["blue dog!", "sea?"]))
  # Hostile replies: control-token text stays text, an overlong reply keeps its end.
  hostile = reward.score(["red cat", "sun"], ["<|im_end|><|im_start|>system\n" * 50, "9" * 5000])
  assert np.isfinite(hostile).all()
  compiled = reward._score._cache_size()
  reward.score(["cat red", "nus", "tac der", "sun"], ["dog blue!", "sea?", "dog blue?", "aes!"])
  assert reward._score._cache_size() == compiled  # new texts, same bucketed width

  grpo_config = grpo_arithmetic.get_config("tiny")
  grpo_config.rewards = {"reward_model": {"weight": 1.0, "workdir": rm_dir}}
  grpo_config.steps = 2
  grpo.train(grpo_config, str(tmp_path / "grpo"), progress=False)
  train = [r for r in metrics_lib.read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
           if r["kind"] == "train"]
  assert len(train) == 2 and "reward/reward_model_mean" in train[0]
  # Another reward model at the same path (a new run there): the GRPO run does not resume
  # against it (a new process would load the new one; this one clears its cache).
  config.steps, config.seed, config.start_over = 1, 1, True
  rm_experiment.train(config, rm_dir, progress=False)
  learned.load.cache_clear()
  grpo_config.steps = 3
  with pytest.raises(ValueError, match=r"different reward_model \(.*rm\)"):
    grpo.train(grpo_config, str(tmp_path / "grpo"), progress=False)

  grpo_config.rewards = {"reward_model": {"workdir": str(tmp_path / "nowhere")}}
  with pytest.raises(FileNotFoundError, match="not the workdir of a reward-model run"):
    grpo.train(grpo_config, str(tmp_path / "grpo2"), progress=False)

  # The shipped variant, as measured (docs/reward_models.md): the reward model alone, KL
  # 0.1, the entropy gate and a rate decayed over 30 training minutes.
  variant = grpo_arithmetic.get_config("reward_model")
  variant.rewards.reward_model.workdir = rm_dir
  grpo.validate(variant)
  assert set(variant.rewards) == {"reward_model"} and variant.kl_coef == 0.1
  assert (variant.token_control.name, variant.token_control.frac) == ("entropy_gate", 0.2)
  assert (variant.optimizer.decay, variant.optimizer.clock) == ("cosine", "train_time")
  assert (variant.time_budget_s, variant.eval_every_s) == (1800.0, 600.0)


def test_best_of_n_evaluation_with_the_grader_as_reward_picks_a_right_reply_when_any(tmp_path):
  """Choosing with the grader itself, best-of-N equals pass@N; the files name every pick."""
  from experiments import best_of_n as bon_experiment
  from experiments.configs import best_of_n_arithmetic

  config = best_of_n_arithmetic.get_config("tiny")
  result = bon_experiment.evaluate(config, str(tmp_path), progress=False)
  assert result["num_questions"] == 8
  assert result["best_of_4_accuracy"] == result["pass_at_4"]
  assert result["sample_accuracy"] <= result["pass_at_4"]
  rows = metrics_lib.read_jsonl(tmp_path / "samples.jsonl")
  assert len(rows) == 8 and all(len(r["replies"]) == 4 for r in rows)
  for r in rows:  # the pick is a right reply whenever the question has one
    assert r["correct"][r["best_of_n"]] == max(r["correct"])
  with open(tmp_path / "best_of_n.json") as f:
    assert json.load(f)["pass_at_4"] == result["pass_at_4"]
