"""Hand-written cases for the host reward functions and their combinators."""

import functools
import time
from fractions import Fraction

import ml_collections
import numpy as np
import pytest

from jaxrl_agents import registry, rewards


def _ex(answer, n):
  return [{"answer": answer}] * n


def _score(name, completions, examples=None, **options):
  out = registry.get("reward", name)(completions, examples, **options)
  assert isinstance(out, np.ndarray) and out.dtype == np.float32
  assert out.shape == (len(completions),)
  return out.tolist()


def test_every_reward_is_registered():
  assert registry.names("reward") == sorted([
      "countdown", "countdown_format", "format_answer_only", "format_boxed", "last_integer",
      "length_penalty", "math_lenient", "math_strict", "multiple_choice",
      "multiple_choice_lenient", "reasoning_gym", "reasoning_gym_lenient",
      "reasoning_gym_solved", "reasoning_gym_solved_exact", "reasoning_gym_solved_lenient",
      "reward_model", "short_reply"])


# ---------------------------------------------------------------------------------------------
# Number syntax and extraction.


@pytest.mark.parametrize("text, boxed", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{{2}+{3}}", "{2}+{3}"),  # the last box, nested braces kept
    (r"\boxed{7} and a truncated \boxed{8", "7"),  # an unclosed box is skipped
    (r"\boxed{8", None),
    ("no box", None),
])
def test_extract_boxed(text, boxed):
  assert rewards.extract_boxed(text) == boxed


@pytest.mark.parametrize("text, number", [
    ("costs 1,234 dollars", "1,234"),
    ("x = -5", "-5"),
    ("10-5", "5"),  # a binary minus is not a sign
    ("then 3.0", "3.0"),
    ("+12 it is", "+12"),
    ("a list 1,2", "2"),  # "1,2" is two numbers, not 12 or 1.2
    ("1,2345", "2345"),  # a malformed grouping is not a thousands separator
    ("no digits", None),
])
def test_last_number(text, number):
  assert rewards.last_number(text) == number


def test_last_integer_skips_decimals_whole():
  assert rewards.last_integer("it costs 7, or 3.5 each") == "7"
  assert rewards.last_integer("-12 and then 1,000") == "1,000"
  assert rewards.last_integer("only 2.5") is None


@pytest.mark.parametrize("a, b, equal", [
    ("12", "12.0", True), ("+12", "12", True), ("12.00", 12, True), ("1,234", "1234", True),
    ("-5", "\u22125", True), ("12.5", "12", False), ("1,2", "12", False), ("1,2", "1.2", False),
    ("12", "-12", False), ("abc", "abc", False), (None, None, False),
])
def test_numbers_equal(a, b, equal):
  assert rewards.numbers_equal(a, b) is equal


# ---------------------------------------------------------------------------------------------
# Math graders.


def test_verbose_reply_right_by_accident_passes_lenient_only():
  reply = "First 40 apples are picked, then 2 more arrive, making 42 in the basket"
  assert _score("math_lenient", [reply], _ex("42", 1)) == [1.0]
  assert _score("last_integer", [reply], _ex("42", 1)) == [1.0]
  assert _score("math_strict", [reply], _ex("42", 1)) == [0.0]


@pytest.mark.parametrize("reply", [
    "42", " 42.\n", "The answer is 42.", "Answer: **42**", "so 40 + 2 = 42.", "#### 42",
    "The final answer is: $42$", r"Thus $\boxed{42}$ apples.", r"\boxed{42.0}", "42.0",
    "the answer to the question is 42",
])
def test_strict_accepts_explicit_final_answers(reply):
  assert _score("math_strict", [reply], _ex("42", 1)) == [1.0]


@pytest.mark.parametrize("reply", [
    "I think 42 apples",  # no explicit statement
    "The answer is 42 apples.",  # trailing words after the number
    "The answer is 42. Hope this helps!",  # not at the end
    r"\boxed{41} so the answer is 42.",  # a box decides
    "x = 44-2",  # the final "= N" is not a number
    "The answer is 41.",
    "",
])
def test_strict_rejects_implicit_or_wrong_answers(reply):
  assert _score("math_strict", [reply], _ex("42", 1)) == [0.0]


def test_negative_and_comma_answers():
  replies = ["The answer is -5.", "x = 7 - 12 = -5", "Answer: 1,234", "1234", "Answer: 1,2"]
  examples = [{"answer": "-5"}, {"answer": "-5"}, {"answer": "1234"}, {"answer": "1,234"},
              {"answer": "12"}]
  assert _score("math_strict", replies, examples) == [1.0, 1.0, 1.0, 1.0, 0.0]
  assert _score("math_lenient", replies, examples) == [1.0, 1.0, 1.0, 1.0, 0.0]
  assert _score("last_integer", replies, examples) == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_lenient_prefers_the_box_and_last_integer_ignores_it():
  reply = r"\boxed{42}, since 6 * 7 is 42 and not 41"
  assert _score("math_lenient", [reply], _ex("42", 1)) == [1.0]
  assert _score("last_integer", [reply], _ex("42", 1)) == [0.0]


def test_last_integer_does_not_read_decimals():
  assert _score("last_integer", ["it is 12.0"], _ex("12", 1)) == [0.0]
  assert _score("math_lenient", ["it is 12.0"], _ex("12", 1)) == [1.0]
  assert _score("last_integer", ["it is 12"], [{"answer": 12}]) == [1.0]  # int answers too


def test_math_reward_rejects_a_non_numeric_answer_field():
  with pytest.raises(ValueError, match=r"math_strict: example 1 field 'answer' is not a number"):
    rewards.math_strict_reward(["1", "2"], [{"answer": "1"}, {"answer": "#### 2"}])


# ---------------------------------------------------------------------------------------------
# Format rewards.


def test_format_boxed_needs_exactly_one_complete_box():
  replies = [r"\boxed{3}", r"\boxed{1} \boxed{2}", r"\boxed{\boxed{3}}", r"\boxed{3", "3"]
  assert _score("format_boxed", replies) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_format_answer_only():
  replies = ["42", " -5.\n", "1,234", "3.0", "$42", "42 apples", "x = 42", ""]
  assert _score("format_answer_only", replies) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_short_reply_threshold_is_configurable():
  replies = ["a" * 39, "a" * 40, "a" * 10]
  assert _score("short_reply", replies) == [1.0, 0.0, 1.0]
  assert _score("short_reply", replies, max_chars=10) == [0.0, 0.0, 0.0]
  short = functools.partial(rewards.short_reply_reward, max_chars=11)
  assert short(replies, None).tolist() == [0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------------
# Countdown.

_TASK = {"numbers": [25, 5, 4], "target": 80}


@pytest.mark.parametrize("reply", [
    "<answer>(25 - 5) * 4</answer>",
    "<answer>(25 - 5) * 4 = 80</answer>",
    "Let me think.\n25 - 5 = 20\n(25 - 5) \u00d7 4 = 80",
    "$4 * (25 - 5)$.",
    "Answer: 4*(25-5)",
])
def test_countdown_valid(reply):
  assert _score("countdown", [reply], [_TASK]) == [1.0]
  assert _score("countdown_format", [reply]) == [1.0]


@pytest.mark.parametrize("reply, parses", [
    ("<answer>25 * 4 - 5 * 4</answer>", True),  # 4 used twice but given once
    ("<answer>(25 - 5) * 4 = 81</answer>", True),  # a stated result that is not the target
    ("<answer>25 * 4 - 20</answer>", True),  # 20 is not a given number; 5 is missing
    ("<answer>(25 + 5) * 4</answer>", True),  # wrong value
    ("<answer>80</answer>", True),  # not using the numbers
    ("<answer>25 * 4 / (5 - 5)</answer>", True),  # division by zero
    ("<answer>__import__('os').system('ls')</answer>", False),
    ("<answer>2**100</answer>", False),
    ("2 ** 100", False),
    ("<answer>(25 - 5) // 1 * 4</answer>", False),
    ("<answer>1234567 - 1234567 + 80</answer>", False),  # literal too large
    ("<answer>(25 - 5) * 4</answer>" + "<answer>" + "1 + " * 60 + "1</answer>", False),  # long
    ("I could not solve it.", False),
])
def test_countdown_invalid(reply, parses):
  assert _score("countdown", [reply], [_TASK]) == [0.0]
  assert _score("countdown_format", [reply]) == [float(parses)]


def test_countdown_use_all_is_optional():
  reply = "<answer>(25 - 5) * 4</answer>"
  task = {"numbers": [25, 5, 4, 7], "target": 80}
  assert _score("countdown", [reply], [task]) == [0.0]
  assert _score("countdown", [reply], [task], use_all=False) == [1.0]
  # Reuse is still forbidden without use_all.
  twice = {"numbers": [25, 5, 4], "target": 100}
  assert _score("countdown", ["<answer>25 * 4 + 5 - 5</answer>"], [twice], use_all=False) == [0.0]


def test_countdown_repeated_numbers_and_exact_division():
  task = {"numbers": [3, 3, 8, 8], "target": 24}
  assert _score("countdown", ["<answer>8 / (3 - 8 / 3)</answer>"], [task]) == [1.0]
  assert _score("countdown", ["<answer>8 / (3 - 8 / 3) + 0 * 3</answer>"], [task]) == [0.0]


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os')", "characters"),
    ("2**100", "Pow"),
    ("7 // 2", "FloorDiv"),
    ("+3", "UnaryOp"),
    ("-3 + 4", "UnaryOp"),
    ("-(3 - 5)", "UnaryOp"),
    ("1 / 0", "division by zero"),
    ("1" * 7, "digits"),
    ("1+" * 120 + "1", "more than 200"),
    ("(1 + 2", "not an arithmetic expression"),
    ("", "empty"),
])
def test_safe_parser_rejects_with_a_reason(expression, reason):
  with pytest.raises(rewards.ExpressionError, match=reason):
    rewards.evaluate_expression(expression)


def test_safe_parser_values_and_numbers():
  value, used = rewards.evaluate_expression("(5 - 3) * (1 / 3) * 3")
  assert value == Fraction(2) and used == (5, 3, 1, 3, 3)
  assert rewards.evaluate_expression("7 / 2")[0] == Fraction(7, 2)
  assert rewards.extract_expression("x\n(1 + 2) * 3 = 9\nDone.") == ("(1 + 2) * 3", 9)
  assert rewards.extract_expression("<answer>just words</answer>\n1 + 2") is None


def test_countdown_rejects_malformed_task_fields():
  with pytest.raises(ValueError, match=r"example 0 field 'numbers' must be a list of integers"):
    rewards.countdown_reward(["1 + 2"], [{"numbers": "1 2", "target": 3}])
  with pytest.raises(ValueError, match=r"example 0 field 'target' must be an integer"):
    rewards.countdown_reward(["1 + 2"], [{"numbers": [1, 2], "target": "3"}])


# ---------------------------------------------------------------------------------------------
# Length penalty.


def test_length_penalty_chars_and_token_lengths():
  replies = ["a" * 10, "a" * 15, "a" * 40]
  assert _score("length_penalty", replies, budget=10) == pytest.approx([0.0, -0.5, -3.0])
  assert _score("length_penalty", replies, budget=10, coef=2.0, max_penalty=4.0) == (
      pytest.approx([0.0, -1.0, -4.0]))
  # Token lengths replace character counts.
  assert _score("length_penalty", replies, budget=4, lengths=[2, 4, 6]) == (
      pytest.approx([0.0, 0.0, -0.5]))
  with pytest.raises(ValueError, match=r"lengths has shape \(2,\) but there are 3 completions"):
    rewards.length_penalty_reward(replies, lengths=[1, 2])


# ---------------------------------------------------------------------------------------------
# Errors shared by every reward.

_FIELDS = {
    "math_strict": "answer", "math_lenient": "answer", "last_integer": "answer",
    "countdown": "numbers",
}


@pytest.mark.parametrize("name", sorted(_FIELDS) + [
    "countdown_format", "format_answer_only", "format_boxed", "length_penalty", "short_reply"])
def test_mismatched_batch_is_an_error(name):
  with pytest.raises(ValueError, match=rf"{name}: got 2 completions but 1 examples"):
    registry.get("reward", name)(["1", "2"], [{"answer": "1", "numbers": [1], "target": 1}])


@pytest.mark.parametrize("name", sorted(_FIELDS))
def test_missing_field_is_named_with_its_index(name):
  good = {"answer": "1", "numbers": [1], "target": 1}
  bad = {k: v for k, v in good.items() if k != _FIELDS[name]}
  with pytest.raises(ValueError, match=rf"{name}: example 1 lacks field '{_FIELDS[name]}'"):
    registry.get("reward", name)(["1", "1"], [good, bad])


def test_countdown_missing_target_is_named():
  with pytest.raises(ValueError, match=r"example 0 lacks field 'target'"):
    rewards.countdown_reward(["1"], [{"numbers": [1]}])


def test_a_single_string_or_a_column_batch_is_refused():
  with pytest.raises(TypeError, match="not a single str"):
    rewards.math_strict_reward("42", [{"answer": "42"}])
  with pytest.raises(TypeError, match=r"got one mapping with keys \['answer'\]"):
    rewards.math_strict_reward(["42"], {"answer": ["42"]})


# ---------------------------------------------------------------------------------------------
# Combinators.


def _const(values):
  """A reward returning fixed values (the combinators only see arrays)."""
  def reward(completions, examples=None):
    return np.asarray(values, np.float32)
  return reward


def test_weighted_sum_total_and_per_component_logging():
  reward_fn = rewards.combine({"correct": ("last_integer", 1.0),
                               "short": (rewards.short_reply_reward, 0.5)})
  replies = ["42", "a long reply that happens to end with the number 42", "41"]
  total, parts = reward_fn(replies, _ex("42", 3))
  assert total.dtype == np.float32
  np.testing.assert_allclose(total, [1.5, 1.0, 0.5])
  assert set(parts) == {"correct", "short"}
  np.testing.assert_array_equal(parts["correct"], [1, 1, 0])  # unweighted
  np.testing.assert_array_equal(parts["short"], [1, 0, 1])


def test_from_config_weights_options_and_configdict():
  spec = ml_collections.ConfigDict({"last_integer": 1.0,
                                    "short_reply": {"weight": 0.2, "max_chars": 3}})
  reward_fn = rewards.from_config(dict(spec))
  total, parts = reward_fn(["42", "It is 42"], _ex("42", 2))
  np.testing.assert_allclose(total, [1.2, 1.0])
  np.testing.assert_array_equal(parts["short_reply"], [1, 0])


def test_from_config_unknown_name_or_option_is_a_key_error():
  with pytest.raises(KeyError, match=r"unknown reward 'last_int'.*'last_integer'"):
    rewards.from_config({"last_int": 1.0})
  with pytest.raises(KeyError, match=r"'short_reply' has no option\(s\) \['max_char'\].*max_chars"):
    rewards.from_config({"short_reply": {"weight": 0.2, "max_char": 3}})
  with pytest.raises(TypeError, match="weight of reward 'short_reply' must be a number"):
    rewards.from_config({"short_reply": "0.2"})


def test_lengths_reach_only_the_components_that_take_them():
  reward_fn = rewards.from_config({"length_penalty": {"budget": 2}, "short_reply": 1.0})
  total, parts = reward_fn(["abc", "a"], None, lengths=[4, 1])
  np.testing.assert_allclose(parts["length_penalty"], [-1.0, 0.0])  # tokens, not chars
  np.testing.assert_allclose(total, [0.0, 1.0])
  with pytest.raises(TypeError, match=r"no reward component accepts keyword\(s\) \['lenghts'\]"):
    reward_fn(["abc"], None, lenghts=[4])


def test_component_output_is_checked():
  with pytest.raises(ValueError, match=r"component 'bad' returned shape \(3,\), expected \(2,\)"):
    rewards.combine({"bad": (_const([1, 2, 3]), 1.0)})(["a", "b"])
  with pytest.raises(ValueError, match=r"component 'nan' returned non-finite values at \[1\]"):
    rewards.combine({"nan": (_const([1, np.nan]), 1.0)})(["a", "b"])


def test_lexicographic_higher_term_dominates():
  high = _const([1, 1, 0, 0, 1])
  mid = _const([0, 1, 1, 1, 0])
  low = _const([0, 0, 1, 0.9, 1])
  reward_fn = rewards.lexicographic([("high", high), ("mid", mid), ("low", low)])
  total, parts = reward_fn(["x"] * 5)
  # high alone beats mid + low together; with high tied, mid decides; then low.
  assert total[0] > total[2] > total[3]
  assert total[1] > total[4] > total[0]
  np.testing.assert_allclose(total, np.array([4, 6, 3, 2.9, 5]) / 7, rtol=1e-6)  # 4:2:1
  np.testing.assert_allclose(parts["low"], [0, 0, 1, 0.9, 1], rtol=1e-6)
  with pytest.raises(ValueError, match=r"component 'big' must lie in \[0, 1\]"):
    rewards.lexicographic([("big", _const([2.0]))])(["x"])


def test_gated_child_is_zero_when_parent_fails():
  reward_fn = rewards.gated("format_boxed", "math_strict", parent_weight=0.1)
  replies = [r"\boxed{42}", r"\boxed{41}", "The answer is 42."]
  total, parts = reward_fn(replies, _ex("42", 3))
  np.testing.assert_allclose(total, [1.1, 0.1, 0.0])
  np.testing.assert_array_equal(parts["math_strict"], [1, 0, 0])  # gated
  np.testing.assert_array_equal(parts["math_strict/ungated"], [1, 0, 1])
  np.testing.assert_array_equal(parts["format_boxed"], [1, 1, 0])


def test_combinators_nest_and_log_nested_parts():
  inner = rewards.gated("format_boxed", "math_strict", parent_weight=0.0)
  reward_fn = rewards.combine({"boxed_correct": (inner, 1.0), "short": ("short_reply", 0.5)})
  total, parts = reward_fn([r"\boxed{42}", "The answer is 42."], _ex("42", 2))
  np.testing.assert_allclose(total, [1.5, 0.5])
  np.testing.assert_array_equal(parts["boxed_correct"], [1, 0])
  np.testing.assert_array_equal(parts["boxed_correct/math_strict/ungated"], [1, 1])



# ---------------------------------------------------------------------------------------------
# Hostile replies: every reader finishes in time linear in the reply and gives a defined result.

_HOSTILE = {
    "whitespace after the number, not ending the reply": "The answer is 5" + " " * 100_000 + "x",
    "many final-statement anchors": "=1" * 50_000 + " " * 2_000 + "x",
    "markup runs": "= 5 " + "** " * 30_000 + "x",
    "a 10,000-digit number": "The answer is " + "1" * 10_000,
    "deep parentheses": "(" * 50_000 + "1" + ")" * 50_000,
}


@pytest.mark.parametrize("name", sorted(_HOSTILE))
def test_hostile_replies_are_read_quickly(name):
  reply = _HOSTILE[name]
  start = time.perf_counter()
  for reward in ("math_strict", "math_lenient", "last_integer"):
    assert _score(reward, [reply], [{"answer": "5"}])[0] in (0.0, 1.0)
  assert _score("countdown", [reply], [{"numbers": [1, 2], "target": 3}]) == [0.0]
  assert time.perf_counter() - start < 2.0, name


def test_a_long_whitespace_tail_still_ends_a_final_statement():
  assert rewards.strict_answer("2 + 3 = 5" + " " * 100_000) == 5
  assert rewards.strict_answer("The answer is **42**.  ") == 42


def test_only_ascii_digits_are_numbers():
  for reply in ("\u0665", "The answer is \uff15", "\u0661\u0662"):
    assert _score("math_strict", [reply], [{"answer": "5"}]) == [0.0], reply
    assert rewards.last_integer(reply) is None
  assert rewards.parse_number("1" * 101) is None and rewards.parse_number("1" * 100) is not None


def test_a_huge_stated_countdown_result_is_wrong_not_skipped():
  task = {"numbers": [3, 8], "target": 24}
  assert _score("countdown", ["3 * 8\n3 * 8 = 2400000000000000"], [task]) == [0.0]
  assert _score("countdown", ["3 * 8 = " + "9" * 5000], [task]) == [0.0]
  assert _score("countdown", ["3 * 8 = 24"], [task]) == [1.0]
