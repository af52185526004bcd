"""Length penalty: a linear cost on whatever a reply spends beyond a budget.

    r_i = -coef * max(0, L_i - budget) / budget

L_i is the reply's length in characters by default, or any per-reply length
passed as `lengths` (token counts, e.g. `mask.sum(-1)` of the sampled tokens;
the combinators of `jaxrl_agents.rewards.combine` forward a `lengths=` keyword
to the components that accept it). Replies within budget are not touched, so
the penalty never prefers one correct short answer over another; dividing by
the budget makes `coef` the penalty per budget's worth of excess, whatever the
unit. The penalty is unbounded unless `max_penalty` caps it, unlike DAPO's
"soft overlong punishment" (0 up to a buffer before the limit, then a linear
ramp to -1 at the limit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.rewards._checks import as_rewards, check_batch


@registry.register("reward", "length_penalty")
def length_penalty_reward(
    completions: Sequence[str],
    examples: Sequence[Mapping[str, Any]] | None = None,
    *,
    budget: int = 512,
    coef: float = 1.0,
    max_penalty: float | None = None,
    lengths: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
  """-coef * max(0, L - budget) / budget per reply, optionally capped at -max_penalty.

  Args:
    completions: B decoded replies.
    examples: B examples (unused; checked for length when given).
    budget: free length (characters, or the unit of `lengths`); > 0.
    coef: penalty per `budget` of excess length; >= 0.
    max_penalty: if set, the penalty is at most this (the reward at least -max_penalty).
    lengths: optional int[B] lengths to use instead of character counts.

  Returns:
    f32[B] <= 0.
  """
  check_batch("length_penalty", completions, examples)
  if budget <= 0:
    raise ValueError(f"length_penalty: budget must be > 0, got {budget}")
  if coef < 0:
    raise ValueError(f"length_penalty: coef must be >= 0, got {coef}")
  if max_penalty is not None and max_penalty < 0:
    raise ValueError(f"length_penalty: max_penalty must be >= 0, got {max_penalty}")
  if lengths is None:
    size = np.array([len(c) for c in completions], dtype=np.float64)
  else:
    size = np.asarray(lengths, dtype=np.float64)
    if size.shape != (len(completions),):
      raise ValueError(f"length_penalty: lengths has shape {size.shape} but there are "
                       f"{len(completions)} completions")
    if (size < 0).any():
      raise ValueError("length_penalty: lengths must be >= 0")
  penalty = coef * np.maximum(size - budget, 0.0) / budget
  if max_penalty is not None:
    penalty = np.minimum(penalty, max_penalty)
  return as_rewards(0.0 - penalty)  # 0.0 - x, not -x: no -0.0 in logs
