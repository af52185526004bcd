"""Groups of a GRPO batch: which groups carry signal, oversampling's selection, DAPO's
dynamic sampling (more prompts sampled while too few groups' rewards vary), and the
rows left out of an update's policy tokens (tied groups, rows without advantage).

A group is one prompt's `group_size` rows (rows are group-major). A group whose rewards
all tie gets zero group-relative advantage: it adds compute and dilutes a token mean, but
no signal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import types
from jaxrl_agents.objectives.losses import aggregation as aggregation_lib
from jaxrl_agents.parallel import distributed
from jaxrl_agents.rollout import single_turn
from jaxrl_agents.types import Collect, Rollout


def tied_groups(rewards: np.ndarray) -> np.ndarray:
  """bool[P]: the groups (rows of `rewards` f32[P, G]) whose rewards are all equal.

  Max == min, not std == 0: numpy's float32 std of seven rewards of 0.2 is 1.5e-8.
  The rule of `advantages.no_spread`, which gives such a group exactly 0 advantage
  (infinite rewards are not a tie there either).
  """
  rewards = np.asarray(rewards)
  hi = rewards.max(axis=1)
  return (hi == rewards.min(axis=1)) & np.isfinite(hi)


def kept_groups(rewards: np.ndarray, keep: int) -> np.ndarray:
  """Indices of the `keep` groups the update trains on, out of the sampled ones.

  A group whose rewards all tie has zero group-relative advantage and adds
  nothing but compute (and dilution of a token mean) to the update. With
  `oversample` > 1 a step samples more groups than it trains on and keeps
  those with reward variance, in sampling order (the loader's order is already
  random), topping up with tied groups when too few vary, so the update's
  shape never changes: DAPO's dynamic sampling with a fixed batch instead of
  resampling until full (which `resample_until_varied` adds).

  Args:
    rewards: f32[groups, G] total rewards.
    keep: groups to keep (<= groups).
  """
  groups = rewards.shape[0]
  if keep > groups:
    raise ValueError(f"cannot keep {keep} groups of {groups} sampled")
  if keep == groups:
    return np.arange(groups)
  tied = tied_groups(rewards)
  return np.sort(np.argsort(tied, kind="stable")[:keep])


def group_rows(groups: np.ndarray, group_size: int) -> np.ndarray:
  """The row indices of groups int[n] (rows are group-major: group i holds rows
  i * group_size ... i * group_size + group_size - 1), in the groups' order."""
  return (np.asarray(groups)[:, None] * group_size + np.arange(group_size)).reshape(-1)


def varied_first(rounds: Sequence[Rollout], group_size: int, max_new_tokens: int) -> Rollout:
  """The groups `kept_groups` keeps of several rounds' together, as many as one round has
  (`resample_until_varied`): every group whose rewards vary, topped up with tied ones
  (always the first round's), in sampling order.

  The reply columns are trimmed to what the kept rows need, bucketed as a rollout trims
  them (`single_turn.trimmed_width`), so a long reply in a group left out does not widen
  the update; prompts are left-padded to the widest round's. Single-turn rollouts only.
  """
  first = rounds[0]
  if any(r.turn_keys is not None or r.roles is not None for r in rounds):
    raise ValueError("varied_first takes single-turn rollouts (no turn keys, no roles)")
  rewards = np.concatenate([r.rewards for r in rounds]).reshape(-1, group_size)
  kept = kept_groups(rewards, first.rewards.size // group_size)
  rows = group_rows(kept, group_size)
  pick = lambda values: [values[k] for k in rows]  # noqa: E731
  cat = lambda name: np.concatenate([getattr(r, name) for r in rounds])[rows]  # noqa: E731
  traj = jax.tree.map(lambda x: x[rows], types.concatenate_rows([r.traj for r in rounds]))
  lengths = distributed.to_host(traj.policy_mask).sum(-1)
  traj = types.with_reply_columns(traj, single_turn.trimmed_width(lengths, max_new_tokens))
  details = (None if any(r.details is None for r in rounds)
             else pick([d for r in rounds for d in r.details]))
  return Rollout(
      traj=traj, examples=pick([e for r in rounds for e in r.examples]),
      prompts=pick([p for r in rounds for p in r.prompts]),
      completions=pick([c for r in rounds for c in r.completions]),
      rewards=cat("rewards"), correct=cat("correct"),
      components={k: np.concatenate([r.components[k] for r in rounds])[rows]
                  for k in first.components},
      prompts_truncated=sum(r.prompts_truncated for r in rounds), details=details)


def resample_until_varied(collect: Collect, params, next_examples: Callable[[], Any],
                          rng: jax.Array, first: Rollout, extra: Mapping[str, float], *,
                          need: int, max_rounds: int, group_size: int, max_new_tokens: int
                          ) -> tuple[Rollout, dict[str, float]]:
  """DAPO's dynamic sampling: while fewer than `need` groups of what was sampled have reward
  variance, sample another batch of prompts (`next_examples()`), at most `max_rounds`
  more; then `varied_first` of all rounds.

  A group whose rewards tie gets zero group-relative advantage: once most groups tie
  (a policy sure of its answers), a fixed batch trains on a few groups and dilutes them
  with the rest. Each extra round has the first one's shapes (no new compilation); its
  key is `rng` folded with the round. The record gets `resample_rounds` (the extra rounds
  sampled) and `varied_groups_sampled`; the other extra scalars are summed over rounds.
  """
  rounds, extra = [first], dict(extra)
  varied = lambda r: int((~tied_groups(r.rewards.reshape(-1, group_size))).sum())  # noqa: E731
  count = varied(first)
  while count < need and len(rounds) <= max_rounds:
    more, more_extra = collect(params, next_examples(), jax.random.fold_in(rng, len(rounds)))
    rounds.append(more)
    count += varied(more)
    for k, v in more_extra.items():
      extra[k] = extra.get(k, 0) + v
  extra.update(resample_rounds=len(rounds) - 1, varied_groups_sampled=count)
  if len(rounds) == 1:
    return first, extra
  return varied_first(rounds, group_size, max_new_tokens), extra


def without_tied_groups(traj: types.Trajectory, rewards: np.ndarray, group_size: int
                        ) -> types.Trajectory:
  """`traj` with no policy tokens in the groups whose rewards tie.

  Ties are read from the rewards (`tied_groups`, the rule `kept_groups`
  and the estimators use: all rewards equal). Such a group adds no policy
  gradient (its advantages are exactly 0), but its
  tokens count in a token mean's denominator: with 1 group of 4 that varies,
  the update moves the policy a quarter as far as with 4, so the step size
  falls just when the signal is scarce. Masked out, those rows also cost a
  packed update nothing. DAPO's dynamic sampling trains on varied groups only
  in the same way (it resamples to fill the batch; here the batch's shape stays
  fixed and the tied rows are masked). The rows stay in the batch, so shapes do
  not change; the loss's terms that read the mask (KL, entropy bonus, the
  entropy logged) then cover the varied groups only.

  Args:
    traj: B = groups x `group_size` rows.
    rewards: f32[groups, group_size] the groups' total rewards.
  """
  if rewards.shape != (traj.tokens.shape[0] // group_size, group_size):
    raise ValueError(f"rewards {rewards.shape} are not one row of {group_size} per group of "
                     f"the {traj.tokens.shape[0]} trajectory rows")
  varied = np.repeat(~tied_groups(rewards), group_size)
  return traj.replace(policy_mask=traj.policy_mask & jnp.asarray(varied)[:, None])


def without_zero_advantage_rows(traj: types.Trajectory, advantages: jax.Array,
                               aggregation: str) -> tuple[types.Trajectory, jax.Array]:
  """`traj` without policy tokens in the rows whose advantages are all 0, and the f32[]
  factor that makes the loss over the rest the loss over all rows.

  Such a row adds nothing to the policy gradient (every registered policy loss
  multiplies by the advantage) where the objective has no KL, no entropy bonus
  and no token control that ranks tokens across rows (`validate` checks), but
  it counts in the aggregation's denominator. Left out, a packed update does
  not pay for its tokens; scaled by `skipped_loss_scale`, the gradient is the
  one of training on it (to float rounding). Unlike `without_tied_groups`, the
  step size does not change. The logged token statistics (entropy, clip
  fraction) then cover the rows that were computed.

  Args:
    traj: B rows.
    advantages: f32[B] or f32[B, T] (turn-level credit).
    aggregation: the objective's aggregation mode.
  """
  mask = distributed.to_host(traj.policy_mask)  # (a multi-host run's is global)
  adv = distributed.to_host(advantages)
  if adv.ndim == 1:
    adv = adv[:, None]
  # NaN != 0: a row with a non-finite advantage stays, for the run's checks to see.
  signal = np.any((adv != 0) & mask, axis=1)
  scale = skipped_loss_scale(mask, mask & signal[:, None], aggregation)
  return (traj.replace(policy_mask=traj.policy_mask & jnp.asarray(signal)[:, None]),
          jnp.float32(scale))


def skipped_loss_scale(full: np.ndarray, kept: np.ndarray, aggregation: str) -> float:
  """The factor from the `aggregation` of a loss over the tokens of mask `kept` to its
  aggregation over those of `full`, where the loss is 0 on the tokens only `full` holds:
  the ratio of the two denominators (`aggregation.denominator`; 1 for
  "seq-mean-token-sum-norm", whose constant does not depend on the mask)."""
  return float(aggregation_lib.denominator(kept, aggregation)
               / aggregation_lib.denominator(full, aggregation))


def check_resample_rounds(rounds, *, env: str, overlap: bool, group_size: int) -> None:
  """Refuses a `resample_rounds` (DAPO's dynamic sampling, `resample_until_varied`) that is
  not an int >= 0, or that the run cannot serve."""
  if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
    raise ValueError(f"resample_rounds {rounds!r} must be an int >= 0: how many more batches "
                     "of prompts a step may sample while too few groups vary (0: off)")
  if not rounds:
    return
  if env:
    raise ValueError("resample_rounds samples more prompts from a dataset; an environment run "
                     "draws its tasks each step: set resample_rounds=0")
  if overlap:
    raise ValueError("resample_rounds is not supported with config.overlap (the next rollout "
                     "is sampled during the update): set one of them off")
  if group_size < 2:
    raise ValueError(f"resample_rounds looks for groups whose rewards vary; group_size "
                     f"{group_size} has none: use group_size >= 2")
