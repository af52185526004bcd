r"""PPO with a learned critic and token-level GAE on a task of prompts with verifiable rewards.

  python -m experiments.ppo --config=experiments/configs/ppo_arithmetic.py:tiny \
      --config.steps=3 --workdir=/tmp/ppo_tiny

The critic is a scalar value head on a decoder's final hidden states, either
on the policy's own backbone (`critic = "shared"`, one forward pass gives
logits and values, the value loss shares the gradient) or on a separate copy
of the initial backbone (`critic = "separate"`, the classic RLHF setup); the
value head (and the separate backbone) learn with their own optimizer
(`critic_optimizer`: rate and AdamW settings over the policy's). The outcome
reward sits on the last policy token, optionally minus a per-token KL penalty
to the frozen initial policy; GAE (a reverse `lax.scan` over tokens) turns
rewards and the values recorded at rollout time into advantages and returns.
Over an environment's multi-turn episodes (`config.env`) each turn's reward sits
on its last token and `gae_level` picks the credit: "token" (GAE over the
policy tokens, the environment's skipped), "turn" (GAE over turns, each token
its turn's) or "bilevel" (turn-level, then token-level inside each turn;
RAGEN's and VAGEN's); see `jaxrl_agents.objectives.credit`. Then
the update minimizes the policy objective (`objective.py`, shared with GRPO)
plus `vf_coef` times the clipped value loss.

The hyperparameters are read from the config once (`PPOSettings`); the
forward pass, the loss and the update are pure functions of arrays and those
static settings.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from experiments import common
from jaxrl_agents import registry, types
from jaxrl_agents.models import heads, lm, lora
from jaxrl_agents.objectives import advantages as advantages_lib
from jaxrl_agents.objectives import credit, losses
from jaxrl_agents.objectives import policy_objective as objective_lib
from jaxrl_agents.parallel import sharding
from jaxrl_agents.rollout import env_loop, records, scoring
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib


class PPOState(NamedTuple):
  params: dict  # {"policy": decoder params, "value_head": head, "critic": decoder params | None}
  opt_state: optax.OptState
  ref_params: dict | None  # frozen reference policy for the KL penalty
  updates: jax.Array  # int32[]


class PPOBatch(NamedTuple):
  traj: types.Trajectory
  old_logp: jax.Array  # f32[B, T]
  old_values: jax.Array  # f32[B, T]
  advantages: jax.Array  # f32[B, T]
  returns: jax.Array  # f32[B, T]


@dataclasses.dataclass(frozen=True)
class PPOSettings:
  """PPO's static hyperparameters, read from the config once (hashable: jit keys on it).

  Attributes:
    objective: the policy loss's hyperparameters (its KL term off: PPO's KL is a
      reward penalty, `kl_coef` x `kl_estimator` per token).
    critic: a registered "critic" (models/heads.py: "shared", "separate").
    gamma, gae_lambda: GAE's discount and lambda.
    normalize_advantages: standardize the advantages over the batch's policy tokens.
    vf_coef: weight of the value loss.
    value_clip: clip range of the value loss.
    kl_coef, kl_estimator: the KL reward penalty.
    epochs, minibatches: passes over the batch and updates per pass.
    prompt_group: rows per shared prompt in scoring (1: each row runs its prompt).
    gae_level: a registered "gae_level" (objectives/credit/gae.py: multi-turn credit;
      single-turn streams: "token").
    turn_gamma, turn_lam: the turn-level discount and lambda ("turn", "bilevel").
    logprob_chunk: > 0: the policy's log-probabilities from the hidden states this many
      columns at a time (`scoring.hidden_logprobs`), never the whole [B, N, V] logits.
  """

  objective: objective_lib.PolicyObjective
  critic: str = "shared"
  gamma: float = 1.0
  gae_lambda: float = 0.95
  normalize_advantages: bool = True
  vf_coef: float = 0.1
  value_clip: float = 0.2
  kl_coef: float = 0.0
  kl_estimator: str = "k1"
  epochs: int = 1
  minibatches: int = 1
  prompt_group: int = 1
  gae_level: str = "token"
  turn_gamma: float = 1.0
  turn_lam: float = 0.95
  logprob_chunk: int = 0


def settings_from_config(config) -> PPOSettings:
  registry.check_name("critic", config.critic, "config.critic")
  return PPOSettings(
      objective=dataclasses.replace(common.objective_settings(config), kl_on=False),
      critic=config.critic, gamma=float(config.gamma), gae_lambda=float(config.gae_lambda),
      normalize_advantages=bool(config.normalize_advantages), vf_coef=float(config.vf_coef),
      value_clip=float(config.value_clip), kl_coef=float(config.kl_coef),
      kl_estimator=config.kl_estimator, epochs=config.epochs, minibatches=config.minibatches,
      prompt_group=config.group_size if config.get("share_prompt", False) else 1,
      gae_level=config.get("gae_level", "token"), turn_gamma=float(config.get("turn_gamma", 1.0)),
      turn_lam=float(config.get("turn_lam", 0.95)),
      logprob_chunk=int(config.get("logprob_chunk", 0)))


def forward(params, traj: types.Trajectory, *, cfg: lm.CausalLM,
            s: PPOSettings, with_entropy: bool = False):
  """(logp f32[B, T], values f32[B, T], entropy f32[B, T] or None) at the policy tokens."""
  mask = traj.policy_mask
  hidden = scoring.policy_hidden(params["policy"], cfg, traj, group_size=s.prompt_group)
  tokens, scored_mask = scoring.scored(traj, traj.tokens), scoring.scored(traj, mask)
  if s.logprob_chunk:
    logp, entropy = scoring.hidden_logprobs(
        lambda h: cfg.lm_head(params["policy"], h), hidden, tokens, scored_mask,
        chunk=s.logprob_chunk, temperature=s.objective.temperature, with_entropy=with_entropy)
  else:
    logp, entropy = scoring.token_logprobs(cfg.lm_head(params["policy"], hidden), tokens,
                                           scored_mask, temperature=s.objective.temperature,
                                           with_entropy=with_entropy)
  if params["critic"] is not None:
    hidden = scoring.policy_hidden(params["critic"], cfg, traj, group_size=s.prompt_group)
  values = scoring.to_stream(heads.apply_scalar_head(params["value_head"], hidden), traj)
  return (scoring.to_stream(logp, traj), jnp.where(mask, values, 0.0),
          None if entropy is None else scoring.to_stream(entropy, traj))


def gae_targets(s: PPOSettings, traj: types.Trajectory, old_logp, old_values, ref_logp
                ) -> tuple[jax.Array, jax.Array]:
  """(advantages f32[B, T], returns f32[B, T]): each turn's reward on its last policy token
  (single-turn: the outcome on the last one), minus the KL penalty, through GAE at
  `s.gae_level`."""
  mask = traj.policy_mask
  token_rewards = credit.rewards_at_turn_ends(traj.turn_rewards, traj.turn_id, mask,
                                              traj.turn_mask)
  if s.kl_coef:  # (validate: only with gae_level "token", which reads the token rewards)
    token_rewards, _ = losses.kl_reward_penalty(token_rewards, old_logp, ref_logp, mask,
                                                s.kl_coef, estimator=s.kl_estimator)
  adv, returns = registry.get("gae_level", s.gae_level)(
      traj, token_rewards, old_values, gamma=s.gamma, lam=s.gae_lambda,
      turn_gamma=s.turn_gamma, turn_lam=s.turn_lam)
  if s.normalize_advantages:
    adv = advantages_lib.standardize(adv, mask)
  return jnp.where(mask, adv, 0.0), returns


def ppo_loss(params, batch: PPOBatch, *, cfg: lm.CausalLM, s: PPOSettings):
  """Policy objective + vf_coef x clipped value loss on one (mini)batch: (loss, metrics)."""
  mask = batch.traj.policy_mask
  logp, values, entropy = forward(params, batch.traj, cfg=cfg, s=s, with_entropy=True)
  loss, metrics = objective_lib.policy_objective(s.objective, logp, entropy, batch.old_logp,
                                                 batch.advantages, mask)
  v_loss, v_metrics = losses.clipped_value_loss(values, batch.old_values, batch.returns, mask,
                                                clip_eps=s.value_clip)
  loss = loss + s.vf_coef * v_loss
  return loss, {**metrics, **v_metrics, "loss": loss}


def critic_labels(params) -> dict:
  """Optimizer group of each parameter: the value head and a separate critic are "critic"."""
  return {name: jax.tree.map(lambda _, n=name: "default" if n == "policy" else "critic", tree)
          for name, tree in params.items()}


class PPO:
  """PPO's train state, batch preparation (GAE targets) and jitted update over PPOSettings
  (what `train`'s step calls)."""

  def __init__(self, config, model_cfg: lm.CausalLM):
    self.settings = s = settings_from_config(config)
    self.model_cfg = model_cfg
    n_updates = config.steps * config.epochs * config.minibatches
    critic_settings = dict(config.get("critic_optimizer", {}))
    self.optimizer = optim_lib.make_optimizer(
        total_updates=n_updates, **config.optimizer,
        groups={"critic": critic_settings}, label_fn=critic_labels)
    self.tx = self.optimizer.tx
    self._forward = jax.jit(functools.partial(forward, cfg=model_cfg, s=s))
    self._score = jax.jit(functools.partial(scoring.policy_logprobs, cfg=model_cfg,
                                            temperature=s.objective.temperature,
                                            group_size=s.prompt_group,
                                            chunk=s.logprob_chunk))
    self._targets = jax.jit(functools.partial(gae_targets, s))
    loss = functools.partial(ppo_loss, cfg=model_cfg, s=s)
    self._update = jax.jit(functools.partial(
        optim_lib.update_state, self.optimizer, loss, epochs=s.epochs, minibatches=s.minibatches,
        group_size=s.prompt_group), donate_argnums=0)

  def init_state(self, params, rng):
    trainable = {
        "policy": params,
        "value_head": heads.init_scalar_head(rng, self.model_cfg.d_model),
        "critic": registry.get("critic", self.settings.critic)(params),
    }
    ref = lora.reference_copy(params) if self.settings.kl_coef else None
    return PPOState(params=trainable, opt_state=self.tx.init(trainable), ref_params=ref,
                    updates=jnp.zeros((), jnp.int32))

  def prepare(self, state, r: types.Rollout, rng) -> PPOBatch:
    del rng
    traj = r.traj
    old_logp, old_values, _ = self._forward(state.params, traj)
    ref = lora.reference(state.ref_params, state.params["policy"]) if self.settings.kl_coef \
        else None
    ref_logp = self._score(ref, traj=traj)[0] if ref is not None else jnp.zeros_like(old_logp)
    adv, returns = self._targets(traj, old_logp, old_values, ref_logp)
    return PPOBatch(traj=traj, old_logp=old_logp, old_values=old_values, advantages=adv,
                    returns=returns)

  def update(self, state, batch, rng, progress):
    return self._update(state, batch, rng, jnp.float32(progress))


def validate(config) -> None:
  common.validate_common(config)
  if common.trains_reward_model(config):
    raise ValueError("reward_model_beside trains the reward model inside GRPO's train state; "
                     "PPO does not: set reward_model_beside.pairs_per_step=0")
  if config.kl_coef:
    registry.get("kl", config.kl_estimator)
  settings_from_config(config)  # names, per-loss hyperparameters, critic
  controller = config.get("kl_controller", None)
  if controller and controller.name != "fixed":
    raise ValueError(f"kl_controller {controller.name!r} is GRPO's; PPO's KL is a reward "
                     "penalty with the fixed coefficient kl_coef (set kl_controller.name='fixed')")
  if config.get("overlap", False):
    raise ValueError("config.overlap is GRPO's for now: PPO's critic and GAE would need their "
                     "own off-policy treatment; set overlap=False")
  if config.get("off_policy", None) and config.off_policy.correction != "none":
    raise ValueError("config.off_policy.correction is GRPO's for now; set it to 'none'")
  if config.get("oversample", 1) != 1:
    raise ValueError("config.oversample filters GRPO's groups by reward variance; PPO trains "
                     "on every sample (its critic is the baseline): set oversample=1")
  if config.get("drop_tied_groups", False):
    raise ValueError("config.drop_tied_groups masks GRPO's groups whose rewards tie; PPO has no "
                     "groups (its critic is the baseline): set drop_tied_groups=False")
  if config.get("skip_zero_advantage_rows", False):
    raise ValueError("config.skip_zero_advantage_rows leaves GRPO's rows without advantage out "
                     "of the update; PPO's value loss trains on every row: set it to False")
  if config.get("resample_rounds", 0):
    raise ValueError("config.resample_rounds samples again until enough GRPO groups have "
                     "reward variance; PPO trains on every sample: set resample_rounds=0")
  if config.get("ema_decay", 0.0):
    raise ValueError("config.ema_decay (the evaluated moving average of the policy) is GRPO's "
                     "for now; set it to 0")
  level = config.get("gae_level", "token")
  registry.check_name("gae_level", level, "gae_level")
  if level != "token" and not config.get("env"):
    raise ValueError(f"gae_level {level!r} assigns credit across the turns of an environment's "
                     "episodes; set config.env (a single-turn run has one turn)")
  if level != "token" and config.kl_coef:
    raise ValueError(f"the KL penalty is per token; gae_level {level!r} reads turn rewards: "
                     "use gae_level='token' or kl_coef=0")
  turn_credit = config.get("turn_credit", None)
  if turn_credit is not None and turn_credit.name != "episode":
    raise ValueError(f"turn_credit {turn_credit.name!r} is GRPO's; PPO's multi-turn credit is "
                     "gae_level ('token', 'turn' or 'bilevel')")
  for key in ("turn_gamma", "turn_lam"):
    if not 0 <= config.get(key, 0.5) <= 1:
      raise ValueError(f"{key} must be in [0, 1], got {config.get(key)}")


def episode_credit(config) -> env_loop.Credit:
  """What PPO's gae_level asks of an environment's episodes: potential-based shaping
  discounts per turn by the credit's own turn_gamma; token-level GAE discounts tokens, not
  turns, so it takes shaping only undiscounted (gamma = 1)."""
  level = config.get("gae_level", "token")
  shaping = None
  if config.get("potential_shaping", False):
    if level == "token" and config.gamma != 1:
      raise ValueError("potential_shaping discounts per turn, PPO's gae_level 'token' per "
                       f"token: use gamma=1 with it (got {config.gamma}) or gae_level "
                       "'turn'/'bilevel'")
    shaping = 1.0 if level == "token" else float(config.turn_gamma)
  return env_loop.Credit(name=f"gae_level {level!r}", shaping_gamma=shaping)


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) a PPO experiment in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  ppo = PPO(config, model.cfg)
  collect, evaluate, data = common.episodes(config, model, episode_credit(config))
  mesh = sharding.for_config(config)
  watch = records.NoSignalWatch()  # warns when the gradient is zero step after step

  token_budget = common.policy_token_budget(config)

  def init_state():
    return ppo.init_state(model.params, common.init_key(config))

  def train_step(state, rng, progress_fraction) -> harness.StepResult:
    rollout_rng, prepare_rng, update_rng = jax.random.split(rng, 3)
    t0 = time.perf_counter()
    r, extra = collect(state.params["policy"], next(data), rollout_rng)
    t1 = time.perf_counter()
    rollout_s = t1 - t0
    rows = r.traj.tokens.shape[0]  # rows split over the mesh's data x fsdp devices
    r = dataclasses.replace(r, traj=sharding.shard_batch(r.traj, mesh))
    batch = sharding.shard_batch(ppo.prepare(state, r, prepare_rng), mesh, rows=rows)
    state, metrics = ppo.update(state, batch, update_rng, progress_fraction)
    metrics = jax.device_get(metrics)
    record = records.step_record(
        r, extra, metrics, group_size=config.group_size,
        policy_token_budget=token_budget, epochs=config.get("epochs", 1),
        skipped_updates=optim_lib.nonfinite_count(state)[1], rollout_s=rollout_s,
        update_s=time.perf_counter() - t1)
    return harness.StepResult(state, watch(record), records.rollout_samples(r))

  run_eval = None if evaluate is None else (lambda state: evaluate(state.params["policy"]))
  return harness.run(config, workdir, init_state=init_state, train_step=train_step,
                     evaluate=run_eval, data=data, nonfinite_count=optim_lib.nonfinite_count,
                     progress=progress, resume_rules=common.RESUME_RULES,
                     frozen=common.frozen_reward_models(config), **records.LOGGED)


if __name__ == "__main__":
  common.main(train)
