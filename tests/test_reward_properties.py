r"""Properties of the host rewards on hostile replies, and their time limit.

The policy is optimised against these functions, so it will find any reply
that makes one slow or undefined: whitespace runs, thousands of nested or
unclosed \boxed{ and braces, numbers of thousands of digits, thousands of
comma groups, Unicode digits, chat control tokens, markup. For every
registered reward and such replies of up to ~20k characters: a finite score
in the reward's documented range, no exception, well under a second, and
time linear in the reply (crafted worst cases, 4x the length, at most ~8x
the time, where quadratic would be 16x). The linear rewrites of the readers
are checked against the regexes and loops they replaced on short replies.
Then `TimeLimited`: an over-long completion scores 0 and is counted while
its batch scores normally.
"""

import logging
import math
import os
import re
import sys
import time
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_agents import registry, rewards
from jaxrl_agents.rewards import answers, countdown, learned, time_limit


def _text_rewards() -> list[str]:
  """The registered rewards that read reply text; a learned reward (a model, checked in
  tests/test_reward_model.py) needs a trained run to exist."""
  return [n for n in registry.names("reward") if not learned.is_learned(n)]


# Moderate, and no example database written into the repository.
_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_FAST = settings(_SETTINGS, max_examples=300)  # the differential checks on short replies

# One example every registered reward can read.
_EXAMPLE = {"answer": "12", "numbers": [3, 4, 5], "target": 12,
            "metadata": {"source_dataset": "gcd"}}  # reasoning-gym's scorer of gcd
# reasoning-gym loads (imports, its scorers' safety read) at a reward's first answer, once per
# process: a second that is no reply's cost.
registry.get("reward", "reasoning_gym")(["<answer>12</answer>"], [_EXAMPLE])
# Each registered reward's documented range (rewards/__init__.py); a new reward must add its own.
_RANGES = {"length_penalty": (-math.inf, 0.0)}
_UNIT_RANGE = {"countdown", "countdown_format", "format_answer_only", "format_boxed",
               "last_integer", "math_lenient", "math_strict", "short_reply",
               "multiple_choice", "multiple_choice_lenient", "reasoning_gym",
               "reasoning_gym_lenient", "reasoning_gym_solved", "reasoning_gym_solved_lenient",
               "reasoning_gym_solved_exact"}
MAX_CHARS = 20_000
# Per call on MAX_CHARS characters; measured at under 5 ms on a 2-core machine.
TIME_BOUND_S = 0.5


def _reward_range(name: str) -> tuple[float, float]:
  if name in _UNIT_RANGE:
    return 0.0, 1.0
  assert name in _RANGES, f"reward {name!r} has no documented range in this test: add it"
  return _RANGES[name]


def _check_every_reward(reply: str) -> None:
  """Every registered reward scores `reply` in its range, within TIME_BOUND_S."""
  for name in _text_rewards():
    start = time.perf_counter()
    out = registry.get("reward", name)([reply], [_EXAMPLE])
    elapsed = time.perf_counter() - start
    low, high = _reward_range(name)
    assert out.dtype == np.float32 and out.shape == (1,), name
    assert np.isfinite(out[0]) and low <= out[0] <= high, (name, out)
    assert elapsed < TIME_BOUND_S, f"{name} took {elapsed:.3f} s on {len(reply)} characters"


# ---------------------------------------------------------------------------------------------
# Hostile replies.

_UNICODE_DIGITS = {
    "arabic-indic": "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669",
    "extended arabic-indic": "".join(chr(0x06F0 + i) for i in range(10)),
    "devanagari": "".join(chr(0x0966 + i) for i in range(10)),
    "fullwidth": "".join(chr(0xFF10 + i) for i in range(10)),
    "superscript": "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079",
    "mathematical bold": "".join(chr(0x1D7CE + i) for i in range(10)),
}
_FRAGMENTS = [
    " ", "  ", "\n", "\t", "\u00a0", "\r\n", "1", "12", "-12", "\u221212", "+3", "1,234", ",234",
    ",5", ",", ".", "12.0", "3.5", "=", " = ", "####", "answer", "The answer is ", "Answer: ",
    "Final answer: ", r"\boxed{", r"\fbox {", "{", "}", r"\frac{1}{2}", r"\text{apples}", "$",
    r"\$", "`", "```", "**", "*", r"\(", r"\)", r"\[", r"\]", "%", "<answer>", "</answer>",
    "<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", "<think>", "</think>", "(", ")",
    "3 * 4", "3 * 4 = 12", "(5 - 3) * 4 + 4", "\u00d7", "\u00f7", "<b>", "</b>", "&nbsp;",
    "\u200b", "\ufeff", "\x00", "\U0001f600", *_UNICODE_DIGITS.values(),
]
_fragment = st.sampled_from(_FRAGMENTS)
# A fragment repeated up to thousands of times: runs of whitespace, braces, markup, digits.
_run = st.builds(lambda f, k: f * k, _fragment, st.integers(1, 3000))
_whitespace_after_number = st.builds(
    lambda n, k, tail: n + " " * k + tail, st.sampled_from(["12", "= 12", "answer is 12", "3 * 4"]),
    st.sampled_from([1, 80, 81, 82, 1023, 1024, 1025, 5000]), st.sampled_from(["x", ".", "\n5"]))
_nested_boxes = st.builds(
    lambda opening, depth, inner, closed: opening * depth + inner + "}" * min(closed, depth),
    st.sampled_from([r"\boxed{", "{", r"\boxed{{", r"\fbox{"]), st.integers(1, 3000),
    st.sampled_from(["12", "", "}{", r"\frac{1}{2}"]), st.integers(0, 3000))
_huge_number = st.builds(lambda prefix, k, d: prefix + d * k,
                         st.sampled_from(["", "The answer is ", r"\boxed{", "3 * 4 = ", "-"]),
                         st.integers(5000, 15_000), st.sampled_from(["1", "9", "0"]))
_comma_groups = st.builds(lambda head, k, tail: head + ",234" * k + tail,
                          st.sampled_from(["1", "12", "123", "1234", "= 1"]),
                          st.integers(1, 4000), st.sampled_from(["", ",5", "5", ".5", ",12 x"]))
_hostile_reply = st.one_of(
    st.lists(st.one_of(_fragment, _run), max_size=12).map("".join),
    _whitespace_after_number, _nested_boxes, _huge_number, _comma_groups,
    st.text(max_size=200),
).map(lambda reply: reply[:MAX_CHARS])


@_SETTINGS
@given(_hostile_reply)
def test_every_reward_gives_a_defined_result_quickly_on_hostile_replies(reply):
  _check_every_reward(reply)


@_SETTINGS
@given(st.lists(_hostile_reply, min_size=2, max_size=3))
def test_hostile_pieces_joined_still_give_a_defined_result(pieces):
  _check_every_reward("".join(pieces)[:MAX_CHARS])


@_SETTINGS
@given(st.sampled_from(sorted(_UNICODE_DIGITS)),
       st.sampled_from(["12", "The answer is 12", "The answer is 12.", r"\boxed{12}", "= 12",
                        "#### 12", "-12", "1,212"]))
def test_unicode_digits_are_not_numbers(script, reply):
  """A reply written in non-ASCII digits states no number (answers.py: what counts as a digit)."""
  written = reply.translate(str.maketrans("0123456789", _UNICODE_DIGITS[script]))
  for name in ("math_strict", "math_lenient", "last_integer", "format_answer_only"):
    assert registry.get("reward", name)([written], [{"answer": "12"}]).tolist() == [0.0], name
  assert answers.last_number(written) is None and answers.parse_number(written) is None
  assert answers.last_number(reply) is not None  # while the same reply in ASCII is read


# ---------------------------------------------------------------------------------------------
# Linear time on crafted worst cases: 4x the reply, at most ~8x the time (quadratic: 16x).
# From 20k characters: between 10k and 40k the time per character of some linear parsers
# still grows (math_lenient's brace matching measured 6-9x there, 3.7x from 40k to 160k),
# where 20k to 80k measured at most 4.2x for every case and reward.

_WORST_CASES = {
    "malformed comma groups": lambda n: "1" + ",234" * (n // 4) + ",5",
    "comma groups, a 4-digit tail": lambda n: "1" + ",234" * (n // 4) + "5",
    "unclosed boxes": lambda n: r"\boxed{" * (n // 7),
    "unclosed boxes, then text": lambda n: r"\boxed{" * (n // 14) + "7" * (n // 2),
    "deep braces": lambda n: "{" * (n // 2) + "12" + "}" * (n // 2),
    "unclosed answer tags": lambda n: "<answer>" * (n // 8),
    "a backtick run inside a line": lambda n: "1 + 2 " + "`" * n + " x",
    "a dollar run inside a line": lambda n: "1 + 2 " + "$" * n + " x",
    "81 spaces after each number": lambda n: ("= 5" + " " * 81 + "x") * (n // 85),
    "whitespace after 'answer is'": lambda n: ("answer is" + " " * 1000 + ":x") * (n // 1010),
    "a huge number": lambda n: "The answer is " + "1" * n,
    "deep parentheses": lambda n: "(" * (n // 2) + "1" + ")" * (n // 2),
    "control tokens": lambda n: "<|im_start|>assistant\n12<|im_end|>" * (n // 34),
}


def _best_times(fn, small: str, large: str, rounds: int = 5) -> tuple[float, float]:
  """The best of `rounds` timings of each reply, the two measured in turn: a stretch of
  load from another process (the test lanes share two cores) slows both alike instead of
  only the one that happened to run then."""
  best_small = best_large = math.inf
  for _ in range(rounds):
    for reply in (small, large):
      start = time.perf_counter()
      fn([reply], [_EXAMPLE])
      elapsed = time.perf_counter() - start
      if reply is small:
        best_small = min(best_small, elapsed)
      else:
        best_large = min(best_large, elapsed)
  return best_small, best_large


def _ratio(t_small: float, t_large: float) -> float:
  # A floor on the small time: below it, timer noise would decide the ratio.
  return t_large / max(t_small, 2e-3)


def _times_of_best_attempt(fn, small: str, large: str, attempts: int = 3):
  """(t_small, t_large) of the attempt with the smallest ratio. A linear reader meets the
  bound in one attempt unless the machine is busy throughout it; a quadratic one (16x)
  misses it in every attempt."""
  best = (1.0, math.inf)
  for _ in range(attempts):
    times = _best_times(fn, small, large)
    if _ratio(*times) < _ratio(*best):
      best = times
    if _ratio(*best) <= 8:
      break
  return best


@pytest.mark.parametrize("case", sorted(_WORST_CASES))
def test_time_is_linear_in_the_reply_on_worst_cases(case):
  small, large = _WORST_CASES[case](20_000), _WORST_CASES[case](80_000)
  for name in _text_rewards():
    fn = registry.get("reward", name)
    t_small, t_large = _times_of_best_attempt(fn, small, large)
    assert _ratio(t_small, t_large) <= 8, (name, t_small, t_large)
    assert t_large < 4 * TIME_BOUND_S, (name, t_large)


# ---------------------------------------------------------------------------------------------
# The linear readers read what the regexes and loops they replaced read.

_short_reply = st.lists(st.sampled_from([
    "0", "7", "12", "123", "1234", ",", ",234", ",12", ".", ".5", "-", "+", "\u2212", " ", "a",
    "_", ")", "]", "}", "{", r"\boxed{", r"\fbox {", r"\boxed ", "\\", "\u0665", "$", "`", "**",
    "*", r"\(", r"\)", r"\]", "<answer>", "</answer>", "<ANSWER>", "=", "\n",
]), max_size=20).map("".join)


def _extract_boxed_by_rescanning(text: str) -> str | None:
  """The former extract_boxed: from each opening, last first, scan forward for its brace."""
  for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
    depth = 1
    for i in range(match.end(), len(text)):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        return text[match.end():i]
  return None


_FORMER_WRAPPERS_RE = re.compile(
    r"^(?:\$+|`+|\*\*|\\\(|\\\[)\s*|\s*(?:\$+|`+|\*\*|\\\)|\\\])?\.?$")
_FORMER_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@_FAST
@given(_short_reply)
def test_number_scan_reads_what_the_number_regex_reads(text):
  assert list(answers._numbers(text)) == answers._NUMBER_RE.findall(text)


@_FAST
@given(_short_reply)
def test_single_pass_extract_boxed_matches_rescanning(text):
  assert answers.extract_boxed(text) == _extract_boxed_by_rescanning(text)


@_FAST
@given(_short_reply)
def test_countdown_readers_match_the_former_regexes(text):
  line = " ".join(text.split())
  assert countdown._strip_wrappers(line) == _FORMER_WRAPPERS_RE.sub("", line)
  blocks = _FORMER_ANSWER_TAG_RE.findall(text)
  assert countdown._last_answer_block(text) == (blocks[-1] if blocks else None)


# ---------------------------------------------------------------------------------------------
# The time limit. The slow reward lives here, at module level, so the worker can import it.

SLOW_S = 60.0  # far past any limit below: only killing the worker ends it in time


def sleepy_reward(completions, examples=None, *, lengths=None):
  """1 per completion (+ its length when given); a completion saying "sleep" takes SLOW_S."""
  if any("sleep" in c for c in completions):
    time.sleep(SLOW_S)
  extra = np.zeros(len(completions)) if lengths is None else np.asarray(lengths, np.float64)
  return (1.0 + extra).astype(np.float32)


def failing_reward(completions, examples=None):
  raise KeyError(f"no field for {completions[0]!r}")


def dying_reward(completions, examples=None):
  os._exit(3)  # a crash of the worker itself (a segfault in an extension, say)


def half_reward(completions, examples=None):
  return np.full(len(completions), 0.5, np.float32)


def test_an_over_long_completion_scores_zero_and_is_counted_the_rest_score():
  limited = time_limit.TimeLimited(sleepy_reward, seconds=1.0)
  start = time.perf_counter()
  out = limited(["a", "sleep", "bb"], None, lengths=[1, 2, 3])
  assert time.perf_counter() - start < 30  # the limit, a worker restart, not SLOW_S
  np.testing.assert_array_equal(out, [2.0, 0.0, 4.0])
  assert limited.last_timeouts == 1 and limited.last_timed_out.tolist() == [False, True, False]
  assert time_limit.timeouts(limited) == 1
  np.testing.assert_array_equal(limited(["c"], None), [1.0])  # the next call works
  assert limited.last_timeouts == 0


def test_a_timed_out_row_is_zero_in_the_total_and_every_component():
  combined = rewards.combine({"slow": (sleepy_reward, 1.0), "short": ("short_reply", 0.5)})
  limited = time_limit.TimeLimited(combined, seconds=1.0)
  total, parts = limited(["ok", "sleep"], None)
  np.testing.assert_array_equal(total, [1.5, 0.0])
  assert set(parts) == {"slow", "short"}
  np.testing.assert_array_equal(parts["slow"], [1.0, 0.0])
  np.testing.assert_array_equal(parts["short"], [1.0, 0.0])
  total, parts = limited(["sleep"], None)  # every row timed out: the names are still known
  assert total.tolist() == [0.0] and set(parts) == {"slow", "short"}
  assert limited.last_timeouts == 1


def test_an_error_in_the_reward_propagates_with_its_type_and_message():
  limited = time_limit.TimeLimited(rewards.from_config({"math_strict": 1.0}), seconds=30.0)
  with pytest.raises(ValueError, match="'answer' is not a number") as info:
    limited(["1", "2"], [{"answer": "12"}, {"answer": "x"}])
  assert any("completion 1" in note for note in info.value.__notes__)
  with pytest.raises(KeyError, match="no field for 'z'"):
    time_limit.TimeLimited(failing_reward, seconds=30.0)(["z"])
  with pytest.raises(ValueError, match="got 1 completions but 2 examples"):
    limited(["1"], [{"answer": "1"}] * 2)


_SPEC = {"math_strict": 1.0, "short_reply": {"weight": 0.2, "max_chars": 10},
         "length_penalty": {"budget": 3}}
# Built once: every hypothesis example then reuses the worker that loaded them.
_LIMITED_SUM = time_limit.TimeLimited(rewards.from_config(_SPEC), seconds=30.0)
_LIMITED_LENIENT = time_limit.TimeLimited(rewards.math_lenient_reward, seconds=30.0)


@_SETTINGS
@given(st.lists(st.one_of(_fragment, st.text(max_size=30)), min_size=1, max_size=6))
def test_limited_rewards_equal_the_rewards_on_ordinary_replies(replies):
  lengths = np.arange(len(replies)) * 2
  examples = [{"answer": str(i)} for i in range(len(replies))]
  want_total, want_parts = rewards.from_config(_SPEC)(replies, examples, lengths=lengths)
  total, parts = _LIMITED_SUM(replies, examples, lengths=lengths)
  np.testing.assert_array_equal(total, want_total)
  assert parts.keys() == want_parts.keys()
  for name in parts:
    np.testing.assert_array_equal(parts[name], want_parts[name])
  np.testing.assert_array_equal(_LIMITED_LENIENT(replies, examples),
                                rewards.math_lenient_reward(replies, examples))



def test_one_worker_serves_every_limited_reward():
  a = time_limit.TimeLimited(rewards.math_strict_reward, seconds=30.0)
  b = time_limit.TimeLimited(rewards.format_boxed_reward, seconds=30.0)
  a(["1"], [{"answer": "1"}])
  pid = time_limit._worker.process.pid
  b(["1"], None)
  assert time_limit._worker.process.pid == pid


def test_an_unpicklable_reward_runs_in_process_with_one_warning(caplog):
  with caplog.at_level(logging.WARNING, logger="jaxrl_agents.rewards.time_limit"):
    limited = time_limit.TimeLimited(lambda c, e=None: np.full(len(c), 0.5, np.float32), 1.0)
    for _ in range(3):
      assert limited(["a", "b"]).tolist() == [0.5, 0.5] and limited.last_timeouts == 0
  warnings = [r.getMessage() for r in caplog.records if "NO time limit" in r.getMessage()]
  assert len(warnings) == 1 and "<lambda>" in warnings[0], warnings


def test_a_dead_worker_is_an_error_and_the_next_call_restarts_it():
  with pytest.raises(RuntimeError, match=r"worker died \(exit code 3\)"):
    time_limit.TimeLimited(dying_reward, seconds=30.0)(["x"])
  assert time_limit.TimeLimited(half_reward, seconds=30.0)(["x"]).tolist() == [0.5]


def test_a_reward_the_worker_cannot_import_runs_in_process(monkeypatch, caplog):
  # Pickles here (by reference to a module of this process only), fails to load there.
  module = types.ModuleType("reward_module_of_this_process_only")
  module.half_reward = half_reward
  monkeypatch.setitem(sys.modules, module.__name__, module)
  monkeypatch.setattr(half_reward, "__module__", module.__name__)
  with caplog.at_level(logging.WARNING, logger="jaxrl_agents.rewards.time_limit"):
    limited = time_limit.TimeLimited(half_reward, seconds=30.0)
    assert limited(["a", "b"]).tolist() == [0.5, 0.5]
    assert limited(["a"]).tolist() == [0.5]
  warnings = [r.getMessage() for r in caplog.records if "NO time limit" in r.getMessage()]
  assert len(warnings) == 1 and "cannot load it" in warnings[0], warnings


def test_bad_limits_are_refused():
  for seconds in (0, -1.0, math.inf, True, "10"):
    with pytest.raises(ValueError, match="time limit"):
      time_limit.TimeLimited(rewards.math_strict_reward, seconds)


def test_the_experiments_limit_their_rewards_by_config():
  from experiments import common
  from experiments.configs import grpo_arithmetic

  config = grpo_arithmetic.get_config("tiny")
  assert config.reward_time_limit_s == 10.0
  reward_fn, grader = common.make_rewards(config)
  assert isinstance(reward_fn, time_limit.TimeLimited) and reward_fn.seconds == 10.0
  replies, examples = ["12", "The answer is 3"], [{"answer": "12"}, {"answer": "3"}]
  np.testing.assert_allclose(reward_fn(replies, examples)[0], [1.2, 1.0], rtol=1e-6)
  assert grader(["12"], [{"answer": "12"}]).tolist() == [1.0]
  config.reward_time_limit_s = 0.0
  assert not isinstance(common.make_rewards(config)[0], time_limit.TimeLimited)
  config.reward_time_limit_s = -1.0
  with pytest.raises(ValueError, match="reward_time_limit_s"):
    common.make_rewards(config)


def none_reward(completions, examples=None):
  return None


def test_an_interrupt_while_scoring_does_not_shift_later_rewards():
  """Ctrl-C between a request and its reply (a notebook cell stopped): the late reply must
  not answer the next request."""
  import signal
  import threading

  limited = time_limit.TimeLimited(sleepy_reward, seconds=30.0)
  limited(["warm"], None, lengths=[5])  # the worker is up and has the reward
  timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
  timer.start()
  with pytest.raises(KeyboardInterrupt):
    limited(["sleep"], None)
  timer.join()
  np.testing.assert_array_equal(limited(["a", "bb", "ccc"], None, lengths=[1, 2, 3]),
                                [2.0, 3.0, 4.0])
  np.testing.assert_array_equal(limited(["d"], None, lengths=[9]), [10.0])


def test_a_ctrl_c_the_kernel_hands_to_another_thread_still_stops_the_wait():
  """A process-directed SIGINT may be delivered to any thread (XLA's pools, a host loop's):
  the trainer's wait for a reward must act on it soon, not at the reward's time limit."""
  import signal
  import threading

  limited = time_limit.TimeLimited(sleepy_reward, seconds=30.0)
  limited(["warm"], None)
  idle = threading.Event()
  other = threading.Thread(target=idle.wait, daemon=True)
  other.start()
  timer = threading.Timer(0.5, lambda: signal.pthread_kill(other.ident, signal.SIGINT))
  timer.start()
  start = time.monotonic()
  with pytest.raises(KeyboardInterrupt):
    limited(["sleep"], None)
  assert time.monotonic() - start < 10.0  # the reward's limit is 30 s
  idle.set()
  timer.join()
  np.testing.assert_array_equal(limited(["a"], None, lengths=[1]), [2.0])


def test_a_reward_returning_none_is_an_error_not_a_reason_to_drop_the_limit():
  with pytest.raises((TypeError, ValueError)):
    time_limit.TimeLimited(none_reward, seconds=30.0)(["x"])


def test_the_worker_dies_with_the_trainer(tmp_path):
  """kill -9 of the process that started the worker takes a stuck worker with it."""
  import subprocess
  import sys
  import textwrap

  code = textwrap.dedent("""
      import os, sys, threading, time
      sys.path.insert(0, sys.argv[1])
      from jaxrl_agents.rewards import time_limit
      import test_reward_properties as t
      limited = time_limit.TimeLimited(t.sleepy_reward, seconds=600.0)
      limited(["warm"], None)
      print(time_limit._worker.process.pid, flush=True)
      limited(["sleep"], None)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__)],
                          stdout=subprocess.PIPE, text=True)
  worker_pid = int(proc.stdout.readline())
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 20
  while time.monotonic() < deadline:
    try:
      os.kill(worker_pid, 0)
    except ProcessLookupError:
      return
    with open(f"/proc/{worker_pid}/stat") as f:
      if f.read().split()[2] == "Z":  # a zombie: dead, waiting to be reaped by init
        return
    time.sleep(0.2)
  os.kill(worker_pid, 9)
  raise AssertionError("the reward worker outlived its trainer")
