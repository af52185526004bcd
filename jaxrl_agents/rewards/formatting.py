r"""Format rewards: does the reply have the requested shape, whatever its correctness.

Small weights on these next to a correctness reward teach a model the answer
format early, when correct answers are still too rare to give a signal.
Options are keyword-only so that `functools.partial(short_reply_reward,
max_chars=20)` (or {"short_reply": {"weight": 0.2, "max_chars": 20}} in
`from_config`) configures them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.rewards._checks import as_rewards, check_batch
from jaxrl_agents.rewards.answers import count_boxed, extract_boxed, reply_as_number


@registry.register("reward", "format_boxed")
def format_boxed_reward(completions: Sequence[str],
                        examples: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
  r"""1 if the reply holds exactly one \boxed{...}, and it is closed.

  Two boxes (nested or not) score 0, as does a truncated "\boxed{4".

  Args:
    completions: B decoded replies.
    examples: B examples (unused; checked for length when given).

  Returns:
    f32[B] in {0, 1}.
  """
  check_batch("format_boxed", completions, examples)
  return as_rewards([float(count_boxed(c) == 1 and extract_boxed(c) is not None)
                     for c in completions])


@registry.register("reward", "format_answer_only")
def format_answer_only_reward(completions: Sequence[str],
                              examples: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
  """1 if the reply is just a number, up to surrounding whitespace and one trailing period.

  "42", " -5.\\n", "1,234" and "3.0" pass; "$42", "42 apples" and "x = 42" do not.
  Number syntax is that of `jaxrl_agents.rewards.answers`.

  Args:
    completions: B decoded replies.
    examples: B examples (unused; checked for length when given).

  Returns:
    f32[B] in {0, 1}.
  """
  check_batch("format_answer_only", completions, examples)
  return as_rewards([float(reply_as_number(c) is not None) for c in completions])


@registry.register("reward", "short_reply")
def short_reply_reward(completions: Sequence[str],
                       examples: Sequence[Mapping[str, Any]] | None = None, *,
                       max_chars: int = 40) -> np.ndarray:
  """1 if len(reply) < max_chars, counting every character (whitespace included).

  Args:
    completions: B decoded replies.
    examples: B examples (unused; checked for length when given).
    max_chars: replies of this many characters or more score 0.

  Returns:
    f32[B] in {0, 1}.
  """
  check_batch("short_reply", completions, examples)
  if max_chars < 1:
    raise ValueError(f"short_reply: max_chars must be >= 1, got {max_chars}")
  return as_rewards([float(len(c) < max_chars) for c in completions])
