"""Pieces of an RL trainer's step, for the experiments that own it (experiments/grpo.py,
experiments/ppo.py): the single-turn collector (prompts -> rewarded replies, a `Rollout`),
group selection and DAPO's dynamic sampling (`kept_groups`, `resample_until_varied`),
greedy evaluation, and the step's record and samples.

A train step, as the experiments write it:

  examples = next(data)
  r, extra = collect(params, examples, rollout_rng)       # single_turn_collector, env_loop
  r, extra = resample_until_varied(...)                   # optional: more prompts
  batch = prepare(state, r)                               # the experiment's: advantages, ...
  state, metrics = update(state, batch)                   # the experiment's jitted update
  record = step_record(r, extra, metrics, ...)            # -> harness.StepResult

Randomness derives from (seed, step) alone, so a run resumed from a checkpoint
continues exactly as if it had never stopped (bitwise on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import credit, distributed, types
from jaxrl_agents import metrics as metrics_lib
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rewards import time_limit
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import shapes, single_turn

log = logging.getLogger(__name__)




# ----------------------------------------------------------------------------
# Rollouts.


@dataclasses.dataclass
class Rollout:
  """One batch of sampled episodes with their rewards (host and device arrays).

  Attributes:
    traj: the Trajectory (device arrays), B = P * G rows, prompt-major, its
      outcome rewards set.
    examples: the B task examples (each prompt's repeated G times).
    prompts: the B prompt strings.
    completions: the B decoded completions.
    rewards: f32[B] total reward.
    components: per-component f32[B] rewards.
    correct: f32[B] the grader's verdict (accuracy).
    prompts_truncated: prompts shortened to fit the context (config.prompt_overflow).
    details: optional per-episode fields for samples.jsonl (a multi-turn episode's
      turns, token ids and masks).
    turn_keys: optional int32[B, K], the environment state each turn was taken
      from (-1: none), for turn-level credit.
    roles: optional int32[B], self-play: the player each row played (-1: nothing
      to credit), for role-conditioned advantages.
  """

  traj: types.Trajectory
  examples: list[Mapping[str, Any]]
  prompts: list[str]
  completions: list[str]
  rewards: np.ndarray
  components: dict[str, np.ndarray]
  correct: np.ndarray
  prompts_truncated: int = 0
  details: list[dict] | None = None
  turn_keys: np.ndarray | None = None
  roles: np.ndarray | None = None


class RewardFn(Protocol):
  """Rewards of decoded completions: (total f32[B], {component name: f32[B]})."""

  def __call__(self, completions: Sequence[str], examples: Sequence[Mapping]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


def rollout(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], rng: jax.Array, *,
            group_size: int, sampling: sampler_lib.SamplingConfig, template: str, chat: bool,
            system: str | None, reward_fn: RewardFn,
            grader: Callable[[Sequence[str], Sequence[Mapping]], np.ndarray],
            overflow: str = "error") -> Rollout:
  """`single_turn.sample`, then the rewards and the grader's verdicts of the completions."""
  s = single_turn.sample(params, model, examples, rng, group_size=group_size, sampling=sampling,
                         template=template, chat=chat, system=system, overflow=overflow)
  total, components = reward_fn(s.completions, s.examples)
  total = np.asarray(total, np.float32)
  return Rollout(traj=types.with_outcome(s.traj, total), examples=s.examples, prompts=s.prompts,
                 completions=s.completions, rewards=total,
                 components={k: np.asarray(v, np.float32) for k, v in components.items()},
                 correct=np.asarray(grader(s.completions, s.examples), np.float32),
                 prompts_truncated=int(s.prompts_truncated.sum()))


def par_shaped(r: Rollout, reference_rewards: np.ndarray, group_size: int) -> Rollout:
  """The rollout with PAR-shaped rewards: mean_m sigmoid(r - r_ref_m) over M reference replies.

  "Reward Shaping to Mitigate Reward Hacking in RLHF" (Preference As Reward,
  `credit.par_sigmoid_shaping`): the RL reward is the win probability against
  replies of the reference policy to the same prompt, bounded in (0, 1) and
  centred on the reference. The raw total is kept as the component "unshaped".

  Args:
    r: the rollout (groups of `group_size` rows per prompt).
    reference_rewards: f32[P, M] total rewards of M reference replies per prompt.
    group_size: G.
  """
  refs = np.repeat(np.asarray(reference_rewards, np.float32), group_size, axis=0)
  shaped = np.asarray(credit.par_sigmoid_shaping(jnp.asarray(r.rewards), jnp.asarray(refs)))
  return dataclasses.replace(r, traj=types.with_outcome(r.traj, shaped), rewards=shaped,
                             components={**r.components, "unshaped": r.rewards})


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
    out["zero_variance_groups"] = float(tied_groups(grouped).mean())
  for name, values in r.components.items():
    out[f"reward/{name}_mean"] = float(values.mean())
    out[f"reward/{name}_std"] = float(values.std())
  return out


def evaluate(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], *,
             batch_size: int, max_new_tokens: int, template: str, chat: bool,
             system: str | None, reward_fn: RewardFn, grader, overflow: str = "error",
             compact_min_rows: int = 0) -> tuple[dict, list[dict]]:
  """Greedy completions of held-out examples: accuracy, rewards, lengths; and the samples.
  `compact_min_rows`: the SamplingConfig's (decoding goes on with the unfinished rows)."""
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=max_new_tokens, temperature=0.0,
      stop_tokens=tokenizer_lib.stop_token_ids(model.tokenizer),
      pad_id=model.tokenizer.pad_token_id, compact_min_rows=compact_min_rows)
  completions, used, prompts_truncated = [], [], 0
  for _, n, padded in shapes.padded_batches(examples, batch_size):
    s = single_turn.sample(params, model, padded, jax.random.key(0), group_size=1,
                           sampling=sampling, template=template, chat=chat, system=system,
                           overflow=overflow)
    completions += s.completions[:n]
    used += padded[:n]
    prompts_truncated += int(s.prompts_truncated[:n].sum())  # not the padding
  total, components = reward_fn(completions, used)
  timeouts = time_limit.timeouts(reward_fn)
  correct = np.asarray(grader(completions, used), np.float32)
  result = {"accuracy": float(correct.mean()), "reward_mean": float(np.mean(total)),
            "response_chars": float(np.mean([len(c) for c in completions])),
            "num_examples": len(used), "reward_timeouts": timeouts,
            "prompts_truncated": prompts_truncated}
  for name, values in components.items():
    result[f"reward/{name}_mean"] = float(np.mean(values))
  samples = [{"prompt": prompt, "completion": c, "answer": ex.get("answer"),
              "reward": float(total[i]), "correct": float(correct[i]),
              **{f"reward/{n}": float(v[i]) for n, v in components.items()}}
             for i, (prompt, ex, c) in enumerate(zip(single_turn.format_prompts(used, template),
                                                     used,
                                                     completions, strict=True))]
  return result, samples


# ----------------------------------------------------------------------------
# The algorithm interface and the loop.


class Collect(Protocol):
  """A train step's episodes: (params, the data's next batch, rng) -> (Rollout, extra scalars).

  Optional attribute: likely_trajectory(examples) -> the Trajectory's most likely shapes
  (`jax.ShapeDtypeStruct`s) before sampling, so an experiment can compile its first update
  while the first rollout samples (experiments/grpo.py).
  """

  def __call__(self, params, examples: Any, rng: jax.Array
               ) -> tuple[Rollout, dict[str, float]]: ...


def sampling_from_config(config, tok, greedy: bool = False) -> sampler_lib.SamplingConfig:
  """The rollouts' SamplingConfig (config.max_new_tokens, temperature, top_p, top_k,
  compact_min_rows), or with greedy the evaluation's (temperature 0)."""
  stop, pad = tokenizer_lib.stop_token_ids(tok), tok.pad_token_id
  compact = config.get("compact_min_rows", 0)
  if greedy:
    return sampler_lib.SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=0.0,
                                      stop_tokens=stop, pad_id=pad, compact_min_rows=compact)
  return sampler_lib.SamplingConfig(
      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
      top_p=config.get("top_p", 1.0), top_k=config.get("top_k", 0), stop_tokens=stop,
      pad_id=pad, compact_min_rows=compact)


def single_turn_collector(config, model: zoo.Model, *, reward_fn: RewardFn, grader,
                          eval_examples: Sequence[Mapping[str, Any]]
                          ) -> tuple[Collect, Callable[[Any], tuple[dict, list[dict]]] | None]:
  """(collect, evaluate) of a single-turn task: prompts from the data, rewarded replies,
  optionally PAR-shaped (config.reward_shaping); greedy evaluation on `eval_examples`."""
  sampling = sampling_from_config(config, model.tokenizer)
  prompt_kwargs = dict(template=config.prompt_template, chat=config.chat,
                       system=config.get("system_prompt") or None,
                       overflow=config.get("prompt_overflow", "error"))
  shaping = config.get("reward_shaping", None)
  # PAR's references come from the initial policy, kept apart: the train state
  # may donate (and so delete) the initial params at its first update.
  par_references = shaping.references if shaping and shaping.name == "par" else 0
  reference_params = jax.tree.map(jnp.copy, model.params) if par_references else None

  def collect(params, examples, rng):
    r = rollout(params, model, examples, rng, group_size=config.group_size, sampling=sampling,
                reward_fn=reward_fn, grader=grader, **prompt_kwargs)
    reward_timeouts = time_limit.timeouts(reward_fn)  # completions scored 0 for running over
    if par_references:
      ref = single_turn.sample(reference_params, model, examples, jax.random.fold_in(rng, 7),
                               group_size=par_references, sampling=sampling, **prompt_kwargs)
      ref_total, _ = reward_fn(ref.completions, ref.examples)
      reward_timeouts += time_limit.timeouts(reward_fn)
      r = par_shaped(r, np.reshape(ref_total, (len(examples), par_references)),
                     config.group_size)
    return r, {"reward_timeouts": reward_timeouts}

  collect.likely_trajectory = functools.partial(
      single_turn.likely_trajectory, model, group_size=config.group_size, sampling=sampling,
      **prompt_kwargs)

  def run_eval(params):
    return evaluate(params, model, eval_examples, batch_size=config.eval_batch_size,
                    max_new_tokens=config.max_new_tokens, reward_fn=reward_fn, grader=grader,
                    compact_min_rows=config.get("compact_min_rows", 0), **prompt_kwargs)

  return collect, run_eval if eval_examples else None


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
# postfix and finite_keys).
LOGGED = dict(postfix=("reward_mean", "accuracy"), finite_keys=("reward_mean",))


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
