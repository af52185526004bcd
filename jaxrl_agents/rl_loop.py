"""The host loop shared by the RL experiments: rollout, rewards, update, evaluate, checkpoint.

An experiment (experiments/grpo.py, experiments/ppo.py) supplies an
`Algorithm`: how to build its train state from the policy params, how to
prepare a rollout batch for the update (advantages, old/reference
log-probabilities, values) and the jitted update itself. Everything else is
here, so every algorithm gets the same workdir:

  checkpoints/        Orbax: train state, data iterator state, config (every N steps, last K)
  metrics.jsonl       per step: rewards per component, accuracy, KL, entropy, clip fractions,
                      grad norm, lengths, tokens/s, step and compile time; eval records
  samples.jsonl       prompts, completions and rewards every N steps
  tensorboard/        the same scalars as TensorBoard events
  config.json         the resolved config

Randomness derives from (seed, step) alone, so a run resumed from a checkpoint
continues exactly as if it had never stopped (bitwise on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import checkpointing, registry
from jaxrl_agents import metrics as metrics_lib
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout.scoring import SequenceBatch

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. too many non-finite updates in a row)."""


# ----------------------------------------------------------------------------
# Compile-time accounting: JAX reports the duration of every trace, lowering
# and backend compile; summing them per step separates compile from compute.

_COMPILE_SECONDS = [0.0]
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


def _on_duration(event: str, duration: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
  """Seconds spent tracing, lowering and compiling since the process started."""
  return _COMPILE_SECONDS[0]


# ----------------------------------------------------------------------------
# Rollouts.


@dataclasses.dataclass
class Rollout:
  """One batch of completions with rewards (host and device arrays).

  Attributes:
    seq: the token streams (device arrays), B = P * G rows, prompt-major; completions
      trimmed to `trimmed_width` columns.
    examples: the B task examples (each prompt's repeated G times).
    prompts: the B prompt strings.
    completions: the B decoded completions.
    rewards: f32[B] total reward.
    components: per-component f32[B] rewards.
    correct: f32[B] the grader's verdict (accuracy).
    sampling_logprobs: f32[B, n] from the sampler (n: the trimmed completion width).
  """

  seq: SequenceBatch
  examples: list[Mapping[str, Any]]
  prompts: list[str]
  completions: list[str]
  rewards: np.ndarray
  components: dict[str, np.ndarray]
  correct: np.ndarray
  sampling_logprobs: jax.Array


def format_prompts(examples: Sequence[Mapping[str, Any]], template: str) -> list[str]:
  """The user message of each example: `template` formatted with the example's fields."""
  out = []
  for i, ex in enumerate(examples):
    try:
      out.append(template.format(**ex))
    except KeyError as e:
      raise KeyError(f"prompt template {template!r} needs field {e} missing from example {i} "
                     f"(fields: {sorted(ex)})") from None
  return out


def encode(tokenizer, prompts: Sequence[str], *, chat: bool, system: str | None,
           multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded int32[B, Lp] prompt tokens and mask, Lp rounded up to a multiple of 16.

  A task's prompts vary by a few tokens, so multiples of 16 give one or two
  shapes (compilations) per run while padding far less than powers of two
  (a 46-token SmolLM2 chat prompt pads to 48, not 64).
  """
  ids = tokenizer_lib.encode_prompts(tokenizer, prompts, chat, system)
  return _pad_to_multiple(ids, tokenizer.pad_token_id, multiple)


def _pad_to_multiple(ids: list[list[int]], pad_id: int, multiple: int):
  length = -(-max(len(s) for s in ids) // multiple) * multiple
  return tokenizer_lib.pad_left(ids, pad_id, length)


def split_for_sampling(tokens: np.ndarray, mask: np.ndarray, pad_id: int, multiple: int = 16
                       ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
  """(shared prefix or None, suffix tokens, suffix mask) of `encode`'s prompts for `generate`.

  The chat template's system prompt starts every prompt: the sampler prefills
  it once for the batch (`prefix_tokens`) and the rows only their own part.
  """
  ids = [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]
  prefix, suffixes = sampler_lib.split_shared_prefix(ids)
  if not prefix:
    return None, tokens, mask
  return np.asarray(prefix, np.int32), *_pad_to_multiple(suffixes, pad_id, multiple)


def trimmed_width(lengths: np.ndarray, max_new_tokens: int, minimum: int = 8) -> int:
  """Completion columns the update needs: the longest completion, bucketed to a power of two.

  The update costs in proportion to prompt + completion columns; short replies
  in a 48-token budget would otherwise pay for 48. Power-of-two buckets keep
  the number of update shapes (compilations) to a handful.
  """
  return min(max_new_tokens, sampler_lib.bucket(int(np.max(lengths)), minimum=minimum))


def decode(tokenizer, tokens: np.ndarray, lengths: np.ndarray, stop_tokens: Sequence[int]
           ) -> list[str]:
  """Completion texts without their stop token."""
  texts = []
  for row, n in zip(tokens, lengths, strict=True):
    ids = [t for t in row[:n].tolist() if t not in stop_tokens]
    texts.append(tokenizer.decode(ids, skip_special_tokens=True))
  return texts


class RewardModel(Protocol):
  def __call__(self, completions: Sequence[str], examples: Sequence[Mapping]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


def rollout(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], rng: jax.Array, *,
            group_size: int, sampling: sampler_lib.SamplingConfig, template: str, chat: bool,
            system: str | None, reward_fn: RewardModel,
            grader: Callable[[Sequence[str], Sequence[Mapping]], np.ndarray]) -> Rollout:
  """Samples `group_size` completions per example (one prefill per example) and scores them.

  Rows are example-major: rows [i * G, (i + 1) * G) are example i's group.
  """
  unique_prompts = format_prompts(examples, template)
  unique_tokens, unique_mask = encode(model.tokenizer, unique_prompts, chat=chat, system=system)
  prefix, gen_tokens, gen_mask = split_for_sampling(unique_tokens, unique_mask,
                                                    model.tokenizer.pad_token_id)
  out = sampler_lib.generate(params, model.cfg, jnp.asarray(gen_tokens), jnp.asarray(gen_mask),
                             rng, sampling, samples_per_prompt=group_size,
                             prefix_tokens=None if prefix is None else jnp.asarray(prefix))
  examples = [ex for ex in examples for _ in range(group_size)]
  prompts = [p for p in unique_prompts for _ in range(group_size)]
  tokens = np.repeat(unique_tokens, group_size, axis=0)
  mask = np.repeat(unique_mask, group_size, axis=0)
  host_tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  completions = decode(model.tokenizer, host_tokens, lengths, sampling.stop_tokens)
  total, components = reward_fn(completions, examples)
  correct = np.asarray(grader(completions, examples), np.float32)
  n = trimmed_width(lengths, sampling.max_new_tokens)
  seq = SequenceBatch(jnp.asarray(tokens), jnp.asarray(mask), out.tokens[:, :n], out.mask[:, :n])
  return Rollout(seq=seq, examples=examples, prompts=prompts, completions=completions,
                 rewards=np.asarray(total, np.float32),
                 components={k: np.asarray(v, np.float32) for k, v in components.items()},
                 correct=correct, sampling_logprobs=out.sampling_logprobs[:, :n])


def rollout_metrics(r: Rollout, group_size: int, max_new_tokens: int) -> dict[str, float]:
  """Reward, accuracy and length statistics of a rollout batch."""
  lengths = np.asarray(r.seq.completion_mask).sum(-1)
  out = {
      "reward_mean": float(r.rewards.mean()),
      "reward_std": float(r.rewards.std()),
      "accuracy": float(r.correct.mean()),
      "response_length": float(lengths.mean()),
      "response_length_max": float(lengths.max()),
      # Hit the token budget (a completion may end exactly there with its stop
      # token, but the sampler counts that token in its length only when live).
      "truncated_frac": float((lengths >= max_new_tokens).mean()),
  }
  if group_size > 1:
    # Groups whose rewards all tie give zero group-relative advantage: no signal.
    grouped = r.rewards.reshape(-1, group_size)
    out["zero_variance_groups"] = float((grouped.std(axis=1) == 0).mean())
  for name, values in r.components.items():
    out[f"reward/{name}_mean"] = float(values.mean())
    out[f"reward/{name}_std"] = float(values.std())
  return out


def evaluate(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], *,
             batch_size: int, max_new_tokens: int, template: str, chat: bool,
             system: str | None, reward_fn: RewardModel, grader) -> tuple[dict, list[dict]]:
  """Greedy completions of held-out examples: accuracy, rewards, lengths; and the samples."""
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=max_new_tokens, temperature=0.0,
      stop_tokens=tokenizer_lib.stop_token_ids(model.tokenizer),
      pad_id=model.tokenizer.pad_token_id)
  completions, used = [], []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    padded = chunk + [chunk[0]] * (batch_size - len(chunk))  # one compiled batch shape
    r = rollout(params, model, padded, jax.random.key(0), group_size=1, sampling=sampling,
                template=template, chat=chat, system=system,
                reward_fn=lambda c, e: (np.zeros(len(c)), {}), grader=lambda c, e: np.zeros(len(c)))
    completions += r.completions[:len(chunk)]
    used += chunk
  total, components = reward_fn(completions, used)
  correct = np.asarray(grader(completions, used), np.float32)
  result = {"accuracy": float(correct.mean()), "reward_mean": float(np.mean(total)),
            "response_chars": float(np.mean([len(c) for c in completions])),
            "num_examples": len(used)}
  for name, values in components.items():
    result[f"reward/{name}_mean"] = float(np.mean(values))
  samples = [{"prompt": prompt, "completion": c, "answer": ex.get("answer"),
              "reward": float(total[i]), "correct": float(correct[i]),
              **{f"reward/{n}": float(v[i]) for n, v in components.items()}}
             for i, (prompt, ex, c) in enumerate(zip(format_prompts(used, template), used,
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
  """

  def init_state(self, params, rng): ...
  def policy_params(self, state): ...
  def prepare(self, state, rollout: Rollout, rng): ...
  def update(self, state, batch, rng, progress: float): ...
  def nonfinite_count(self, state) -> tuple[int, int]: ...


class _Preemption:
  """Turns SIGTERM into a flag the loop checks between steps (TPU VMs get SIGTERM on preemption)."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True
    log.warning("SIGTERM received: checkpointing after the current step, then exiting")

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _config_to_dict(config) -> dict:
  return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") \
      else dict(config)


# Keys that may change when a run resumes: they decide what is logged and
# saved, or how long the run goes on, not what it computes.
RESUMABLE_CHANGES = frozenset({
    "steps", "eval_every", "eval_size", "eval_batch_size", "checkpoint_every",
    "keep_checkpoints", "sample_every", "samples_per_log", "tensorboard",
    "max_consecutive_nonfinite", "time_budget_s", "eval_every_s"})


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resumable(saved: Mapping, current: Mapping, workdir: str) -> None:
  """Fails when the workdir's checkpoint was written under a config that computes differently.

  A resumed run must continue the run it resumes; to run a changed experiment,
  use a new workdir.
  """
  old, new = _flat(saved), _flat(current)
  changed = sorted(k for k in old.keys() | new.keys()
                   if old.get(k, "<unset>") != new.get(k, "<unset>")
                   and k not in RESUMABLE_CHANGES)
  if changed:
    details = "; ".join(f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}"
                        for k in changed[:8])
    raise ValueError(f"{workdir} holds a run with a different config ({details}); resume it "
                     "with its own config (see its config.json) or use a new workdir")
  if old.get("steps") != new.get("steps") and new.get("optimizer.decay", "constant") != \
      "constant":
    raise ValueError(f"{workdir}: changing steps ({old.get('steps')} -> {new.get('steps')}) "
                     f"would change the {new['optimizer.decay']} learning-rate schedule of the "
                     "run being resumed; use a new workdir")


def run(config, workdir: str, algorithm: Algorithm, model: zoo.Model, *, train_data,
        eval_examples: Sequence[Mapping[str, Any]], reward_fn: RewardModel, grader,
        progress: bool = True) -> dict:
  """Trains for config.steps rollout steps, resuming from the workdir's latest checkpoint.

  Training time (`train_time_s` in the records) is the wall-clock spent in
  rollouts and updates, compilation included, evaluation and checkpointing
  excluded; it carries over a resume. With `config.time_budget_s > 0` the run
  stops at the first step that reaches that much training time, and with
  `config.eval_every_s > 0` it also evaluates each time training time crosses
  a multiple of it (runs that stop on time are not bitwise reproducible).

  Args:
    config: the experiment's ConfigDict (see experiments/configs/).
    workdir: the run directory.
    algorithm: the experiment's Algorithm.
    model: the policy (its params are the initial policy).
    train_data: an iterator of example batches (lists of dicts) with get_state/set_state.
    eval_examples: held-out examples.
    reward_fn: completions, examples -> (total f32[B], components).
    grader: completions, examples -> f32[B] correctness (the accuracy metric).
    progress: show a tqdm progress bar on stderr.

  Returns:
    The last eval record (or {} when evaluation is off).
  """
  from tqdm import tqdm

  os.makedirs(workdir, exist_ok=True)
  ckpt = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  saved = ckpt.latest_meta()
  if saved is not None:
    check_resumable(saved[1].get("config", {}), _config_to_dict(config), workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(_config_to_dict(config), f, indent=2)
  writer = metrics_lib.MetricWriter(workdir, tensorboard=config.get("tensorboard", True))
  base_rng = jax.random.key(config.seed)
  state = algorithm.init_state(model.params, jax.random.fold_in(base_rng, 0x5EED))
  start_step, train_time = 0, 0.0
  restored = ckpt.restore_latest(state)
  if restored is not None:
    start_step, state, data_state, meta = restored
    train_time = float(meta.get("train_time_s", 0.0))
    train_data.set_state(data_state)
    writer.truncate_after(start_step)
    log.info("resumed from step %d in %s", start_step, ckpt.directory)
  else:
    writer.truncate_after(-1)  # logs of a run that left no usable checkpoint: start over

  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
      top_p=config.get("top_p", 1.0), top_k=config.get("top_k", 0),
      stop_tokens=tokenizer_lib.stop_token_ids(model.tokenizer),
      pad_id=model.tokenizer.pad_token_id)
  prompt_kwargs = dict(template=config.prompt_template, chat=config.chat,
                       system=config.get("system_prompt") or None)

  def run_eval(step):
    if not (config.eval_every or eval_every_s) or not eval_examples:
      return {}
    t0 = time.perf_counter()
    result, samples = evaluate(
        algorithm.policy_params(state), model, eval_examples, batch_size=config.eval_batch_size,
        max_new_tokens=config.max_new_tokens, reward_fn=reward_fn, grader=grader,
        **prompt_kwargs)
    result["eval_time_s"] = time.perf_counter() - t0
    result["train_time_s"] = train_time
    writer.write_scalars(step, result, kind="eval")
    writer.write_samples(step, samples[:config.samples_per_log], kind="eval")
    log.info("eval at step %d: accuracy %.3f (%d examples, %.1fs)", step, result["accuracy"],
             result["num_examples"], result["eval_time_s"])
    return result

  def save(step):
    ckpt.save(step, state, train_data.get_state(),
              {"config": _config_to_dict(config), "seed": config.seed, "step": step,
               "train_time_s": train_time})

  budget = float(config.get("time_budget_s", 0.0) or 0.0)
  eval_every_s = float(config.get("eval_every_s", 0.0) or 0.0)
  next_timed_eval = (math.floor(train_time / eval_every_s) + 1) * eval_every_s \
      if eval_every_s else math.inf

  last_eval = {}
  if start_step == 0:
    last_eval = run_eval(0)
  bar = tqdm(total=config.steps, initial=start_step, disable=not progress, file=sys.stderr,
             desc="train", dynamic_ncols=True)
  step = start_step
  with _Preemption() as preemption:
    try:
      while step < config.steps:
        step_rng = jax.random.fold_in(base_rng, step)
        rollout_rng, prepare_rng, update_rng = jax.random.split(step_rng, 3)
        compile_before = compile_seconds()
        t0 = time.perf_counter()
        examples = next(train_data)
        r = rollout(algorithm.policy_params(state), model, examples, rollout_rng,
                    group_size=config.group_size, sampling=sampling, reward_fn=reward_fn,
                    grader=grader, **prompt_kwargs)
        t1 = time.perf_counter()
        batch = algorithm.prepare(state, r, prepare_rng)
        # How far the run is when this step starts: by training time under a time
        # budget (its step count is unknown in advance), else by steps.
        progress = train_time / budget if budget > 0 else step / config.steps
        state, update_metrics = algorithm.update(state, batch, update_rng, progress)
        update_metrics = jax.device_get(update_metrics)
        t2 = time.perf_counter()
        step += 1
        train_time += t2 - t0
        consecutive, total_skipped = algorithm.nonfinite_count(state)
        generated = int(np.asarray(r.seq.completion_mask).sum())
        seq_tokens = generated + int(np.asarray(r.seq.prompt_mask).sum())
        record = {
            **rollout_metrics(r, config.group_size, config.max_new_tokens),
            **{k: float(v) for k, v in update_metrics.items()},
            "skipped_updates": total_skipped,
            "rollout_time_s": t1 - t0, "update_time_s": t2 - t1, "step_time_s": t2 - t0,
            "train_time_s": train_time,
            "rollout_tokens_per_s": generated / max(t1 - t0, 1e-9),
            "update_tokens_per_s": seq_tokens * config.get("epochs", 1) / max(t2 - t1, 1e-9),
            "compile_time_s": compile_seconds() - compile_before,
        }
        writer.write_scalars(step, record)
        if config.sample_every and step % config.sample_every == 0:
          writer.write_samples(step, [
              {"prompt": p, "completion": c, "answer": ex.get("answer"), "reward": float(rw),
               "correct": float(k), **{f"reward/{n}": float(v[i]) for n, v in r.components.items()}}
              for i, (p, ex, c, rw, k) in enumerate(zip(r.prompts, r.examples, r.completions,
                                                        r.rewards, r.correct, strict=True))
              if i < config.samples_per_log])
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.2f}")
        bar.update(1)
        if consecutive >= config.max_consecutive_nonfinite:
          raise TrainingStopped(
              f"{consecutive} consecutive updates had a non-finite loss or gradient (step "
              f"{step}); stopping. The last good checkpoint is intact in {ckpt.directory}.")
        if not math.isfinite(record["reward_mean"]):
          raise TrainingStopped(f"non-finite rewards at step {step}")
        out_of_time = budget > 0 and train_time >= budget
        timed_eval = train_time >= next_timed_eval
        if timed_eval:
          next_timed_eval = (math.floor(train_time / eval_every_s) + 1) * eval_every_s
        evaluated = False
        if (config.eval_every and step % config.eval_every == 0) or (
            timed_eval and not out_of_time):
          last_eval, evaluated = run_eval(step), True
        if step % config.checkpoint_every == 0 or step == config.steps or out_of_time:
          save(step)
        if out_of_time:
          log.info("time budget of %.0f s reached at step %d", budget, step)
          if not evaluated:
            last_eval = run_eval(step)
          break
        if preemption.requested:
          save(step)
          log.warning("checkpointed step %d after SIGTERM; exiting", step)
          raise SystemExit(143)
      else:  # the step budget ran out (not the time budget)
        if config.eval_every and step % config.eval_every != 0 and step > start_step:
          last_eval = run_eval(step)
    finally:
      bar.close()
      writer.close()
      ckpt.close()
  return last_eval


def registered_or_raise(kind: str, name: str) -> None:
  """Fails with the valid names when `name` is not registered (before anything compiles)."""
  registry.get(kind, name)
