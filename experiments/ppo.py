r"""PPO with a learned critic and token-level GAE on a task of prompts with verifiable rewards.

  python -m experiments.ppo --config=experiments/configs/ppo_arithmetic.py:tiny \
      --config.steps=3 --workdir=/tmp/ppo_tiny

The critic is a scalar value head on a decoder's final hidden states, either
on the policy's own backbone (`critic = "shared"`, one forward pass gives
logits and values, the value loss shares the gradient) or on a separate copy
of the initial backbone (`critic = "separate"`, the classic RLHF setup). The
outcome reward sits on the last completion token, optionally minus a per-token
KL penalty to the frozen initial policy; GAE (a reverse `lax.scan` over tokens)
turns rewards and the values recorded at rollout time into advantages and
returns; the update minimizes the registered policy loss plus `vf_coef` times
the clipped value loss.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from experiments import common
from jaxrl_agents import advantages as advantages_lib
from jaxrl_agents import losses, registry, rl_loop
from jaxrl_agents import optim as optim_lib
from jaxrl_agents.losses.aggregation import masked_mean
from jaxrl_agents.models import heads, transformer
from jaxrl_agents.rollout.scoring import (
    SequenceBatch,
    completion_hidden,
    completion_logprobs,
    token_logprobs,
)

CRITICS = ("shared", "separate")


class PPOState(NamedTuple):
  params: dict  # {"policy": decoder params, "value_head": head, "critic": decoder params | None}
  opt_state: optax.OptState
  ref_params: dict | None  # frozen reference policy for the KL penalty
  updates: jax.Array  # int32[]


class PPOBatch(NamedTuple):
  seq: SequenceBatch
  old_logp: jax.Array  # f32[B, N]
  old_values: jax.Array  # f32[B, N]
  advantages: jax.Array  # f32[B, N]
  returns: jax.Array  # f32[B, N]


class PPO:
  """PPO with a critic, as an `rl_loop.Algorithm`."""

  def __init__(self, config, model_cfg: transformer.TransformerConfig):
    if config.critic not in CRITICS:
      raise ValueError(f"config.critic must be one of {CRITICS}, got {config.critic!r}")
    self.config = config
    self.model_cfg = model_cfg
    n_updates = config.steps * config.epochs * config.minibatches
    self.optimizer = optim_lib.make_optimizer(total_updates=n_updates, **config.optimizer)
    self.tx = self.optimizer.tx
    self.loss_fn = registry.get("policy_loss", config.policy_loss)
    # Rows sharing a prompt run it through the model once (see completion_hidden).
    self.prompt_group = config.group_size if config.get("share_prompt", False) else 1
    self._forward = jax.jit(self.forward)
    self._score = jax.jit(functools.partial(completion_logprobs, cfg=model_cfg,
                                            temperature=config.temperature,
                                            group_size=self.prompt_group))
    self._update = jax.jit(self._update_impl, donate_argnums=0)

  def init_state(self, params, rng):
    trainable = {
        "policy": params,
        "value_head": heads.init_scalar_head(rng, self.model_cfg.d_model),
        "critic": jax.tree.map(jnp.copy, params) if self.config.critic == "separate" else None,
    }
    ref = jax.tree.map(jnp.copy, params) if self.config.kl_coef else None
    return PPOState(params=trainable, opt_state=self.tx.init(trainable), ref_params=ref,
                    updates=jnp.zeros((), jnp.int32))

  def policy_params(self, state):
    return state.params["policy"]

  def nonfinite_count(self, state):
    return int(state.opt_state.notfinite_count), int(state.opt_state.total_notfinite)

  def forward(self, params, seq: SequenceBatch, with_entropy: bool = False):
    """(logp f32[B, N], values f32[B, N], entropy f32[B, N] or None) of the completions."""
    hidden = completion_hidden(params["policy"], self.model_cfg, seq, group_size=self.prompt_group)
    logits = transformer.lm_head(params["policy"], hidden, self.model_cfg)
    logp, entropy = token_logprobs(logits, seq.completion_tokens, seq.completion_mask,
                                   temperature=self.config.temperature, with_entropy=with_entropy)
    if params["critic"] is not None:
      hidden = completion_hidden(params["critic"], self.model_cfg, seq,
                                 group_size=self.prompt_group)
    values = heads.apply_scalar_head(params["value_head"], hidden)
    return logp, jnp.where(seq.completion_mask, values, 0.0), entropy

  def prepare(self, state, r: rl_loop.Rollout, rng) -> PPOBatch:
    del rng
    c = self.config
    seq = r.seq
    mask = seq.completion_mask
    old_logp, old_values, _ = self._forward(state.params, seq)
    lengths = mask.sum(-1)
    last = jax.nn.one_hot(jnp.maximum(lengths - 1, 0), mask.shape[1], dtype=bool) & mask
    token_rewards = jnp.where(last, jnp.asarray(r.rewards)[:, None], 0.0)
    if c.kl_coef:
      ref_logp, _ = self._score(state.ref_params, batch=seq)
      token_rewards, _ = losses.kl_reward_penalty(token_rewards, old_logp, ref_logp, mask,
                                                  c.kl_coef, estimator=c.kl_estimator)
    # Padding after the last token: no reward, zero value, and done at the last
    # real token so nothing leaks backwards from the padding.
    adv, returns = advantages_lib.generalized_advantage_estimation(
        token_rewards, old_values, last, gamma=c.gamma, lam=c.gae_lambda)
    if c.normalize_advantages:
      mean = masked_mean(adv, mask)
      std = jnp.sqrt(masked_mean(jnp.square(adv - mean), mask))
      adv = (adv - mean) / (std + 1e-6)
    adv = jnp.where(mask, adv, 0.0)
    return PPOBatch(seq=seq, old_logp=old_logp, old_values=old_values, advantages=adv,
                    returns=returns)

  def update(self, state, batch, rng, progress):
    return self._update(state, batch, rng, jnp.float32(progress))

  def loss(self, params, batch: PPOBatch):
    c = self.config
    mask = batch.seq.completion_mask
    logp, values, entropy = self.forward(params, batch.seq, with_entropy=True)
    norm = c.max_new_tokens  # the "seq-mean-token-sum-norm" constant, fixed across steps
    pg_loss, metrics = self.loss_fn(logp, batch.old_logp, batch.advantages, mask,
                                    aggregation=c.aggregation, normalizer=norm, **c.loss_kwargs)
    v_loss, v_metrics = losses.clipped_value_loss(
        values, batch.old_values, batch.returns, mask, clip_eps=c.value_clip)
    loss = pg_loss + c.vf_coef * v_loss
    if c.entropy_coef:
      bonus, _ = losses.entropy_bonus(entropy, mask, aggregation=c.aggregation,
                                      normalizer=norm)
      loss = loss - c.entropy_coef * bonus
    return loss, {**metrics, **v_metrics, "loss": loss,
                  "entropy": masked_mean(jax.lax.stop_gradient(entropy), mask)}

  def _update_impl(self, state: PPOState, batch: PPOBatch, rng, progress):
    return optim_lib.update_state(self.optimizer, self.loss, state, batch, rng, progress,
                                  epochs=self.config.epochs,
                                  minibatches=self.config.minibatches,
                                  group_size=self.prompt_group)


def validate(config) -> None:
  common.validate_common(config)
  registry.get("policy_loss", config.policy_loss)
  registry.get("aggregation", config.aggregation)
  if config.kl_coef:
    registry.get("kl", config.kl_estimator)
  if config.critic not in CRITICS:
    raise ValueError(f"config.critic must be one of {CRITICS}, got {config.critic!r}")
  if config.get("oversample", 1) != 1:
    raise ValueError("config.oversample filters GRPO's groups by reward variance; PPO trains "
                     "on every sample (its critic is the baseline): set oversample=1")


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) a PPO experiment in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  return common.run_experiment(config, workdir, PPO(config, model.cfg), model,
                               progress=progress)


if __name__ == "__main__":
  common.main(train)
