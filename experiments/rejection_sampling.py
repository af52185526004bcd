r"""Rejection-sampling self-improvement (RAFT / ReST): sample, keep the best, fine-tune, repeat.

  python -m experiments.rejection_sampling \
      --config=experiments/configs/rejection_sampling_arithmetic.py:tiny --workdir=/tmp/rs_tiny

A round is `steps_per_round` steps. At its first step the current policy
samples `samples_per_prompt` replies to each of `prompts_per_round` training
prompts; `config.rewards` scores them (verifiable rewards, or a trained reward
model: `{"reward_model": {"workdir": RUN}}`); each prompt keeps its `keep_top`
best finished replies (`losses.raft_select`; a reply cut at the token budget
is not kept unless `keep_unfinished`) whose reward is at least `min_reward` (ReST's threshold). The
kept (prompt, reply) rows become the round's buffer, and each step of the
round fine-tunes on `batch_size` rows drawn from it (`experiments.sft.sft_loss`).
The buffer lives in the train state, so a run resumed mid-round continues on
the same rows. Evaluate every round
(`eval_every = steps_per_round`) for the per-round held-out accuracy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, sft
from jaxrl_agents import data as data_lib
from jaxrl_agents import registry
from jaxrl_agents.objectives import losses
from jaxrl_agents.parallel import distributed
from jaxrl_agents.rollout import single_turn
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib


class RSState(NamedTuple):
  params: Any
  opt_state: Any
  updates: jax.Array  # int32[] applied optimizer updates
  step: jax.Array  # int32[] steps taken (a round starts when step % steps_per_round == 0)
  buffer: sft.SFTBatch  # the round's kept rows, [prompts_per_round * keep_top, max_len]
  buffer_rows: jax.Array  # int32[] how many buffer rows are real (the first ones)


class RejectionSampling:
  def __init__(self, config, model, train_source, eval_examples):
    self.config, self.model, self.eval_examples = config, model, eval_examples
    self.optimizer, self._update = sft.make_update(config, model,
                                                   config.steps * config.minibatches)
    self.data = data_lib.make_loader(train_source, batch_size=config.prompts_per_round,
                                     seed=config.seed)
    # With several processes each scores its share of the rows (one process: unchanged).
    self.reward_fn, self.grader = map(distributed.split_rows, common.make_rewards(config))
    self.sampling = single_turn.sampling_from_config(config, model.tokenizer)
    self.rows = config.prompts_per_round * config.keep_top
    self._select = jax.jit(losses.raft_select, static_argnums=1)

  def init_state(self) -> RSState:
    s = sft.init_state(self.model, self.optimizer)
    w = self.config.max_len
    empty = sft.SFTBatch(jnp.zeros((self.rows, w), jnp.int32), jnp.zeros((self.rows, w), bool),
                         jnp.zeros((self.rows, w), bool))
    return RSState(params=s.params, opt_state=s.opt_state, updates=s.updates,
                   step=jnp.zeros((), jnp.int32), buffer=empty,
                   buffer_rows=jnp.zeros((), jnp.int32))

  def new_round(self, state: RSState, rng) -> tuple[RSState, dict, list[dict]]:
    """Samples, scores and selects from the current policy; the kept rows become the buffer."""
    c, n = self.config, self.config.samples_per_prompt
    examples = next(self.data)
    r = single_turn.rollout(state.params, self.model, examples, rng, group_size=n,
                        sampling=self.sampling, template=c.prompt_template, chat=c.chat,
                        system=c.system_prompt or None, reward_fn=self.reward_fn,
                        grader=self.grader)
    rewards = r.rewards.reshape(-1, n)
    # A reply cut at the token budget never ended: fine-tuning on it (closed by the
    # end-of-turn token) would teach the policy to stop mid-reply. It is never kept.
    ended = distributed.to_host(r.traj.policy_mask).sum(-1) < c.max_new_tokens  # read once
    finished = ended.reshape(-1, n)
    if c.keep_unfinished:
      finished = np.ones_like(finished)
    ranked = np.where(finished, rewards, -np.inf)
    keep = (np.asarray(self._select(jnp.asarray(ranked), c.keep_top)) & finished
            & (rewards >= c.min_reward))
    kept = np.flatnonzero(keep.reshape(-1))
    buffer = state.buffer
    if len(kept):
      batch, _ = sft.encode_rows(self.model.tokenizer, [r.prompts[i] for i in kept],
                                 [r.completions[i] for i in kept], max_len=c.max_len,
                                 chat=c.chat, system=c.system_prompt or None, width=c.max_len)
      pad = self.rows - len(kept)
      # Placed where the previous buffer lives (on a mesh of several hosts, a global array:
      # a process-local one could not be checkpointed).
      buffer = jax.tree.map(lambda x, old: jax.device_put(
          np.pad(np.asarray(x), ((0, pad), (0, 0))), old.sharding), batch, buffer)
    record = {"round": int(state.step) // c.steps_per_round + 1,
              "round_reward_mean": float(r.rewards.mean()),
              "round_sample_accuracy": float(r.correct.mean()),
              "round_kept_frac": len(kept) / len(r.rewards),
              "round_finished_frac": float(
                  ended.mean()),
              "round_best_finished_reward_mean": float(
                  np.max(ranked, axis=1)[finished.any(axis=1)].mean()
                  if finished.any() else np.nan),
              "round_prompts_with_a_kept_reply": float(keep.any(axis=1).mean())}
    samples = [{"prompt": r.prompts[i], "completion": r.completions[i],
                "reward": float(r.rewards[i])} for i in kept]
    rows = jax.device_put(np.int32(len(kept)), state.buffer_rows.sharding)
    return state._replace(buffer=buffer, buffer_rows=rows), record, samples

  def train_step(self, state: RSState, rng, progress: float) -> harness.StepResult:
    record, samples = {}, []
    if int(state.step) % self.config.steps_per_round == 0:
      state, record, samples = self.new_round(state, jax.random.fold_in(rng, 1))
    rows = int(state.buffer_rows)
    if rows:
      idx = jax.random.randint(jax.random.fold_in(rng, 2), (self.config.batch_size,), 0, rows)
      batch = jax.tree.map(lambda x: x[idx], state.buffer)
      inner = sft.SFTState(state.params, state.opt_state, state.updates)
      inner, metrics = self._update(inner, batch, jax.random.fold_in(rng, 3),
                                    jnp.float32(progress))
      state = state._replace(params=inner.params, opt_state=inner.opt_state,
                             updates=inner.updates)
      record.update({k: float(v) for k, v in jax.device_get(metrics).items()})
    record["buffer_rows"] = rows
    return harness.StepResult(state=state._replace(step=state.step + 1), record=record,
                              samples=samples)

  def evaluate(self, state: RSState) -> tuple[dict, list[dict]]:
    return sft.held_out_accuracy(self.config, self.model, state.params, self.eval_examples,
                                 (self.reward_fn, self.grader))

  def nonfinite_count(self, state) -> tuple[int, int]:
    return optim_lib.nonfinite_count(state)


def validate(config) -> None:
  harness.validate_run_keys(config)
  common.make_rewards(config)  # reward names, options and the combinator
  registry.get("reward", config.grader)
  for key in ("minibatches", "steps", "prompts_per_round", "samples_per_prompt",
              "max_new_tokens", "max_len"):
    if config[key] < 1:
      raise ValueError(f"config.{key} must be >= 1, got {config[key]}")
  if not config.temperature > 0:
    raise ValueError(f"config.temperature must be > 0 to sample, got {config.temperature}")
  if config.steps_per_round < 1 or config.steps % config.steps_per_round:
    raise ValueError(f"steps ({config.steps}) must be a whole number of rounds of "
                     f"steps_per_round ({config.steps_per_round})")
  if not 1 <= config.keep_top <= config.samples_per_prompt:
    raise ValueError(f"keep_top must be in [1, samples_per_prompt = "
                     f"{config.samples_per_prompt}], got {config.keep_top}")
  if config.batch_size < 1 or config.batch_size % config.minibatches:
    raise ValueError(f"batch_size ({config.batch_size}) must be a positive multiple of "
                     f"minibatches ({config.minibatches})")


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) rejection-sampling rounds in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  train_source, eval_examples = common.task_examples(config)
  trainer = RejectionSampling(config, model, train_source, eval_examples)
  return harness.run(config, workdir, init_state=trainer.init_state,
                     train_step=trainer.train_step, evaluate=trainer.evaluate,
                     data=trainer.data, nonfinite_count=trainer.nonfinite_count,
                     postfix=("round_sample_accuracy", "loss"), progress=progress,
                     resume_rules=common.RESUME_RULES)


if __name__ == "__main__":
  common.main(train)
