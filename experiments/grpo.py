r"""GRPO (and its variants, by config) on a task of prompts with verifiable rewards.

  python -m experiments.grpo --config=experiments/configs/grpo_arithmetic.py:tiny \
      --config.steps=3 --workdir=/tmp/grpo_tiny

One step: sample P prompts, G completions each (the jitted KV-cache sampler),
score them with the configured rewards, turn the [P, G] rewards into
advantages with a registered estimator, then run `epochs` passes of
`minibatches` optimizer updates of a registered policy loss (+ optional KL to
the frozen initial policy, + optional entropy bonus), all in one jitted
`lax.scan`. The workdir layout, resume and logging are `jaxrl_agents.rl_loop`'s.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from jaxrl_agents import losses, registry, rl_loop
from jaxrl_agents import optim as optim_lib
from jaxrl_agents.losses.aggregation import masked_mean
from jaxrl_agents.rollout.scoring import SequenceBatch, completion_logprobs

log = logging.getLogger(__name__)


# Registered advantage estimators that map f32[P, G] outcome rewards to advantages.
GROUP_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"})


class GRPOState(NamedTuple):
  params: dict  # the policy
  opt_state: optax.OptState
  ref_params: dict | None  # frozen reference policy; None without a KL term
  updates: jax.Array  # int32[] optimizer updates so far (the schedule's position)


class GRPOBatch(NamedTuple):
  seq: SequenceBatch
  advantages: jax.Array  # f32[B]
  old_logp: jax.Array  # f32[B, N] log-probs under the sampling policy (recomputed)
  ref_logp: jax.Array  # f32[B, N] under the reference (zeros without KL)


def select_groups(seq: SequenceBatch, rewards: np.ndarray, keep: int
                  ) -> tuple[SequenceBatch, np.ndarray]:
  """The `keep` groups the update trains on, out of the sampled ones: groups with signal first.

  A group whose rewards all tie has zero group-relative advantage and adds
  nothing but compute (and dilution of a token mean) to the update. With
  `oversample` > 1 a step samples more groups than it trains on and keeps
  those with reward variance, in sampling order (the loader's order is already
  random), topping up with tied groups when too few vary, so the update's
  shape never changes: DAPO's dynamic sampling with a fixed batch instead of
  resampling until full.

  Args:
    seq: the rollout's rows, groups of G consecutive rows.
    rewards: f32[groups, G].
    keep: groups to keep (<= groups).

  Returns:
    (the kept rows, their rewards f32[keep, G]).
  """
  groups, g = rewards.shape
  if keep == groups:
    return seq, rewards
  if keep > groups:
    raise ValueError(f"cannot keep {keep} groups of {groups} sampled")
  tied = rewards.std(axis=1) == 0
  kept = np.sort(np.argsort(tied, kind="stable")[:keep])
  rows = (kept[:, None] * g + np.arange(g)).reshape(-1)
  return jax.tree.map(lambda x: x[rows], seq), rewards[kept]


def total_updates(config) -> int:
  return config.steps * config.epochs * config.minibatches


class GRPO:
  """The GRPO family as an `rl_loop.Algorithm`, configured by registry names."""

  def __init__(self, config, model_cfg):
    self.config = config
    self.model_cfg = model_cfg
    self.optimizer = optim_lib.make_optimizer(total_updates=total_updates(config),
                                              **config.optimizer)
    self.tx = self.optimizer.tx
    self.advantage_fn = registry.get("advantage", config.advantage)
    self.loss_fn = registry.get("policy_loss", config.policy_loss)
    # With one update per rollout the sampling policy is the current one: the
    # ratio is exactly 1, and recomputing old log-probs would be a wasted pass.
    self.on_policy = config.epochs * config.minibatches == 1
    # Rows sharing a prompt run it through the model once (see completion_hidden).
    self.prompt_group = config.group_size if config.get("share_prompt", False) else 1
    self._score = jax.jit(functools.partial(completion_logprobs, cfg=model_cfg,
                                            temperature=config.temperature,
                                            group_size=self.prompt_group))
    self._update = jax.jit(self._update_impl, donate_argnums=0)

  def init_state(self, params, rng):
    del rng
    ref = jax.tree.map(jnp.copy, params) if self.config.kl_coef else None
    return GRPOState(params=params, opt_state=self.tx.init(params), ref_params=ref,
                     updates=jnp.zeros((), jnp.int32))

  def policy_params(self, state):
    return state.params

  def nonfinite_count(self, state):
    return int(state.opt_state.notfinite_count), int(state.opt_state.total_notfinite)

  def prepare(self, state, r: rl_loop.Rollout, rng) -> GRPOBatch:
    del rng
    p, g = self.config.prompts_per_step, self.config.group_size
    seq, rewards = select_groups(r.seq, np.asarray(r.rewards).reshape(-1, g), p)
    advantages = self.advantage_fn(jnp.asarray(rewards),
                                   **self.config.advantage_kwargs).reshape(-1)
    zeros = jnp.zeros(seq.completion_tokens.shape, jnp.float32)
    old_logp = zeros if self.on_policy else self._score(state.params, batch=seq)[0]
    ref_logp = self._score(state.ref_params, batch=seq)[0] if self.config.kl_coef else zeros
    return GRPOBatch(seq=seq, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp)

  def update(self, state, batch, rng, progress):
    return self._update(state, batch, rng, jnp.float32(progress))

  def loss(self, params, batch: GRPOBatch):
    c = self.config
    mask = batch.seq.completion_mask
    logp, entropy = completion_logprobs(params, self.model_cfg, batch.seq,
                                        temperature=c.temperature, with_entropy=True,
                                        group_size=self.prompt_group)
    old_logp = jax.lax.stop_gradient(logp) if self.on_policy else batch.old_logp
    norm = c.max_new_tokens  # the "seq-mean-token-sum-norm" constant, fixed across steps
    loss, metrics = self.loss_fn(logp, old_logp, batch.advantages, mask,
                                 aggregation=c.aggregation, normalizer=norm, **c.loss_kwargs)
    if c.kl_coef:
      kl, _ = losses.kl_loss(logp, batch.ref_logp, mask, estimator=c.kl_estimator,
                             aggregation=c.aggregation, normalizer=norm)
      loss = loss + c.kl_coef * kl
      metrics["kl"] = kl
    if c.entropy_coef:
      bonus, _ = losses.entropy_bonus(entropy, mask, aggregation=c.aggregation,
                                      normalizer=norm)
      loss = loss - c.entropy_coef * bonus
    metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), mask)
    metrics["loss"] = loss
    return loss, metrics

  def _update_impl(self, state: GRPOState, batch: GRPOBatch, rng, progress):
    return optim_lib.update_state(self.optimizer, self.loss, state, batch, rng, progress,
                                  epochs=self.config.epochs,
                                  minibatches=self.config.minibatches,
                                  group_size=self.prompt_group)


def validate(config) -> None:
  """Fails on unknown names or inconsistent sizes before anything loads or compiles."""
  common.validate_common(config)
  registry.get("advantage", config.advantage)
  if config.advantage not in GROUP_ADVANTAGES:
    raise ValueError(f"advantage {config.advantage!r} is not a group estimator over f32[P, G] "
                     f"rewards; GRPO takes one of {sorted(GROUP_ADVANTAGES)} (GAE is PPO's)")
  registry.get("policy_loss", config.policy_loss)
  registry.get("aggregation", config.aggregation)
  if config.kl_coef:
    registry.get("kl", config.kl_estimator)
  if config.group_size < 2 and config.advantage in ("grpo", "dr_grpo", "rloo",
                                                    "reinforce_pp_baseline"):
    raise ValueError(f"advantage {config.advantage!r} needs group_size >= 2")


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) a GRPO experiment in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  algorithm = GRPO(config, model.cfg)
  return common.run_experiment(config, workdir, algorithm, model, progress=progress)


if __name__ == "__main__":
  common.main(train)
