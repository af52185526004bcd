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

With N = 1 both return candidate 0, i.e. plain sampling. `selection_accuracy`
scores both, and the plain majority vote, against the grader's verdicts.
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


def selection_accuracy(rewards, correct, *, greedy_correct=None,
                       answers: Sequence[Sequence[Hashable | None]] | None = None,
                       vote_temperature: float = 1.0) -> dict[str, float]:
  """How often each way of choosing among N replies picks a right one.

  Args:
    rewards: f32[P, N] the choosing reward of each reply.
    correct: {0, 1}[P, N] the grader's verdict on each reply.
    greedy_correct: optional {0, 1}[P], the verdict on each question's greedy reply.
    answers: optional [P][N] final answers (None: states none), for the votes.
    vote_temperature: the reward-weighted vote's softmax temperature.

  Returns:
    best_of_N_accuracy, sample_accuracy (a random reply), pass_at_N (an oracle's
    pick), num_questions; greedy_accuracy with `greedy_correct`; with `answers`,
    weighted_vote_N_accuracy and majority_vote_N_accuracy (equal weights).
  """
  correct = np.asarray(correct, np.float32)
  rewards = _check_rewards(rewards)
  if correct.shape != rewards.shape:
    raise ValueError(f"correct {correct.shape} does not match rewards {rewards.shape}")
  p, n = correct.shape
  rows = np.arange(p)
  out = {f"best_of_{n}_accuracy": float(correct[rows, best_of_n(rewards)].mean()),
         "sample_accuracy": float(correct.mean()),
         f"pass_at_{n}": float(correct.max(axis=1).mean()),
         "num_questions": p}
  if greedy_correct is not None:
    out["greedy_accuracy"] = float(np.mean(greedy_correct))
  if answers is not None:
    votes = weighted_vote(rewards, answers, temperature=vote_temperature)
    majority = weighted_vote(np.zeros_like(rewards), answers)
    out[f"weighted_vote_{n}_accuracy"] = float(correct[rows, votes].mean())
    out[f"majority_vote_{n}_accuracy"] = float(correct[rows, majority].mean())
  return out
