"""The policy part of an RL loss, composed from static hyperparameters read once from a config.

GRPO and PPO (and any trainer of a policy on sampled tokens) share it:

  loss = policy_loss(logp, old_logp, w * A, mask')   registered "policy_loss"
       + beta * KL(pi || pi_ref)                     registered "kl" estimator, or "forward"
       - entropy_coef * H(pi)
  mask' = token_control(mask less what "mis" drops)  "covariance_clip" / "entropy_gate" / none
  w = weights against the sampling policy            "tis" / "mis" / none (losses/off_policy.py)

`PolicyObjective` holds the hyperparameters as a frozen (hashable) dataclass,
built from the config in the experiment, so nothing under jit reads a
ConfigDict; `policy_objective` is a pure function of arrays and it. The KL
coefficient beta is an argument (a KL controller's state may move it).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses import entropy as entropy_lib
from jaxrl_agents.objectives.losses import kl as kl_lib
from jaxrl_agents.objectives.losses import off_policy
from jaxrl_agents.objectives.losses.aggregation import aggregate, masked_mean

# "forward" is the exact forward KL(pi_ref || pi) over the whole vocabulary (it needs
# the reference's logits in the loss); the registered estimators are per sampled token.
FORWARD_KL = "forward"

# Hyperparameter values that mean "off" in a config (ConfigDict fields cannot
# be None and still be set from the command line), mapped to the loss's None.
_OFF_MEANS_NONE = {"dual_clip": 0.0}


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
  """Static hyperparameters of the policy loss.

  Attributes:
    policy_loss: a registered "policy_loss" name.
    loss_kwargs: that loss's own hyperparameters, as sorted (name, value) pairs.
    aggregation: a registered aggregation mode.
    normalizer: the constant of "seq-mean-token-sum-norm" (the token budget).
    kl: a registered "kl" estimator, or "forward"; used when `kl_on`.
    kl_on: whether the loss has a KL term (its coefficient comes in as beta).
    entropy_coef: weight of the entropy bonus.
    temperature: the sampling temperature (log-probs refer to pi_T).
    token_control: a registered "token_control" (losses/token_controls.py): which policy
      tokens keep their gradient.
    token_control_frac: its fraction (covariance_clip: dropped; entropy_gate: kept).
    token_control_per_sequence: rank tokens within each sequence instead of the batch.
    off_policy_correction: one of off_policy.CORRECTIONS, for tokens the sampler drew from
      another policy than the one updated (an overlapped rollout's, or a sampler whose
      numerics differ from the update's).
    off_policy_cap: its truncation level / band (> 1).
  """

  policy_loss: str = "ppo"
  loss_kwargs: tuple[tuple[str, Any], ...] = ()
  aggregation: str = "token-mean"
  normalizer: float | None = None
  kl: str = "k3"
  kl_on: bool = False
  entropy_coef: float = 0.0
  temperature: float = 1.0
  token_control: str = "none"
  token_control_frac: float = 0.0
  token_control_per_sequence: bool = False
  off_policy_correction: str = "none"
  off_policy_cap: float = 2.0

  def __post_init__(self):
    registry.get("policy_loss", self.policy_loss)
    registry.get("aggregation", self.aggregation)
    if self.kl_on and self.kl != FORWARD_KL:
      registry.get("kl", self.kl)
    registry.check_name("token_control", self.token_control, "token_control.name")
    if self.token_control != "none" and not 0.0 <= self.token_control_frac <= 1.0:
      raise ValueError(f"token_control_frac must be in [0, 1], got {self.token_control_frac}")
    if self.off_policy_correction not in off_policy.CORRECTIONS:
      raise ValueError(f"off_policy.correction must be one of {off_policy.CORRECTIONS}, got "
                       f"{self.off_policy_correction!r}")
    if not self.off_policy_cap > 1.0:
      raise ValueError(f"off_policy.cap must be > 1, got {self.off_policy_cap}")

  def terms_beside_advantage(self) -> list[str]:
    """The objective's terms that give a row a gradient (or change a denominator) even
    where its advantages are all 0, each as the setting that turns it on."""
    terms = []
    if self.kl_on:
      terms.append("kl_coef > 0 (a KL term has a gradient on every row)")
    if self.entropy_coef:
      terms.append(f"entropy_coef {self.entropy_coef} (so has an entropy bonus)")
    if self.token_control != "none":
      terms.append(f"token_control {self.token_control!r} (it ranks the tokens of every row)")
    if self.off_policy_correction == "mis":
      terms.append("off_policy.correction 'mis' (it drops tokens of every row from the "
                   "token mean's denominator)")
    return terms

  @property
  def needs_ref_logits(self) -> bool:
    return self.kl_on and self.kl == FORWARD_KL


def loss_hyperparameters(policy_loss: str, per_loss: Mapping[str, Mapping[str, Any]]
                         ) -> tuple[tuple[str, Any], ...]:
  """The selected loss's entry of a config's per-loss table, checked against its signature.

  Each loss keeps its own hyperparameters, so selecting GSPO gets GSPO's clip
  range, not PPO's: a loss with no entry runs with its own defaults.
  """
  fn = registry.get("policy_loss", policy_loss)
  kwargs = dict(per_loss.get(policy_loss, {}))
  accepted = set(inspect.signature(fn).parameters) - {"logp", "old_logp", "advantages", "mask",
                                                      "aggregation", "normalizer"}
  unknown = sorted(set(kwargs) - accepted)
  if unknown:
    raise ValueError(f"loss_kwargs.{policy_loss} has {unknown}, which the {policy_loss!r} loss "
                     f"does not take; it takes {sorted(accepted)}")
  for name, off in _OFF_MEANS_NONE.items():
    if name in kwargs and kwargs[name] == off:
      kwargs[name] = None
  return tuple(sorted(kwargs.items()))


def controlled_mask(hp: PolicyObjective, logp: jax.Array, entropy: jax.Array,
                    advantages: jax.Array, mask: jax.Array
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The policy tokens that keep their gradient under the token control."""
  if hp.token_control == "none":
    return mask, {}
  adv = jnp.broadcast_to(advantages[:, None], mask.shape) if advantages.ndim == 1 \
      else advantages
  control = registry.get("token_control", hp.token_control)
  return control(jax.lax.stop_gradient(logp),
                 None if entropy is None else jax.lax.stop_gradient(entropy), adv, mask,
                 frac=hp.token_control_frac, per_sequence=hp.token_control_per_sequence)


# Metrics that have a value on a batch without policy tokens (besides counts, num_*).
_MEASURED_WITHOUT_TOKENS = ("kl_coef", "pg_loss", "loss")


def kl_term(hp: PolicyObjective, logp: jax.Array, mask: jax.Array, ref_logp: jax.Array | None,
            kl_per_token: jax.Array | None) -> jax.Array:
  """The aggregated KL to the reference: a sampled-token estimator over `ref_logp`, or the
  exact per-position `kl_per_token` where given."""
  if kl_per_token is None:
    kl, _ = kl_lib.kl_loss(logp, ref_logp, mask, estimator=hp.kl, aggregation=hp.aggregation,
                           normalizer=hp.normalizer)
    return kl
  return aggregate(jnp.where(mask, kl_per_token, 0.0), mask, hp.aggregation, hp.normalizer)


def policy_objective(hp: PolicyObjective, logp: jax.Array, entropy: jax.Array,
                     old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                     beta: jax.Array | float = 0.0, ref_logp: jax.Array | None = None,
                     kl_per_token: jax.Array | None = None,
                     behavior_logp: jax.Array | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The policy loss with its KL and entropy terms.

  Args:
    hp: the static hyperparameters.
    logp: f32[B, T] log pi_T of the sampled tokens (differentiable).
    entropy: f32[B, T] entropy of pi_T at each position.
    old_logp: f32[B, T] under the policy the update started from (the proximal policy;
      the sampling policy unless the rollout was overlapped or sampled elsewhere).
    advantages: f32[B] or f32[B, T].
    mask: bool[B, T] policy tokens.
    beta: the KL coefficient.
    ref_logp: f32[B, T] reference log-probs (a sampled-token KL estimator).
    kl_per_token: f32[B, T] an exact per-position KL (the forward KL), instead.
    behavior_logp: f32[B, T] log-probs the sampler drew the tokens with: logs how far the
      update's policy (old_logp) is from it, and `hp.off_policy_correction` weights by it.

  Returns:
    (scalar loss, metrics: the loss's, kl, entropy, loss, and the token control's; the
    per-token statistics are NaN where `mask` holds no token).
  """
  metrics = {}
  loss_mask = mask
  if behavior_logp is not None:
    weights, loss_mask, metrics = off_policy.behavior_weights(
        old_logp, behavior_logp, mask, correction=hp.off_policy_correction,
        cap=hp.off_policy_cap)
    if hp.off_policy_correction != "none":
      adv = jnp.broadcast_to(advantages[:, None], mask.shape) if advantages.ndim == 1 \
          else advantages
      advantages = adv * weights
  loss_mask, control_metrics = controlled_mask(hp, logp, entropy, advantages, loss_mask)
  metrics = {**metrics, **control_metrics}
  loss, loss_metrics = registry.get("policy_loss", hp.policy_loss)(
      logp, old_logp, advantages, loss_mask, aggregation=hp.aggregation,
      normalizer=hp.normalizer, **dict(hp.loss_kwargs))
  metrics = {**metrics, **loss_metrics}
  if hp.kl_on:
    kl = kl_term(hp, logp, mask, ref_logp, kl_per_token)
    loss = loss + beta * kl
    metrics["kl"] = kl
    metrics["kl_coef"] = jnp.asarray(beta, jnp.float32)
  if hp.entropy_coef:
    bonus, _ = entropy_lib.entropy_bonus(entropy, mask, aggregation=hp.aggregation,
                                         normalizer=hp.normalizer)
    loss = loss - hp.entropy_coef * bonus
  metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), mask)
  return loss, {**_unmeasured_as_nan(metrics, mask), "loss": loss}


def _unmeasured_as_nan(metrics: dict[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
  """A batch without policy tokens (every group tied and dropped) measured nothing: its
  per-token statistics are NaN, not 0, so a step's NaN-aware mean over minibatches
  skips them and a KL controller is not told the KL was 0. Counts (num_*), the
  coefficient and the losses keep their values: a count of 0 is measured, and the
  loss stays a finite 0 (a zero gradient, not a skipped update; AdamW still applies
  its momentum, and the schedule advances, as on any step)."""
  measured = jnp.any(mask)
  return {k: v if k in _MEASURED_WITHOUT_TOKENS or k.startswith("num_")
          else jnp.where(measured, v, jnp.nan) for k, v in metrics.items()}
