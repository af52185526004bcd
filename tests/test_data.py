"""Tests of jaxrl_agents.data: TFDS builders, load_task, JSONL prompt files, grain loaders."""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import os
import re
import sys
from fractions import Fraction

import grain
import orbax.checkpoint as ocp
import pytest

from jaxrl_agents import data, rewards
from jaxrl_agents.data import arithmetic, countdown

ARITHMETIC_SIZES = {  # config: (train, test), as documented in arithmetic.py
    "add1": (80, 20),
    "sub1": (35, 20),
    "add2": (7600, 500),
    "sub2": (3595, 500),
    "mul_table": (97, 24),
    "mixed": (5000, 100),
}
ARITHMETIC_RANGES = {  # group: (operation, low, high)
    "add1": ("add", 0, 9),
    "sub1": ("sub", 0, 9),
    "add2": ("add", 10, 99),
    "sub2": ("sub", 10, 99),
    "mul_table": ("mul", 2, 12),
}
PYTHON_OPS = {"add": (operator.add, "+"), "sub": (operator.sub, "-"), "mul": (operator.mul, "*")}


def _read(name: str, split: str, data_dir) -> list[dict]:
  return list(data.load_task(name, split, data_dir=data_dir))


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def arithmetic_data(tfds_dir) -> dict[str, dict[str, list[dict]]]:
  """Every arithmetic config, built with TFDS into a temporary data_dir and read back."""
  return {config: {split: _read(f"arithmetic/{config}", split, tfds_dir)
                   for split in ("train", "test")} for config in ARITHMETIC_SIZES}


@pytest.fixture(scope="module")
def countdown_data(tfds_dir) -> dict[str, list[dict]]:
  return {split: _read("countdown", split, tfds_dir) for split in ("train", "test")}


def _group_of(example: dict) -> str:
  """Which arithmetic group an example belongs to, from its operation and operands."""
  op, a, b = example["operation"], example["a"], example["b"]
  if op == "mul":
    return "mul_table"
  return f"{op}{1 if max(a, b) <= 9 else 2}"


# ----------------------------------------------------------------------------
# arithmetic


def test_arithmetic_features_sizes_and_answers(arithmetic_data):
  for config, (train_size, test_size) in ARITHMETIC_SIZES.items():
    splits = arithmetic_data[config]
    assert (len(splits["train"]), len(splits["test"])) == (train_size, test_size), config
    for example in splits["train"] + splits["test"]:
      assert set(example) == {"question", "answer", "operation", "a", "b"}
      assert all(isinstance(example[k], str) for k in ("question", "answer", "operation"))
      assert type(example["a"]) is int and type(example["b"]) is int
      fn, symbol = PYTHON_OPS[example["operation"]]
      a, b = example["a"], example["b"]
      assert example["answer"] == str(fn(a, b)), example
      assert example["question"] == f"What is {a} {symbol} {b}?"
      group = config if config != "mixed" else _group_of(example)
      op, low, high = ARITHMETIC_RANGES[group]
      assert example["operation"] == op and low <= a <= high and low <= b <= high, example
      if op == "sub":
        assert a >= b, example  # documented: non-negative results


def test_arithmetic_splits_disjoint_in_both_operand_orders(arithmetic_data):
  def keys(examples, swap=False):
    out = set()
    for e in examples:
      out.add((e["a"], e["operation"], e["b"]))
      if swap and e["operation"] in ("add", "mul"):
        out.add((e["b"], e["operation"], e["a"]))
    return out

  for config, splits in arithmetic_data.items():
    assert not keys(splits["train"], swap=True) & keys(splits["test"]), config
  # mixed reuses the groups' cut: no config's test problem is any config's train problem.
  all_train = set().union(*(keys(s["train"], swap=True) for s in arithmetic_data.values()))
  all_test = set().union(*(keys(s["test"]) for s in arithmetic_data.values()))
  assert not all_train & all_test
  # The single-group configs hold every problem of their group exactly once.
  for config in ARITHMETIC_RANGES:
    examples = arithmetic_data[config]["train"] + arithmetic_data[config]["test"]
    op, low, high = ARITHMETIC_RANGES[config]
    everything = {(a, op, b) for a in range(low, high + 1) for b in range(low, high + 1)
                  if op != "sub" or a >= b}
    assert len(examples) == len(everything) == len(keys(examples))
    assert keys(examples) == everything


def test_arithmetic_mixed_is_balanced(arithmetic_data):
  mixed = arithmetic_data["mixed"]
  train_groups = [_group_of(e) for e in mixed["train"]]
  test_groups = [_group_of(e) for e in mixed["test"]]
  assert {g: train_groups.count(g) for g in ARITHMETIC_RANGES} == dict.fromkeys(
      ARITHMETIC_RANGES, arithmetic.MIXED_TRAIN_PER_GROUP)
  assert {g: test_groups.count(g) for g in ARITHMETIC_RANGES} == dict.fromkeys(
      ARITHMETIC_RANGES, arithmetic.MIXED_TEST_PER_GROUP)
  test_keys = [(e["a"], e["operation"], e["b"]) for e in mixed["test"]]
  assert len(set(test_keys)) == len(test_keys)  # the test split repeats nothing
  # A small group's train problems repeat about equally often (whole passes).
  add1 = [(e["a"], e["b"]) for e in mixed["train"] if _group_of(e) == "add1"]
  counts = {k: add1.count(k) for k in set(add1)}
  assert len(counts) == ARITHMETIC_SIZES["add1"][0]
  assert max(counts.values()) - min(counts.values()) <= 1


def test_arithmetic_group_of_names_each_problems_group(arithmetic_data):
  for config in ARITHMETIC_RANGES:
    for split in ("train", "test"):
      assert {arithmetic.group_of(e) for e in arithmetic_data[config][split]} == {config}
  mixed = arithmetic_data["mixed"]["train"] + arithmetic_data["mixed"]["test"]
  assert [arithmetic.group_of(e) for e in mixed] == [_group_of(e) for e in mixed]
  # Operands from two ranges, a negative result, a product off the table: no group.
  for op, a, b in (("add", 5, 50), ("sub", 3, 7), ("mul", 13, 2)):
    with pytest.raises(ValueError, match="in no arithmetic group"):
      arithmetic.group_of({"operation": op, "a": a, "b": b})


# ----------------------------------------------------------------------------
# countdown

_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")


def _parse_and_evaluate(expression: str) -> tuple[Fraction, list[int]]:
  """(value, numbers used) by recursive descent; independent of the library's ast walker."""
  tokens, pos = [], 0
  while pos < len(expression):
    match = _TOKEN.match(expression, pos)
    assert match, f"bad character at {pos} in {expression!r}"
    tokens.append(match.group(1))
    pos = match.end()
  numbers: list[int] = []
  index = 0

  def peek():
    return tokens[index] if index < len(tokens) else None

  def take():
    nonlocal index
    index += 1
    return tokens[index - 1]

  def factor() -> Fraction:
    token = take()
    if token == "(":
      value = expr()
      assert take() == ")"
      return value
    assert token.isdigit(), expression
    numbers.append(int(token))
    return Fraction(int(token))

  def term() -> Fraction:
    value = factor()
    while peek() in ("*", "/"):
      value = value * factor() if take() == "*" else value / factor()
    return value

  def expr() -> Fraction:
    value = term()
    while peek() in ("+", "-"):
      value = value + term() if take() == "+" else value - term()
    return value

  value = expr()
  assert index == len(tokens), f"trailing tokens in {expression!r}"
  return value, numbers


def test_reference_parser_respects_precedence():
  assert _parse_and_evaluate("2 + 3 * 4") == (14, [2, 3, 4])
  assert _parse_and_evaluate("(2 + 3) * 4") == (20, [2, 3, 4])
  assert _parse_and_evaluate("8 - 3 - 2") == (3, [8, 3, 2])
  assert _parse_and_evaluate("12 / (2 * 3)")[0] == 2


def test_countdown_features_and_solutions(countdown_data):
  assert (len(countdown_data["train"]), len(countdown_data["test"])) == (
      countdown.TRAIN_SIZE, countdown.TEST_SIZE)
  sizes = []
  for example in countdown_data["train"] + countdown_data["test"]:
    assert set(example) == {"numbers", "target", "question", "solution"}
    numbers, target = example["numbers"], example["target"]
    assert isinstance(numbers, list) and all(type(n) is int for n in numbers)
    assert type(target) is int and 1 <= target <= 100
    assert all(1 <= n <= 25 for n in numbers)
    sizes.append(len(numbers))
    listed = ", ".join(map(str, numbers))
    assert example["question"] == (
        f"Using the numbers [{listed}], create an equation that equals {target}. "
        "Use each number once with + - * /.")
    value, used = _parse_and_evaluate(example["solution"])
    assert value == target, example
    assert sorted(used) == sorted(numbers), example  # every number, exactly once
  assert set(sizes) == {3, 4}
  assert sizes.count(3) == sizes.count(4)  # mixed: half each


def test_countdown_parenthesized_parts_are_positive_integers():
  # The generator promises integer arithmetic along the way; the printed solution keeps
  # part of its tree in the parentheses, so check each innermost one.
  train, test = countdown.count_splits(4)
  for instance in train[:500] + test[:100]:
    for inner in re.findall(r"\(([^()]*)\)", instance.solution):
      value, _ = rewards.evaluate_expression(inner)
      assert value.denominator == 1 and value > 0, instance


def test_countdown_splits_disjoint_across_configs():
  def keys(instances):
    return {(tuple(sorted(i.numbers)), i.target) for i in instances}

  configs = {c.name: c for c in countdown.Countdown.BUILDER_CONFIGS}
  all_train = set().union(*(keys(c.instances("train")) for c in configs.values()))
  all_test = set().union(*(keys(c.instances("test")) for c in configs.values()))
  assert not all_train & all_test
  for name, count in (("n3", 3), ("n4", 4)):
    train, test = configs[name].instances("train"), configs[name].instances("test")
    assert len(keys(train)) == len(train) == 5000 and len(keys(test)) == len(test) == 500
    assert {len(i.numbers) for i in train + test} == {count}


def test_reference_solutions_pass_the_one_countdown_verifier():
  """The generator's solutions are scored by the same verifier as the model's replies."""
  train, test = countdown.count_splits(4)
  for instance in train[:200] + test[:50]:
    example = {"numbers": list(instance.numbers), "target": instance.target}
    assert rewards.countdown_reward([f"<answer>{instance.solution}</answer>"], [example]) == [1.0]
    value, used = rewards.evaluate_expression(instance.solution)
    assert value == instance.target and sorted(used) == sorted(instance.numbers)


# ----------------------------------------------------------------------------
# Determinism and load_task


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


# Changing any of these changes the datasets: bump the builder's VERSION with the digest.
GOLDEN_DIGESTS = {
    "arithmetic/add1": "da041b7b6e02c048",
    "arithmetic/sub1": "b84cba723b4dd7a0",
    "arithmetic/add2": "4b60135050519641",
    "arithmetic/sub2": "6e190366fe07d0f0",
    "arithmetic/mul_table": "d979861044e5968a",
    "arithmetic/mixed": "84ecf35e9e750c8f",
    "countdown/n3": "594cc1dcde78d538",
    "countdown/n4": "dece63610458d9fd",
    "countdown/mixed": "acd89c8a98c4f60a",
}


def test_generated_problems_match_golden_digests():
  # pytest runs with a random hash seed, so this also catches set-order dependence.
  got = {}
  for c in arithmetic.Arithmetic.BUILDER_CONFIGS:
    got[f"arithmetic/{c.name}"] = _digest([c.problems("train"), c.problems("test")])
  for c in countdown.Countdown.BUILDER_CONFIGS:
    got[f"countdown/{c.name}"] = _digest([c.instances("train"), c.instances("test")])
  assert got == GOLDEN_DIGESTS


def test_rebuild_is_identical(tmp_path, arithmetic_data, countdown_data):
  # Clear the in-process caches so the rebuild draws from the seeds again, then compare
  # with the module's build (another data_dir, made earlier in this process).
  arithmetic.group_splits.cache_clear()
  countdown.count_splits.cache_clear()
  for split in ("train", "test"):
    assert _read("arithmetic/mixed", split, tmp_path) == arithmetic_data["mixed"][split]
    assert _read("countdown", split, tmp_path) == countdown_data[split]
  assert (tmp_path / "arithmetic" / "mixed" / "1.0.0").is_dir()  # really built anew


def test_load_task_default_dir_names_and_source(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXRL_AGENTS_CACHE", str(tmp_path))
  source = data.load_task("arithmetic/add1", "test")
  assert os.path.isdir(tmp_path / "tensorflow_datasets" / "arithmetic" / "add1" / "1.0.0")
  assert len(source) == 20
  assert source[-1] == source[19] and source[0:2] == [source[0], source[1]]
  with pytest.raises(IndexError):
    source[20]
  assert len(data.load_task("arithmetic/add1", "train[:10]")) == 10
  # A bare builder name means its default config.
  assert data.prepare("arithmetic").builder_config.name == "mixed"
  with pytest.raises(KeyError, match="arithmetic/add2"):
    data.load_task("arithmetic/add3", "train")
  with pytest.raises(KeyError, match="countdown/n3"):
    data.load_task("nope", "train")
  assert "tensorflow" not in sys.modules  # TFDS read and wrote array_record without TF


def test_tfds_data_source_prepares_array_record_without_tensorflow(tmp_path):
  import tensorflow_datasets as tfds

  source = tfds.data_source("arithmetic/add1", split="test", data_dir=tmp_path)
  assert len(source) == 20 and source[0]["question"].startswith(b"What is ")
  files = os.listdir(tmp_path / "arithmetic" / "add1" / "1.0.0")
  assert "arithmetic-test.array_record-00000-of-00001" in files
  assert "tensorflow" not in sys.modules


# ----------------------------------------------------------------------------
# JSONL


def test_load_jsonl_reads_rows_and_skips_blank_lines(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n\n'
                  '{"prompt": "Capital of France?", "answer": ["Paris"], "source": "geo"}\n')
  rows = data.load_jsonl(path)
  assert rows == [{"prompt": "What is 2 + 3?", "answer": "5"},
                  {"prompt": "Capital of France?", "answer": ["Paris"], "source": "geo"}]
  renamed = tmp_path / "renamed.jsonl"
  renamed.write_text('{"q": "hi", "a": 1}\n')
  assert data.load_jsonl(renamed, prompt_field="q", answer_field="a") == [{"q": "hi", "a": 1}]


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "x", "answer": "y"', "invalid JSON"),
    ('{"answer": "y"}', "missing field 'prompt'"),
    ('{"prompt": "x"}', "missing field 'answer'"),
    ('{"prompt": "x", "answer": null}', "missing field 'answer'"),
    ('{"prompt": 3, "answer": "y"}', "field 'prompt' must be a string"),
    ('["x", "y"]', "expected a JSON object"),
])
def test_load_jsonl_bad_row_names_file_and_line(tmp_path, bad_line, message):
  path = tmp_path / "prompts.jsonl"
  good = '{"prompt": "fine", "answer": "1"}'
  path.write_text("\n".join([good, "", good, bad_line, good]) + "\n")
  with pytest.raises(ValueError, match=re.escape(f"{path}:4: {message}")):
    data.load_jsonl(path)


def test_load_jsonl_empty_or_undecodable_files_are_errors(tmp_path):
  for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n  \n")):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: no rows")):
      data.load_jsonl(tmp_path / name)
  latin1 = tmp_path / "latin1.jsonl"
  latin1.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
  with pytest.raises(ValueError, match=re.escape(f"{latin1}:2: not UTF-8")):
    data.load_jsonl(latin1)
  with pytest.raises(FileNotFoundError):
    data.load_jsonl(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------
# Loaders

SOURCE = [{"prompt": f"prompt {i}", "answer": str(i)} for i in range(10)]


def _take(it, n):
  return [next(it) for _ in range(n)]


def _prompts(batches):
  return [[e["prompt"] for e in batch] for batch in batches]


def test_loader_batches_are_lists_of_dicts_and_deterministic():
  batches = _take(data.make_loader(SOURCE, batch_size=4, seed=0), 6)
  assert all(isinstance(b, list) and len(b) == 4 for b in batches)
  assert all(e in SOURCE for b in batches for e in b)  # strings survive batching
  assert batches == _take(data.make_loader(SOURCE, batch_size=4, seed=0), 6)
  assert batches != _take(data.make_loader(SOURCE, batch_size=4, seed=1), 6)
  batches[0][0]["prompt"] = "edited"  # a caller editing a batch leaves the data alone
  assert all(e["prompt"] != "edited" for e in SOURCE)


def test_loader_epochs_cover_the_data_and_reshuffle():
  stream = [e["prompt"] for b in _take(data.make_loader(SOURCE, batch_size=5, seed=3), 4)
            for e in b]
  epoch0, epoch1 = stream[:10], stream[10:]
  assert sorted(epoch0) == sorted(epoch1) == sorted(e["prompt"] for e in SOURCE)
  assert epoch0 != epoch1  # a new order each epoch
  assert epoch0 != [e["prompt"] for e in SOURCE]  # and shuffled at all
  ordered = _take(data.make_loader(SOURCE, batch_size=5, seed=3, shuffle=False), 2)
  assert _prompts(ordered) == [[f"prompt {i}" for i in range(5)],
                               [f"prompt {i}" for i in range(5, 10)]]


def test_loader_finite_epochs_and_remainder():
  assert [len(b) for b in data.make_loader(SOURCE, batch_size=4, seed=0, num_epochs=1)] == [4, 4]
  kept = list(data.make_loader(SOURCE, batch_size=4, seed=0, num_epochs=1,
                               drop_remainder=False))
  assert [len(b) for b in kept] == [4, 4, 2]
  assert sorted(e["prompt"] for b in kept for e in b) == sorted(e["prompt"] for e in SOURCE)
  assert len(list(data.make_loader(SOURCE, batch_size=4, seed=0, num_epochs=2))) == 5


def test_loader_shards_are_disjoint_and_equal():
  shards = [data.make_loader(SOURCE, batch_size=1, seed=5, shard_index=i, shard_count=3)
            for i in range(3)]
  for _epoch in range(2):
    seen = [[e["prompt"] for b in _take(it, 3) for e in b] for it in shards]
    flat = list(itertools.chain(*seen))
    assert len(flat) == len(set(flat)) == 9  # 10 % 3 = 1 example sits out each epoch
  with pytest.raises(ValueError, match="shard_index"):
    data.make_loader(SOURCE, batch_size=1, seed=0, shard_index=3, shard_count=3)
  with pytest.raises(ValueError, match="empty"):
    data.make_loader([], batch_size=1, seed=0)


def test_loader_state_restore_gives_identical_batches(arithmetic_data, tfds_dir):
  source = data.load_task("arithmetic/add2", "test", data_dir=tfds_dir)
  it = data.make_loader(source, batch_size=8, seed=42)
  _take(it, 70)  # past the end of the first epoch (500 examples)
  state = it.get_state()
  expected = _take(it, 5)
  fresh = data.make_loader(source, batch_size=8, seed=42)
  assert _take(data.make_loader(source, batch_size=8, seed=42), 5) != expected
  fresh.set_state(json.loads(json.dumps(state)))  # the state is plain JSON
  assert _take(fresh, 5) == expected


def test_loader_state_round_trips_through_orbax(tmp_path):
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  it = data.make_loader(SOURCE, batch_size=3, seed=7)
  _take(it, 4)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as manager:
    # Both ways: grain's own Orbax handler and the plain JSON state.
    manager.save(4, args=ocp.args.Composite(
        loader=grain.checkpoint.CheckpointSave(it), loader_json=ocp.args.JsonSave(it.get_state())))
  expected = _take(it, 6)

  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as manager:
    assert manager.latest_step() == 4
    via_grain = data.make_loader(SOURCE, batch_size=3, seed=7)
    restored = manager.restore(4, args=ocp.args.Composite(
        loader=grain.checkpoint.CheckpointRestore(via_grain), loader_json=ocp.args.JsonRestore()))
  assert _take(via_grain, 6) == expected
  via_json = data.make_loader(SOURCE, batch_size=3, seed=7)
  via_json.set_state(restored["loader_json"])
  assert _take(via_json, 6) == expected


def test_jsonl_rows_work_with_the_default_prompt_template(tmp_path):
  """JSONL rows are documented as {"prompt", "answer"}; the configs' templates name the tasks'
  field ("{question} ..."): a JSONL run formats its prompts with the default template."""
  from experiments import common
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.rollout import single_turn
  train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
  train.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n')
  test.write_text('{"prompt": "What is 4 + 4?", "answer": "8", "question": "Four plus four?"}\n')
  config = grpo_arithmetic.get_config("tiny")
  config.task, config.jsonl_path, config.eval_jsonl_path = "", str(train), str(test)
  examples, held_out = common.task_examples(config)
  assert single_turn.format_prompts(examples, config.prompt_template) == [
      config.prompt_template.format(question="What is 2 + 3?")]
  assert examples[0]["prompt"] == "What is 2 + 3?" and examples[0]["answer"] == "5"
  # A row's own "question" field is kept as written.
  assert held_out[0]["question"] == "Four plus four?"
