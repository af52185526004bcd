"""What an evaluation reports from sampled replies: pass@k, maj@k, mean@k, intervals.

Per example, from n sampled replies of which c are correct:

  pass@k = 1 - C(n - c, k) / C(n, k)      the unbiased estimator of "at least one of k
                                           samples is correct" (Chen et al. 2021, HumanEval),
                                           for any n >= k
  mean@k                                   the mean score of the replies (partial credit kept)
  maj@k                                    the verdict of the most common answer among k
                                           replies (ties: the answer seen first; replies
                                           without an answer do not vote)

A benchmark's figure is the mean over examples; `bootstrap_interval` resamples the
examples for its confidence interval, and `standard_error` is the plain one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """1 - C(n - c, k) / C(n, k), as a product (no large binomials)."""
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= correct <= samples, got correct={c}, samples={n}")
  if not 1 <= k <= n:
    raise ValueError(f"pass@k needs 1 <= k <= samples, got k={k}, samples={n}")
  if n - c < k:
    return 1.0
  # C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_verdict(answers: Sequence[Hashable | None], verdicts: Sequence[float]) -> float:
  """The verdict of the most common non-None answer (first seen wins a tie); 0 if none."""
  if len(answers) != len(verdicts):
    raise ValueError(f"{len(answers)} answers for {len(verdicts)} verdicts")
  counts = Counter(a for a in answers if a is not None)
  if not counts:
    return 0.0
  top = max(counts.values())
  winner = next(a for a in answers if a is not None and counts[a] == top)
  return float(verdicts[list(answers).index(winner)])


def standard_error(values: Sequence[float]) -> float:
  """The standard error of the mean of per-example values."""
  values = np.asarray(values, np.float64)
  if len(values) < 2:
    return float("nan")
  return float(values.std(ddof=1) / np.sqrt(len(values)))


def bootstrap_interval(values: Sequence[float], *, level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
  """The percentile bootstrap interval of the mean of per-example values."""
  values = np.asarray(values, np.float64)
  if not len(values):
    return float("nan"), float("nan")
  if not 0 < level < 1:
    raise ValueError(f"level must be in (0, 1), got {level}")
  rng = np.random.default_rng(seed)
  means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
  tail = (1 - level) / 2
  low, high = np.quantile(means, [tail, 1 - tail])
  return float(low), float(high)
