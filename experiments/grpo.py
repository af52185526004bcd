r"""GRPO (and its variants, by config) on a task of prompts with verifiable rewards.

  python -m experiments.grpo --config=experiments/configs/grpo_arithmetic.py:tiny \
      --config.steps=3 --workdir=/tmp/grpo_tiny

One step: sample P prompts, G completions each (the jitted KV-cache sampler),
score them with the configured rewards, turn the [P, G] rewards (or the
[P, G, M] reward components, for a component estimator such as GDPO) into
advantages with a registered estimator (in an environment run, optionally
per turn: `turn_credit`), then run `epochs` passes of
`minibatches` optimizer updates of the policy objective (`objective.py`: a
registered policy loss, token control, KL to the frozen initial policy with a
fixed or controlled coefficient, entropy bonus), all in one jitted `lax.scan`.
`train` holds the step (`train_step`: collect, optional resampling, the update, the
record); the workdir layout, resume and logging are the run harness's (`harness.run`).

The hyperparameters are read from the config once (`GRPOSettings`); the loss
and the update are pure functions of arrays and those static settings.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common, reward_beside
from jaxrl_agents import registry, types
from jaxrl_agents.models import lm, lora
from jaxrl_agents.objectives import credit
from jaxrl_agents.objectives import policy_objective as objective_lib
from jaxrl_agents.objectives.losses import kl as kl_lib
from jaxrl_agents.objectives.losses import kl_control
from jaxrl_agents.parallel import sharding
from jaxrl_agents.rollout import env_loop, groups, packing, records, scoring, self_play
from jaxrl_agents.train import harness, overlap, precompile
from jaxrl_agents.train import optim as optim_lib

log = logging.getLogger(__name__)


class GRPOState(NamedTuple):
  params: dict  # the policy
  opt_state: optax.OptState
  ref_params: dict | None  # frozen reference policy; None without a KL term
  updates: jax.Array  # int32[] optimizer updates so far (the schedule's position)
  kl_ctl: kl_control.KLControllerState | None  # the KL coefficient; None without a KL term
  # Self-play's per-role return baselines (advantage "rae"); None otherwise.
  role_baseline: credit.RoleBaselineState | None = None
  # The reward model trained beside the policy (config.reward_model_beside); None otherwise.
  reward_model: Any = None
  # The moving average of the policy's parameters that evaluation and export read
  # (config.ema_decay); None otherwise.
  ema_params: dict | None = None


class GRPOBatch(NamedTuple):
  traj: types.Trajectory
  advantages: jax.Array  # f32[B] per episode, or f32[B, T] per token (turn-level credit)
  old_logp: jax.Array  # f32[B, T] log-probs under the sampling policy (recomputed)
  ref_logp: jax.Array  # f32[B, T] under the reference (zeros without a sampled-token KL)
  correct: jax.Array  # f32[B] the grader's verdicts (an accuracy-conditioned KL reads them)
  # Advantage "rae": the role baselines after this batch's returns (the update stores them).
  role_baseline: credit.RoleBaselineState | None = None
  # The reward model's labelled pairs of this step's replies (reward_beside.RewardModelBeside
  # .batch), or None: it trains on them after the policy's update.
  reward_pairs: Any = None
  # config.pack_replies: bool[M], whose length M is the static number of packed slots
  # per minibatch (`scoring.packed_slots`); None: the update scores padded rows.
  packed_slots: jax.Array | None = None
  # config.skip_zero_advantage_rows: f32[] the factor that makes the loss the one of the
  # batch before its rows without advantage were left out (`skipped_loss_scale`); None: 1.
  loss_scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
  """GRPO's static hyperparameters, read from the config once (hashable: jit keys on it).

  Attributes:
    objective: the policy loss's hyperparameters.
    advantage: a registered "group_advantage" or "component_advantage" name.
    advantage_kwargs: its keyword arguments, sorted (name, value) pairs.
    component_weights: (reward name, weight) of the reward components, in the
      config's order (a component estimator's M axis).
    prompts_per_step: P, groups per update.
    group_size: G.
    epochs, minibatches: passes over the batch and updates per pass.
    share_prompt: run each group's prompt through the model once per update.
    pack_replies, pack_below, pack_width, pack_compile_ahead: packing's rule
      (`rollout/packing.py`): with share_prompt the update scores only the reply tokens,
      packed into slots, where they are at most `pack_below` of the padded rows' reply
      columns (padded to `pack_width`); after each update the programs for the next
      `pack_compile_ahead` slot counts compile in the background.
    drop_tied_groups: the update leaves out the kept groups whose rewards tie
      (`without_tied_groups`): the token mean is over the groups that vary, and a
      packed update pays for their replies only (a KL or entropy term loses the
      tied rows' share).
    skip_zero_advantage_rows: the update leaves out the rows whose advantages are all 0
      (every row of a group whose rewards tie) and scales its loss so that its
      gradient is the one of training on them (`without_zero_advantage_rows`): the
      same step, for the other rows' compute only.
    kl_controller: a registered "kl_controller" (fixed, adaptive, accuracy).
    kl_controller_kwargs: its hyperparameters, sorted (name, value) pairs.
    kl_coef: the fixed (or initial) KL coefficient.
    turn_credit: how an episode's advantage reaches its turns (a registered "turn_credit").
    turn_gamma: the discount per turn of turn-level returns (and of shaping).
    step_weight: GiGPO's weight of the step-group advantage.
    behavior_logp: the loss reads the sampler's log-probabilities (`config.overlap`, or an
      off-policy correction): it logs the distance to them and corrects by them.
    logprob_chunk: > 0: the log-probabilities are computed from the hidden states that many
      columns at a time (`scoring.hidden_logprobs`), never holding the whole [B, N, V]
      vocabulary logits; 0: in one piece.
    ema_decay: where > 0, the train state keeps the exponential moving average of the
      policy's parameters over updates (`optim.polyak_average`), and evaluation and
      export read it (the rollouts still sample the policy itself); evaluation reports the
      policy's own figures beside it under `online/`. 0: off.
  """

  objective: objective_lib.PolicyObjective
  advantage: str = "grpo"
  advantage_kwargs: tuple[tuple[str, Any], ...] = ()
  component_weights: tuple[tuple[str, float], ...] = ()
  prompts_per_step: int = 4
  group_size: int = 8
  epochs: int = 1
  minibatches: int = 1
  share_prompt: bool = False
  pack_replies: bool = False
  pack_below: float = 0.5
  pack_width: int = 0
  pack_compile_ahead: int = 0
  drop_tied_groups: bool = False
  skip_zero_advantage_rows: bool = False
  kl_controller: str = "fixed"
  kl_controller_kwargs: tuple[tuple[str, Any], ...] = ()
  kl_coef: float = 0.0
  turn_credit: str = "episode"
  turn_gamma: float = 1.0
  step_weight: float = 1.0
  behavior_logp: bool = False
  ema_decay: float = 0.0
  logprob_chunk: int = 0

  @property
  def on_policy(self) -> bool:
    # With one update per rollout the policy the update starts from is the current
    # one: the ratio is exactly 1, and recomputing old log-probs would be a wasted
    # pass (an overlapped rollout's lag is the off-policy correction's business).
    return self.epochs * self.minibatches == 1

  @property
  def prompt_group(self) -> int:
    """Rows per shared prompt in scoring (see scoring.policy_hidden)."""
    return self.group_size if self.share_prompt else 1

  @property
  def component_advantage(self) -> bool:
    return self.advantage in registry.names("component_advantage")


# Self-play's advantage (a two-player environment, `rollout.self_play`): SPIRAL's
# role-conditioned advantage estimation, "SPIRAL: Self-Play on Zero-Sum Games Incentivizes
# Reasoning via Multi-Agent Multi-Turn Reinforcement Learning". Each row's return less an
# exponential moving average of its side's returns (`credit.role_baseline`, carried in the
# train state), so the first mover's edge is not credited to its moves. advantage_kwargs:
# decay (the paper's 0.95).
ROLE_ADVANTAGE = self_play.ADVANTAGE
ROLES = self_play.PLAYERS


def make_kl_controller(s: GRPOSettings) -> kl_control.KLController:
  """The registered controller `s.kl_controller` (registry kind "kl_controller")."""
  return registry.get("kl_controller", s.kl_controller)(s.kl_coef,
                                                         **dict(s.kl_controller_kwargs))


def settings_from_config(config) -> GRPOSettings:
  """GRPOSettings of a GRPO config (see experiments/configs/grpo_arithmetic.py)."""
  controller = config.get("kl_controller", None)
  name = controller.name if controller else "fixed"
  registry.check_name("kl_controller", name, "kl_controller.name")
  kl_kwargs = tuple((k, float(v)) for k, v in
                    registry.options("kl_controller", name, controller or {}).items())
  if name != "fixed" and not config.kl_coef > 0:
    raise ValueError(f"kl_controller {name!r} moves the KL coefficient from kl_coef: set "
                     f"kl_coef > 0 (got {config.kl_coef})")
  rows = config.prompts_per_step * config.group_size
  if config.advantage == ROLE_ADVANTAGE:
    rows *= ROLES  # a row per side of each game
  if name == "adaptive" and controller.horizon < rows:
    raise ValueError(f"kl_controller.horizon {controller.horizon} is shorter than the {rows} "
                     "samples of one update: one step could move beta by more than 20% (and "
                     "below zero)")
  settings = GRPOSettings(
      objective=common.objective_settings(config),
      advantage=config.advantage,
      advantage_kwargs=tuple(sorted(dict(config.advantage_kwargs).items())),
      component_weights=tuple(common.reward_weights(config).items()),
      prompts_per_step=config.prompts_per_step, group_size=config.group_size,
      epochs=config.epochs, minibatches=config.minibatches,
      share_prompt=config.get("share_prompt", False),
      pack_replies=config.get("share_prompt", False) and config.get("pack_replies", False),
      pack_below=float(config.get("pack_below", GRPOSettings.pack_below)),
      pack_width=int(config.get("max_new_tokens", 0)),
      pack_compile_ahead=int(config.get("pack_compile_ahead", 0)),
      drop_tied_groups=bool(config.get("drop_tied_groups", False)),
      skip_zero_advantage_rows=bool(config.get("skip_zero_advantage_rows", False)),
      kl_controller=name, kl_controller_kwargs=kl_kwargs, kl_coef=float(config.kl_coef),
      ema_decay=float(config.get("ema_decay", 0.0)),
      logprob_chunk=config.get("logprob_chunk", 0), **_turn_credit_settings(config))
  correction = settings.objective.off_policy_correction
  if config.get("overlap", False) or correction != "none":
    settings = dataclasses.replace(settings, behavior_logp=True)
  if settings.objective.kl_on:
    make_kl_controller(settings)  # its own checks (e.g. adaptive's target > 0)
  return settings


def _turn_credit_settings(config) -> dict:
  tc = config.get("turn_credit", None)
  if tc is None:
    return {}
  registry.check_name("turn_credit", tc.name, "turn_credit.name")
  if not 0 < tc.gamma <= 1:
    raise ValueError(f"turn_credit.gamma must be in (0, 1], got {tc.gamma}")
  if not tc.step_weight >= 0:
    raise ValueError(f"turn_credit.step_weight must be >= 0, got {tc.step_weight}")
  if tc.name != "episode" and not config.get("env"):
    raise ValueError(f"turn_credit {tc.name!r} assigns credit to the turns of an environment's "
                     "episodes; set config.env (a single-turn run has one turn)")
  if tc.name in ("turn", "igpo") and config.advantage != "grpo":
    raise ValueError(f"turn_credit {tc.name!r} standardizes turn rewards within each group itself; "
                     f"it does not use advantage {config.advantage!r}: set advantage='grpo'")
  return dict(turn_credit=tc.name, turn_gamma=float(tc.gamma),
              step_weight=float(tc.step_weight))


def group_advantages(s: GRPOSettings, r: types.Rollout
                     ) -> tuple[types.Trajectory, jax.Array, np.ndarray]:
  """The kept groups' rows, their f32[B] advantages (a registered estimator) and verdicts."""
  g = s.group_size
  totals = np.asarray(r.rewards).reshape(-1, g)
  kept = groups.kept_groups(totals, s.prompts_per_step)
  rows = groups.group_rows(kept, g)
  traj = r.traj if len(kept) == totals.shape[0] else jax.tree.map(lambda x: x[rows], r.traj)
  kwargs = dict(s.advantage_kwargs)
  if s.component_advantage:
    names = [name for name, _ in s.component_weights]
    components = np.stack([r.components[n] for n in names], axis=-1)[rows]
    advantages = registry.get("component_advantage", s.advantage)(
        jnp.asarray(components.reshape(-1, g, len(names))),
        jnp.asarray([w for _, w in s.component_weights], jnp.float32), **kwargs)
  else:
    advantages = registry.get("group_advantage", s.advantage)(jnp.asarray(totals[kept]),
                                                              **kwargs)
  advantages = advantages.reshape(-1)
  if s.turn_credit != "episode":
    keys = None if r.turn_keys is None else jnp.asarray(np.asarray(r.turn_keys)[rows])
    advantages = turn_advantages(s, traj, advantages, keys)
  if s.drop_tied_groups:
    traj = groups.without_tied_groups(traj, totals[kept], g)
  return traj, advantages, np.asarray(r.correct, np.float32)[rows]


def role_baseline(s: GRPOSettings) -> credit.RoleBaseline:
  """The per-side return baselines (`self_play.role_baseline`)."""
  return self_play.role_baseline(**dict(s.advantage_kwargs))


def role_advantages(s: GRPOSettings, r: types.Rollout, baseline: credit.RoleBaselineState
                    ) -> tuple[jax.Array, credit.RoleBaselineState]:
  """Self-play's f32[B] advantages (ROLE_ADVANTAGE) and the baselines after these returns."""
  return self_play.role_advantages(r, baseline, **dict(s.advantage_kwargs))


def turn_advantages(s: GRPOSettings, traj: types.Trajectory, episode_adv: jax.Array,
                    turn_keys: jax.Array | None) -> jax.Array:
  """f32[B, T] token advantages of multi-turn episodes by `s.turn_credit` (registry kind
  "turn_credit", objectives/credit/turn_credits.py)."""
  return registry.get("turn_credit", s.turn_credit)(
      episode_adv, traj, turn_keys, group_size=s.group_size, gamma=s.turn_gamma,
      step_weight=s.step_weight)


def grpo_loss(params, batch: GRPOBatch, *, cfg: lm.CausalLM, s: GRPOSettings,
              ref_params=None, beta=0.0, slots: int | None = None, loss_scale=None):
  """The policy objective on one (mini)batch: (loss, metrics). With `slots`, the policy
  tokens are scored packed into that many slots (`scoring.packed_policy_hidden`): the
  same values at the policy tokens, entropy 0 elsewhere (the loss reads neither there).
  `loss_scale` multiplies the loss (`without_zero_advantage_rows`)."""
  hp = s.objective
  traj = batch.traj
  mask = traj.policy_mask
  if slots is None:
    hidden_of = lambda p: scoring.policy_hidden(p, cfg, traj, group_size=s.prompt_group)
    hidden = hidden_of(params)
    tokens, scored_mask = scoring.scored(traj, traj.tokens), scoring.scored(traj, mask)
    to_stream = lambda x: scoring.to_stream(x, traj)
  else:  # M packed tokens: hidden f[M, D], tokens and mask [M]
    packed_hidden = lambda p: scoring.packed_policy_hidden(p, cfg, traj, group_size=s.prompt_group,
                                                           slots=slots)
    hidden_of = lambda p: packed_hidden(p)[0]
    hidden, packing = packed_hidden(params)
    tokens, scored_mask = scoring.packed_tokens(traj, packing), packing.valid
    to_stream = lambda x: scoring.unpack(x, packing, traj)
  # The head takes rows of columns: a packed stream is one row.
  logits_of = lambda p, h: (cfg.lm_head(p, h) if slots is None else cfg.lm_head(p, h[None])[0])
  if s.logprob_chunk:  # never the whole [B, N, V] logits (validate: not with the forward KL)
    logp, entropy = scoring.hidden_logprobs(
        lambda h: cfg.lm_head(params, h), hidden, tokens, scored_mask, chunk=s.logprob_chunk,
        temperature=hp.temperature, with_entropy=True)
  else:
    logits = logits_of(params, hidden)
    logp, entropy = scoring.token_logprobs(logits, tokens, scored_mask,
                                           temperature=hp.temperature, with_entropy=True)
  logp, entropy = to_stream(logp), to_stream(entropy)
  kl_per_token = None
  if hp.needs_ref_logits:
    ref_logits = jax.lax.stop_gradient(logits_of(ref_params, hidden_of(ref_params)))
    kl_per_token = to_stream(kl_lib.forward_kl_from_logits(
        logits / hp.temperature, ref_logits / hp.temperature))
  old_logp = jax.lax.stop_gradient(logp) if s.on_policy else batch.old_logp
  loss, metrics = objective_lib.policy_objective(
      hp, logp, entropy, old_logp, batch.advantages, mask, beta=beta, ref_logp=batch.ref_logp,
      kl_per_token=kl_per_token, behavior_logp=traj.sampling_logprobs if s.behavior_logp else None)
  if loss_scale is not None:  # (no KL or entropy term: validate) the loss is pg_loss
    loss = loss * loss_scale
    metrics = {**metrics, "loss": loss, "pg_loss": metrics["pg_loss"] * loss_scale}
  if slots is not None:  # tokens left without a slot: skip the update (counted), never train
    loss = jnp.where(packing.complete, loss, jnp.nan)
  return loss, metrics


def grpo_update(state: GRPOState, batch: GRPOBatch, rng, progress, *,
                optimizer: optim_lib.Optimizer, cfg: lm.CausalLM,
                s: GRPOSettings):
  """One rollout's updates, then the KL controller's step: (state, metrics)."""
  beta = state.kl_ctl.beta if state.kl_ctl is not None else 0.0
  # Not per row: the role baselines, the packed slots (only their count matters), the
  # loss's scale.
  baseline, packed, scale = batch.role_baseline, batch.packed_slots, batch.loss_scale
  batch = batch._replace(role_baseline=None, packed_slots=None, loss_scale=None)
  loss = functools.partial(grpo_loss, cfg=cfg, s=s,
                           ref_params=lora.reference(state.ref_params, state.params), beta=beta,
                           slots=None if packed is None else packed.shape[0], loss_scale=scale)
  updates_before = state.updates
  state, metrics = optim_lib.update_state(optimizer, loss, state, batch, rng, progress,
                                          epochs=s.epochs, minibatches=s.minibatches,
                                          group_size=s.prompt_group)
  if state.ema_params is not None:
    state = state._replace(ema_params=optim_lib.polyak_average(
        state.ema_params, state.params, state.updates, s.ema_decay))
  if baseline is not None:  # the returns happened, whatever the update did
    state = state._replace(role_baseline=baseline)
    metrics = {**metrics, **{f"role_baseline/player{p}": baseline.baseline[p]
                             for p in range(ROLES)}}
  if state.kl_ctl is not None:
    controller = make_kl_controller(s)
    moved = controller.update(state.kl_ctl, observed_kl=metrics["kl"],
                              n_steps=batch.advantages.shape[0],
                              accuracy=jnp.mean(batch.correct))
    # A step whose updates were all skipped (non-finite) moves neither the policy
    # nor the coefficient: a NaN KL must not poison beta for the rest of the run. Nor
    # does a step that measured no KL (no policy token: every group tied and dropped)
    # move the adaptive controller, which reads the KL; the accuracy one does not.
    kl_read = jnp.isfinite(metrics["kl"]) if controller.reads_kl else True
    ok = kl_read & (state.updates > updates_before) & jnp.isfinite(moved.beta)
    state = state._replace(kl_ctl=jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                               moved, state.kl_ctl))
  return state, metrics


def total_updates(config) -> int:
  return config.steps * config.epochs * config.minibatches


class GRPO:
  """The GRPO family's train state, batch preparation and jitted update over GRPOSettings
  (what `train`'s step calls)."""

  def __init__(self, config, model_cfg):
    self.settings = s = settings_from_config(config)
    self.model_cfg = model_cfg
    self.optimizer = optim_lib.make_optimizer(total_updates=total_updates(config),
                                              **config.optimizer)
    self.tx = self.optimizer.tx
    self._score = jax.jit(functools.partial(scoring.policy_logprobs, cfg=model_cfg,
                                            temperature=s.objective.temperature,
                                            group_size=s.prompt_group, chunk=s.logprob_chunk))
    self._update = precompile.Precompiled(jax.jit(functools.partial(
        grpo_update, optimizer=self.optimizer, cfg=model_cfg, s=s), donate_argnums=0),
        "grpo_update")
    self.beside = (reward_beside.RewardModelBeside(config) if reward_beside.enabled(config)
                   else None)
    self.packing = packing.Packing(
        model_cfg, enabled=s.pack_replies, below=s.pack_below, width=s.pack_width,
        ahead=s.pack_compile_ahead, minibatches=s.minibatches,
        group_size=s.prompt_group, columns=("advantages", "old_logp", "ref_logp"))

  def init_state(self, params, rng):
    del rng
    kl_on = self.settings.objective.kl_on
    return GRPOState(params=params, opt_state=self.tx.init(params),
                     ref_params=lora.reference_copy(params) if kl_on else None,
                     updates=jnp.zeros((), jnp.int32),
                     kl_ctl=make_kl_controller(self.settings).init() if kl_on else None,
                     role_baseline=(role_baseline(self.settings).init()
                                    if self.settings.advantage == ROLE_ADVANTAGE else None),
                     reward_model=self.beside.init_state() if self.beside else None,
                     ema_params=(jax.tree.map(jnp.copy, params) if self.settings.ema_decay
                                 else None))

  def score_rollout(self, state, r: types.Rollout, rng
                    ) -> tuple[types.Rollout, dict[str, float]]:
    """The rollout with the train state's reward model's scores added to its rewards, and
    what this step's pairs say of that model (nothing without config.reward_model_beside)."""
    if self.beside is None:
      return r, {}
    return self.beside.scored_rollout(state.reward_model, r, rng)

  def prepare(self, state, r: types.Rollout, rng) -> GRPOBatch:
    s = self.settings
    # The pairs score_rollout measured, drawn with the same key.
    reward_pairs = self.beside.pairs_batch(r, rng) if self.beside is not None else None
    baseline = None
    if s.advantage == ROLE_ADVANTAGE:
      traj, correct = r.traj, np.asarray(r.correct, np.float32)
      advantages, baseline = role_advantages(s, r, state.role_baseline)
    else:
      traj, advantages, correct = group_advantages(s, r)
    loss_scale = None
    if s.skip_zero_advantage_rows:
      traj, loss_scale = groups.without_zero_advantage_rows(traj, advantages,
                                                     s.objective.aggregation)
    packed_slots = self.packing.slots(traj, state.updates)
    if packed_slots is not None:
      traj, advantages = packing.pad_replies(traj, advantages, s.pack_width)
    zeros = jnp.zeros(traj.tokens.shape, jnp.float32)
    old_logp = zeros if s.on_policy else self._score(state.params, traj=traj)[0]
    sampled_kl = s.objective.kl_on and not s.objective.needs_ref_logits
    ref_logp = (self._score(lora.reference(state.ref_params, state.params), traj=traj)[0]
                if sampled_kl else zeros)
    return GRPOBatch(traj=traj, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                     correct=jnp.asarray(correct), role_baseline=baseline,
                     reward_pairs=reward_pairs, packed_slots=packed_slots,
                     loss_scale=loss_scale)

  def update(self, state, batch, rng, progress):
    state, metrics = self._update_policy(state, batch, rng, progress)
    self.packing.compile_ahead(self._update, state._replace(reward_model=None),
                               batch._replace(reward_pairs=None), rng)
    # Which compiled program the step ran: its packed slots (0: padded rows) and its reply
    # width (the rollout's trimmed one, or `pack_width` where packed).
    return state, {**metrics, "update_slots": 0 if batch.packed_slots is None
                   else batch.packed_slots.shape[0],
                   "update_width": batch.traj.tokens.shape[1] - batch.traj.prompt_width}

  def _update_policy(self, state, batch, rng, progress):
    if self.beside is None:
      return self._update(state, batch, rng, jnp.float32(progress))
    # The policy's update and the reward model's step are separate programs: the
    # policy's is compiled ahead (precompile) and never sees the reward model.
    reward_state, pairs = state.reward_model, batch.reward_pairs
    state, metrics = self._update(state._replace(reward_model=None),
                                  batch._replace(reward_pairs=None), rng, jnp.float32(progress))
    if pairs is not None:
      reward_state, reward_metrics = self.beside.update(
          reward_state, pairs, jax.random.fold_in(rng, 1), progress)
      metrics = {**metrics, **reward_metrics}
    return state._replace(reward_model=reward_state), metrics

  def precompile(self, state, traj: types.Trajectory, rng) -> None:
    """Starts compiling `update` for a batch of `traj`'s shapes
    (`jax.ShapeDtypeStruct`s), in the background, while the first rollout samples."""
    s = self.settings
    if s.advantage == ROLE_ADVANTAGE:
      return  # its batch carries role baselines whose shapes depend on the episodes
    # The update only: the scoring's compile (a forward pass, a few seconds) runs on the
    # main thread while the update's (forward and backward) is still going. The update
    # trains on prompts_per_step of the sampled groups (fewer with oversampling).
    b, t = s.prompts_per_step * s.group_size, traj.tokens.shape[1]
    traj = jax.tree.map(lambda x: jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype), traj)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    if self.packing.applies(traj) and int(state.updates):  # a host read, once per process
      return  # a resumed run packs to its replies' lengths, unknown before sampling
    batch = GRPOBatch(traj=traj, advantages=f32(b) if s.turn_credit == "episode" else f32(b, t),
                      old_logp=f32(b, t), ref_logp=f32(b, t), correct=f32(b),
                      loss_scale=f32() if s.skip_zero_advantage_rows else None)
    self._update.start(state._replace(reward_model=None), batch, rng, f32())


def _validate_skip_zero_advantage_rows(settings: GRPOSettings) -> None:
  """Where a row without advantage still has a gradient, skipping it changes the update."""
  problems = list(settings.objective.terms_beside_advantage())
  if settings.minibatches != 1:
    problems.append(f"minibatches {settings.minibatches} (each minibatch has its own "
                    "denominator; the scale is the batch's)")
  if settings.drop_tied_groups:
    problems.append("drop_tied_groups (it changes the step size on purpose; this keeps it)")
  if problems:
    raise ValueError("skip_zero_advantage_rows leaves out rows that add no gradient, which "
                     "holds only without: " + "; ".join(problems))


def validate(config) -> None:
  """Fails on unknown names or inconsistent sizes before anything loads or compiles."""
  common.validate_common(config)
  reward_beside.validate(config)
  group, component = registry.names("group_advantage"), registry.names("component_advantage")
  if config.advantage == ROLE_ADVANTAGE:
    tc = config.get("turn_credit", None)
    self_play.check_role_advantage(
        env=config.get("env", ""), turn_credit=tc.name if tc is not None else "episode",
        drop_tied_groups=config.get("drop_tied_groups", False),
        decay=dict(config.advantage_kwargs).get("decay", 0.95))
  elif config.advantage not in group + component:
    raise ValueError(f"advantage {config.advantage!r} is not a group estimator over f32[P, G] "
                     f"rewards ({group}) or over f32[P, G, M] reward components ({component}); "
                     f"token-level estimators such as GAE are PPO's")
  settings = settings_from_config(config)  # names, per-loss hyperparameters, controllers
  if settings.skip_zero_advantage_rows:
    _validate_skip_zero_advantage_rows(settings)
  if settings.drop_tied_groups and settings.turn_credit != "episode":
    raise ValueError(f"drop_tied_groups masks groups whose total rewards tie, but turn_credit "
                     f"{settings.turn_credit!r} can give such a group's turns advantages: use "
                     "turn_credit 'episode'")
  kind = "component_advantage" if settings.component_advantage else "group_advantage"
  accepted = ({"decay"} if config.advantage == ROLE_ADVANTAGE else
              set(inspect.signature(registry.get(kind, config.advantage)).parameters))
  unknown = sorted(set(dict(config.advantage_kwargs)) - accepted)
  if unknown:
    raise ValueError(f"advantage_kwargs {unknown} are not arguments of {config.advantage!r} "
                     f"(it takes {sorted(accepted - {'rewards', 'weights'})})")
  if config.get("env") and settings.component_advantage:
    raise ValueError(f"advantage {config.advantage!r} reads reward components; an environment "
                     "run has one reward, its return: use a group_advantage")
  shaping = config.get("reward_shaping", None)
  if shaping and shaping.name == "par" and settings.component_advantage:
    raise ValueError(f"reward_shaping 'par' shapes the total reward, but {config.advantage!r} "
                     "reads the reward components: use a group_advantage with it")
  if config.group_size < 2 and config.advantage in ("grpo", "dr_grpo", "rloo",
                                                    "reinforce_pp_baseline", "gdpo"):
    raise ValueError(f"advantage {config.advantage!r} needs group_size >= 2")
  packing.check_options(settings.pack_below, config.get("pack_compile_ahead", 0))
  chunk = settings.logprob_chunk
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    raise ValueError(f"logprob_chunk {chunk!r} must be an int >= 0: the columns whose "
                     "vocabulary logits are computed at a time (0: all at once)")
  if chunk and settings.objective.needs_ref_logits:
    raise ValueError("logprob_chunk never holds the whole vocabulary logits, which the exact "
                     "forward KL (kl_estimator 'forward') reads: use a sampled-token estimator "
                     "(k1, k2, k3) or logprob_chunk=0")
  if not 0.0 <= settings.ema_decay < 1.0:  # NaN fails too
    raise ValueError(f"ema_decay {settings.ema_decay} must be in [0, 1): the weight of the "
                     "previous average in the policy's moving average (0: off)")
  groups.check_resample_rounds(config.get("resample_rounds", 0), env=config.get("env", ""),
                               overlap=config.get("overlap", False),
                               group_size=config.group_size)


def episode_credit(config) -> env_loop.Credit:
  """What GRPO's turn credit asks of an environment's episodes."""
  tc = config.get("turn_credit", None)
  name = tc.name if tc is not None else "episode"
  shaping = config.get("potential_shaping", False)
  if name == "igpo" and shaping:
    raise ValueError("turn_credit 'igpo' rewards turns by information gain; "
                     "potential_shaping would rewrite the same rewards: use one")
  return env_loop.Credit(
      name=f"turn_credit {name!r}", state_keys=name == "gigpo", information_gain=name == "igpo",
      shaping_gamma=(float(tc.gamma) if tc is not None else 1.0) if shaping else None,
      self_play=config.advantage == ROLE_ADVANTAGE)


def evaluate_policy(evaluate, state: GRPOState) -> tuple[dict, list[dict]]:
  """`evaluate` of the policy, or of its moving average (config.ema_decay) with the policy's
  own scalars beside it under `online/`."""
  if state.ema_params is None:
    return evaluate(state.params)
  result, samples = evaluate(state.ema_params)
  online, _ = evaluate(state.params)
  return {**result, **{f"online/{k}": v for k, v in online.items()}}, samples


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) a GRPO experiment in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  grpo = GRPO(config, model.cfg)
  collect, evaluate, data = common.episodes(config, model, episode_credit(config))
  mesh = sharding.for_config(config)
  watch = records.NoSignalWatch()  # warns when every group ties step after step
  token_budget = common.policy_token_budget(config)

  init_state = functools.partial(grpo.init_state, model.params, common.init_key(config))

  def update_step(state, r: types.Rollout, extra, prepare_rng, update_rng, progress_fraction,
                  rollout_s: float, wait_s: float | None = None) -> harness.StepResult:
    t0 = time.perf_counter()
    rows = r.traj.tokens.shape[0]  # rows split over the mesh's data x fsdp devices
    r = dataclasses.replace(r, traj=sharding.shard_batch(r.traj, mesh))
    r, scored = grpo.score_rollout(state, r, prepare_rng)  # a reward model trained beside
    batch = sharding.shard_batch(grpo.prepare(state, r, prepare_rng), mesh, rows=rows)
    state, metrics = grpo.update(state, batch, update_rng, progress_fraction)
    metrics = jax.device_get(metrics)
    record = records.step_record(
        r, {**extra, **scored}, metrics, group_size=config.group_size,
        policy_token_budget=token_budget, epochs=config.get("epochs", 1),
        skipped_updates=optim_lib.nonfinite_count(state)[1], rollout_s=rollout_s,
        update_s=time.perf_counter() - t0, wait_s=wait_s)
    return harness.StepResult(state, watch(record), records.rollout_samples(r))

  compile_ahead = getattr(collect, "likely_trajectory", None) if mesh is None else None

  def train_step(state, rng, progress_fraction) -> harness.StepResult:
    nonlocal compile_ahead
    rollout_rng, prepare_rng, update_rng = jax.random.split(rng, 3)
    t0 = time.perf_counter()
    examples = next(data)
    if compile_ahead is not None:  # once a process: the first update, while it samples
      grpo.precompile(state, compile_ahead(examples), update_rng)
      compile_ahead = None
    r, extra = collect(state.params, examples, rollout_rng)
    if config.get("resample_rounds", 0):  # DAPO's dynamic sampling: more prompts, few vary
      r, extra = groups.resample_until_varied(
          collect, state.params, lambda: next(data), rollout_rng, r, extra,
          need=config.prompts_per_step, max_rounds=config.resample_rounds,
          group_size=config.group_size, max_new_tokens=config.max_new_tokens)
    return update_step(state, r, extra, prepare_rng, update_rng, progress_fraction,
                       time.perf_counter() - t0)

  run_eval = None if evaluate is None else functools.partial(evaluate_policy, evaluate)
  run_args = dict(init_state=init_state, evaluate=run_eval, data=data,
                  nonfinite_count=optim_lib.nonfinite_count, progress=progress,
                  resume_rules=common.RESUME_RULES, frozen=common.frozen_reward_models(config),
                  **records.LOGGED)
  if config.get("overlap", False):  # the next step's rollout samples during this step's update
    overlap.check_supported(config, mesh)
    return overlap.run(config, workdir, collect=collect, initial_params=model.params,
                       policy_params=lambda state: state.params, update_step=update_step,
                       **run_args)
  return harness.run(config, workdir, train_step=train_step, **run_args)


if __name__ == "__main__":
  common.main(train)
