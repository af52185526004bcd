"""The RL trainer on the run harness: rollout, rewards, update, evaluation.

An experiment (experiments/grpo.py, experiments/ppo.py) supplies an
`Algorithm`: how to build its train state from the policy params, how to
prepare a rollout batch for the update (advantages, old/reference
log-probabilities, values) and the jitted update itself. Here a train step is
a single-turn rollout (`rollout.single_turn`), its rewards, and the
algorithm's update; evaluation is greedy decoding of held-out prompts. The
workdir, resume, schedule, preemption and logging are `harness.run`'s, so
every algorithm gets the same workdir (see jaxrl_agents/harness.py):
metrics.jsonl holds per step the rewards per component, accuracy, KL,
entropy, clip fractions, grad norm, lengths, tokens/s, step and compile time,
and the eval records; samples.jsonl the prompts, completions and rewards.

Randomness derives from (seed, step) alone, so a run resumed from a checkpoint
continues exactly as if it had never stopped (bitwise on CPU).

With `config.resample_rounds` a step samples more batches of prompts while too few of
its groups have reward variance (DAPO's dynamic sampling, `resample_until_varied`).

With `config.overlap` the next step's rollout samples while this step's update
runs, one update behind the policy (`overlap.py`); the train state is then an
`overlap.OverlapState` around the algorithm's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import credit, distributed, harness, overlap, sharding, types
from jaxrl_agents import metrics as metrics_lib
from jaxrl_agents import objective as objective_lib
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rewards import time_limit
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import single_turn

log = logging.getLogger(__name__)


TrainingStopped = harness.TrainingStopped
compile_seconds = harness.compile_seconds


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
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    padded = chunk + [chunk[0]] * (batch_size - len(chunk))  # one compiled batch shape
    s = single_turn.sample(params, model, padded, jax.random.key(0), group_size=1,
                           sampling=sampling, template=template, chat=chat, system=system,
                           overflow=overflow)
    completions += s.completions[:len(chunk)]
    used += chunk
    prompts_truncated += int(s.prompts_truncated[:len(chunk)].sum())  # not the padding
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


class Algorithm(Protocol):
  """What an experiment plugs into `run`.

  init_state(params, rng) -> train state pytree (checkpointed as a whole)
  policy_params(state) -> the policy params inside the state (for sampling)
  prepare(state, rollout, rng) -> the update's batch pytree (advantages, old/ref logprobs, ...)
  update(state, batch, rng, progress) -> (state, metrics dict of scalars); jitted, donates the
      state; progress in [0, 1] is how far the run is (training time over the time budget
      when there is one, else steps over config.steps), for a learning-rate decay on that clock
  nonfinite_count(state) -> consecutive skipped (non-finite) updates so far

  Optional: precompile(state, traj, rng) starts compiling the update (or any
  other program of the step) in the background, for a rollout of `traj`'s
  shapes (`jax.ShapeDtypeStruct`s); `run` calls it before a process's first
  rollout when the collector can predict its shapes (`Collect.likely_trajectory`).
  score_rollout(state, rollout, rng) -> (rollout, metrics) rescores a sampled rollout
  with what the train state holds (a reward model trained beside the policy) before
  `prepare` gets it, with the same rng.
  averaged_params(state) -> the parameters evaluation reads in place of the policy's (a
  moving average of them), or None; evaluation then reports the policy's own figures
  beside them under `online/` (`evaluate_state`).
  """

  def init_state(self, params, rng): ...
  def policy_params(self, state): ...
  def prepare(self, state, rollout: Rollout, rng): ...
  def update(self, state, batch, rng, progress: float): ...
  def nonfinite_count(self, state) -> tuple[int, int]: ...


class Collect(Protocol):
  """A train step's episodes: (params, the data's next batch, rng) -> (Rollout, extra scalars).

  Optional attribute: likely_trajectory(examples) -> the Trajectory's most likely shapes
  (`jax.ShapeDtypeStruct`s) before sampling, for `Algorithm.precompile`.
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


def run(config, workdir: str, algorithm: Algorithm, model: zoo.Model, *, train_data,
        collect: Collect, evaluate: Callable[[Any], tuple[dict, list[dict]]] | None,
        progress: bool = True) -> dict:
  """Trains for config.steps rollout steps on the run harness (`harness.run`: workdir,
  resume, schedule, preemption, logging).

  Args:
    config: the experiment's ConfigDict (see experiments/configs/).
    workdir: the run directory.
    algorithm: the experiment's Algorithm.
    model: the policy (its params are the initial policy).
    train_data: an iterator (with get_state/set_state) whose batches `collect` takes.
    collect: the step's episodes (`single_turn_collector`, `env_loop.make`).
    evaluate: policy params -> (eval scalars, samples), or None.
    progress: show a tqdm progress bar on stderr.

  Returns:
    The last eval record (or {} when evaluation is off).
  """

  mesh = sharding.for_config(config)
  watch = NoSignalWatch()

  def update_step(*args, **kwargs) -> harness.StepResult:
    return watch(_update_step(config, algorithm, mesh, *args, **kwargs))

  def init_state():
    return algorithm.init_state(model.params,
                                jax.random.fold_in(jax.random.key(config.seed), 0x5EED))

  if config.get("overlap", False):
    overlap.check_supported(config, mesh)
    return _run_overlapped(config, workdir, algorithm, model, train_data, collect, evaluate,
                           progress, init_state, update_step)

  precompile_started = False  # once per process: later steps reuse what it compiled

  def train_step(state, rng, progress_fraction):
    nonlocal precompile_started
    rollout_rng, prepare_rng, update_rng = jax.random.split(rng, 3)
    t0 = time.perf_counter()
    examples = next(train_data)
    if not precompile_started:
      precompile_started = True
      _start_precompile(algorithm, collect, mesh, state, examples, update_rng)
    params = algorithm.policy_params(state)
    r, extra = collect(params, examples, rollout_rng)
    if config.get("resample_rounds", 0):
      r, extra = resample_until_varied(
          collect, params, lambda: next(train_data), rollout_rng, r, extra,
          need=config.prompts_per_step, max_rounds=config.resample_rounds,
          group_size=config.group_size, max_new_tokens=config.max_new_tokens)
    return update_step(state, r, extra, prepare_rng, update_rng, progress_fraction,
                       time.perf_counter() - t0)

  run_eval = None if evaluate is None else (
      lambda state: evaluate_state(algorithm, evaluate, state))
  return harness.run(
      config, workdir, init_state=init_state, train_step=train_step, evaluate=run_eval,
      data=train_data, nonfinite_count=algorithm.nonfinite_count, progress=progress,
      **_LOGGED)


def evaluate_state(algorithm: Algorithm, evaluate, state) -> tuple[dict, list[dict]]:
  """`evaluate` of the train state's evaluated policy: its averaged parameters where the
  algorithm keeps them (`averaged_params`), with the policy's own scalars beside them under
  `online/`; else the policy's."""
  averaged = getattr(algorithm, "averaged_params", lambda state: None)(state)
  if averaged is None:
    return evaluate(algorithm.policy_params(state))
  result, samples = evaluate(averaged)
  online, _ = evaluate(algorithm.policy_params(state))
  return {**result, **{f"online/{k}": v for k, v in online.items()}}, samples


def _start_precompile(algorithm: Algorithm, collect: Collect, mesh, state, examples,
                      rng) -> None:
  """Starts compiling the update for the rollout's likely shapes while it samples
  (`precompile.py`). Nothing when the collector cannot predict them, the algorithm has
  nothing to compile ahead, or the run is on a mesh (a compiled program's placement is
  fixed)."""
  hint = getattr(collect, "likely_trajectory", None)
  if hint is not None and hasattr(algorithm, "precompile") and mesh is None:
    algorithm.precompile(state, hint(examples), rng)


class NoSignalWatch:
  """Warns in the log when `metrics.NO_SIGNAL_STEPS` train records in a row had no learning
  signal (`metrics.has_no_signal`): a run whose reward never varies within a group trains
  nothing, and says so instead of running on silently. Once per streak."""

  def __init__(self):
    self.streak = 0

  def __call__(self, result: harness.StepResult) -> harness.StepResult:
    self.streak = self.streak + 1 if metrics_lib.has_no_signal(result.record) else 0
    if self.streak == metrics_lib.NO_SIGNAL_STEPS:
      log.warning("no learning signal for %d steps in a row (every group's rewards tied, or a "
                  "zero gradient): nothing is being learned; check that the reward varies "
                  "within a group (the reward, the grader, the task's difficulty)", self.streak)
    return result


# What the progress bar shows, and what stops a run when it is not finite.
_LOGGED = dict(postfix=("reward_mean", "accuracy"), finite_keys=("reward_mean",))


def _update_step(config, algorithm: Algorithm, mesh, state, r: Rollout,
                 extra: Mapping[str, float], prepare_rng, update_rng, progress_fraction,
                 rollout_s: float, wait_s: float | None = None) -> harness.StepResult:
  """A sampled rollout's update and the step's record (`wait_s`: an overlapped step's wait
  for its rollout)."""
  t1 = time.perf_counter()
  # Rows split over the mesh's data x fsdp devices (no-op on one device); what the
  # batch carries that is not per row (a baseline's state) stays as it is.
  rows = r.traj.tokens.shape[0]
  r = dataclasses.replace(r, traj=sharding.shard_batch(r.traj, mesh))
  if hasattr(algorithm, "score_rollout"):  # a reward that lives in the train state
    r, scored = algorithm.score_rollout(state, r, prepare_rng)
    extra = {**extra, **scored}
  batch = sharding.shard_batch(algorithm.prepare(state, r, prepare_rng), mesh, rows=rows)
  state, update_metrics = algorithm.update(state, batch, update_rng, progress_fraction)
  update_metrics = jax.device_get(update_metrics)
  t2 = time.perf_counter()
  generated = int(distributed.to_host(r.traj.policy_mask).sum())
  attended = int(distributed.to_host(r.traj.valid).sum())
  record = {
      **rollout_metrics(r, config.group_size, objective_lib.policy_token_budget(config)),
      **extra,
      **{k: float(v) for k, v in update_metrics.items()},
      "skipped_updates": algorithm.nonfinite_count(state)[1],
      "rollout_time_s": rollout_s, "update_time_s": t2 - t1,
      "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
      "update_tokens_per_s": attended * config.get("epochs", 1) / max(t2 - t1, 1e-9),
  }
  if wait_s is not None:  # the rollout ran during the previous update: the step waited this long
    record["rollout_wait_s"] = wait_s
  return harness.StepResult(state, record, rollout_samples(r))


def _run_overlapped(config, workdir: str, algorithm: Algorithm, model: zoo.Model, train_data,
                    collect: Collect, evaluate, progress: bool, init_state, update_step) -> dict:
  """`run` with the next step's rollout sampled during this step's update (`overlap.py`)."""
  data = overlap.Lookahead(train_data)
  pipeline = overlap.Pipeline(collect, data, config.seed)

  def overlapped_step(state: overlap.OverlapState, rng, progress_fraction):
    # train_step's split; the rollout's key is overlap.rollout_key (either thread samples it)
    _, prepare_rng, update_rng = jax.random.split(rng, 3)
    step, t0 = int(state.step), time.perf_counter()
    r, extra, rollout_s = pipeline.take(step, state.behavior_params)
    wait_s = time.perf_counter() - t0
    # The update donates the train state: the next rollout samples from a copy.
    sampler_params = overlap.copy_params(algorithm.policy_params(state.train))
    if step + 1 < config.steps:
      pipeline.start(step + 1, sampler_params)
    result = update_step(state.train, r, extra, prepare_rng, update_rng, progress_fraction,
                         rollout_s, wait_s)
    return result._replace(state=overlap.OverlapState(
        train=result.state, behavior_params=sampler_params, step=state.step + 1))

  def overlapped_eval(state: overlap.OverlapState):
    pipeline.drain()  # the rewards' host state is not shared across threads
    return evaluate_state(algorithm, evaluate, state.train)

  return harness.run(
      config, workdir,
      init_state=lambda: overlap.OverlapState(
          train=init_state(), behavior_params=overlap.copy_params(model.params),
          step=jnp.zeros((), jnp.int32)),
      train_step=overlapped_step, evaluate=None if evaluate is None else overlapped_eval,
      data=data, nonfinite_count=lambda state: algorithm.nonfinite_count(state.train),
      progress=progress, on_exit=pipeline.close, **_LOGGED)


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
