"""Choosing one of N sampled responses per prompt with a reward: best-of-N and weighted voting.

Both take the rewards of N candidates per prompt, f32[P, N], from any reward
(a verifier's, a learned reward model's), and return the index of the chosen
candidate per prompt:

  best_of_n        the highest reward (ties: the first).
  weighted_vote    candidates are grouped by their final answer; each answer's
                   weight is the sum of softmax(rewards / temperature) over its
                   candidates; the heaviest answer wins, represented by its
                   best-rewarded candidate. Candidates without an answer do not
                   vote; a prompt where none has one falls back to best-of-N.
                   With equal rewards this is plain majority voting
                   (self-consistency).

With N = 1 both return candidate 0, i.e. plain sampling.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def _check_rewards(rewards) -> np.ndarray:
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 2 or rewards.shape[1] < 1:
    raise ValueError(f"rewards must be [prompts, N >= 1], got shape {rewards.shape}")
  if not np.isfinite(rewards).all():
    raise ValueError("rewards must be finite")
  return rewards


def best_of_n(rewards) -> np.ndarray:
  """int[P]: each prompt's highest-reward candidate."""
  return np.argmax(_check_rewards(rewards), axis=1)


def weighted_vote(rewards, answers: Sequence[Sequence[Hashable | None]],
                  temperature: float = 1.0) -> np.ndarray:
  """int[P]: a candidate of each prompt's answer with the most softmax(rewards / temperature)
  weight (see the module docstring); `answers[p][n]` is None where candidate n states none."""
  rewards = _check_rewards(rewards)
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  if len(answers) != rewards.shape[0] or any(len(a) != rewards.shape[1] for a in answers):
    raise ValueError(f"answers must be [prompts][N] like rewards {rewards.shape}")
  chosen = best_of_n(rewards)
  for p, row in enumerate(rewards):
    weights = np.exp((row - row.max()) / temperature)
    totals: dict[Hashable, float] = {}
    for n, answer in enumerate(answers[p]):
      if answer is not None:
        totals[answer] = totals.get(answer, 0.0) + weights[n]
    if not totals:
      continue
    winner = max(totals, key=totals.get)  # first-seen answer wins a tie
    members = [n for n, answer in enumerate(answers[p]) if answer == winner]
    chosen[p] = members[int(np.argmax(row[members]))]
  return chosen
