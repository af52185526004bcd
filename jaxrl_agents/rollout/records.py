"""What a train step logs of its rollout: the metrics.jsonl record (`step_record`: rewards,
accuracy, lengths, the update's metrics, times and token rates), the samples.jsonl rows
(`rollout_samples`), and a warning when the run has no learning signal (`NoSignalWatch`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from jaxrl_agents.parallel import distributed
from jaxrl_agents.rollout import groups
from jaxrl_agents.train import metrics as metrics_lib
from jaxrl_agents.types import Rollout

log = logging.getLogger(__name__)


def rollout_metrics(r: Rollout, group_size: int, max_new_tokens: int) -> dict[str, float]:
  """Reward, accuracy and length statistics of a rollout batch."""
  lengths = distributed.to_host(r.traj.policy_mask).sum(-1)
  out = {
      "reward_mean": float(r.rewards.mean()),
      "reward_std": float(r.rewards.std()),
      "accuracy": float(r.correct.mean()),
      "response_length": float(lengths.mean()),
      "response_length_max": float(lengths.max()),
      # Hit the token budget (a completion may end exactly there with its stop
      # token, but the sampler counts that token in its length only when live).
      "truncated_frac": float((lengths >= max_new_tokens).mean()),
      "prompts_truncated": r.prompts_truncated,
  }
  if group_size > 1 and r.roles is None:  # (self-play's rows are sides, not groups)
    # Groups whose rewards all tie give zero group-relative advantage: no signal.
    grouped = r.rewards.reshape(-1, group_size)
    out["zero_variance_groups"] = float(groups.tied_groups(grouped).mean())
  for name, values in r.components.items():
    out[f"reward/{name}_mean"] = float(values.mean())
    out[f"reward/{name}_std"] = float(values.std())
  return out


class NoSignalWatch:
  """Warns in the log when `metrics.NO_SIGNAL_STEPS` train records in a row had no learning
  signal (`metrics.has_no_signal`): a run whose reward never varies within a group trains
  nothing, and says so instead of running on silently. Once per streak."""

  def __init__(self):
    self.streak = 0

  def __call__(self, record: Mapping[str, Any]) -> Mapping[str, Any]:
    self.streak = self.streak + 1 if metrics_lib.has_no_signal(record) else 0
    if self.streak == metrics_lib.NO_SIGNAL_STEPS:
      log.warning("no learning signal for %d steps in a row (every group's rewards tied, or a "
                  "zero gradient): nothing is being learned; check that the reward varies "
                  "within a group (the reward, the grader, the task's difficulty)", self.streak)
    return record


# What the progress bar shows, and what stops a run when it is not finite (`harness.run`'s
# postfix and finite_keys), and the eval record keys its log line shows (eval_log).
LOGGED = dict(postfix=("reward_mean", "accuracy"), finite_keys=("reward_mean",),
              eval_log=("accuracy", "reward_mean"))


def step_record(r: Rollout, extra: Mapping[str, float], update_metrics: Mapping[str, Any], *,
                group_size: int, policy_token_budget: int, epochs: int, skipped_updates: int,
                rollout_s: float, update_s: float, wait_s: float | None = None
                ) -> dict[str, float]:
  """A train step's metrics.jsonl record: the rollout's rewards, accuracy and lengths
  (`rollout_metrics`), the collector's `extra` scalars, the update's metrics, the skipped
  (non-finite) updates so far, and the step's times and token rates (`wait_s`: an
  overlapped step's wait for its rollout)."""
  generated = int(distributed.to_host(r.traj.policy_mask).sum())
  attended = int(distributed.to_host(r.traj.valid).sum())
  record = {
      **rollout_metrics(r, group_size, policy_token_budget),
      **extra,
      **{k: float(v) for k, v in update_metrics.items()},
      "skipped_updates": skipped_updates,
      "rollout_time_s": rollout_s, "update_time_s": update_s,
      "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
      "update_tokens_per_s": attended * epochs / max(update_s, 1e-9),
  }
  if wait_s is not None:  # the rollout ran during the previous update: the step waited this long
    record["rollout_wait_s"] = wait_s
  return record


def rollout_samples(r: Rollout) -> list[dict]:
  """One samples.jsonl row per episode: prompt, completion, answer, rewards, verdict (and
  the rollout's `details`)."""
  rows = [{"prompt": p, "completion": c, "answer": ex.get("answer"), "reward": float(rw),
           "correct": float(k), **{f"reward/{n}": float(v[i]) for n, v in r.components.items()}}
          for i, (p, ex, c, rw, k) in enumerate(zip(r.prompts, r.examples, r.completions,
                                                    r.rewards, r.correct, strict=True))]
  if r.details is not None:
    rows = [{**row, **extra} for row, extra in zip(rows, r.details, strict=True)]
  return rows
