"""Advantage estimators: rewards (and values) in, per-rollout or per-step advantages out.

Registry kinds go by signature, so an experiment asks for the kind it can
call. Group estimators take `rewards: f32[P, G]`, P prompts with G rollouts
each (a batch is ordered prompt-major, B = P * G), and return `f32[P, G]`:

```
registry.get("group_advantage", "grpo")(rewards)               # f32[P, G] -> f32[P, G]
registry.get("component_advantage", "gdpo")(rewards, weights)  # f32[P, G, M], f32[M] -> [P, G]
registry.get("token_advantage", "gae")(rewards, values, dones) # f32[B, T] x3 -> (adv, returns)
```
Turn-level credit (turn rewards to token advantages, information gain,
potential-based shaping, ...) lives in `jaxrl_agents.objectives.credit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_rank, check_same_shape


def no_spread(x: jax.Array, axis=None, mask: jax.Array | None = None) -> jax.Array:
  """True where the entries (where `mask` holds) along `axis` are all equal and finite
  (keepdims).

  `x - x.mean()` is not exactly 0 for such entries when their value is not
  representable in float32 (eight rewards of 0.2 have a mean that rounds away
  from 0.2), and dividing by `std + eps` with std ~ 0 blows the rounding up:
  eight 0.2 rewards gave GRPO advantages of -0.0147 each, a push on every reply
  of a group that carries no signal. The estimators use this to return exact
  zeros for such a group (or batch), also with eps = 0 (where an exact tie would
  divide 0 by 0). False where no entry is in the mask, and for infinite values
  (they stay non-finite, for the run's checks to see).
  """
  if mask is None:
    hi, lo = x.max(axis=axis, keepdims=True), x.min(axis=axis, keepdims=True)
  else:
    mask = jnp.asarray(mask).astype(bool)
    hi = jnp.where(mask, x, -jnp.inf).max(axis=axis, keepdims=True)
    lo = jnp.where(mask, x, jnp.inf).min(axis=axis, keepdims=True)
  return (hi == lo) & jnp.isfinite(hi)


def group_centred(rewards: jax.Array) -> jax.Array:
  """r_i - mean_g r over axis 1, exactly 0 for a group without spread (`no_spread`)."""
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  return jnp.where(no_spread(rewards, axis=1), 0.0, centred)


def _check_groups(rewards: jax.Array, name: str = "rewards", min_group: int = 1) -> None:
  check_rank(name, rewards, 2)
  if rewards.shape[1] < min_group:
    raise ValueError(
        f"{name} has group size {rewards.shape[1]} (shape {tuple(rewards.shape)}); "
        f"this estimator needs at least {min_group} rollouts per prompt")


@registry.register("group_advantage", "grpo")
def group_normalized_advantages(
    rewards: jax.Array, *, std_normalize: bool = True, eps: float = 1e-6, ddof: int = 1
) -> jax.Array:
  """GRPO's group-relative advantage: A_i = (r_i - mean_g r) / (std_g r + eps).

  "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
  Models". The standard deviation is the unbiased one (ddof=1) as in verl and
  TRL. A group whose rewards are all equal gets exactly zero advantage (not
  the rounding of its mean over eps; see `no_spread`).

  Args:
    rewards: f32[P, G], G >= 2.
    std_normalize: divide by the group standard deviation (False gives Dr. GRPO).
    eps: added to the standard deviation.
    ddof: delta degrees of freedom of the standard deviation.

  Returns:
    f32[P, G]; each row sums to zero.
  """
  _check_groups(rewards, min_group=2)
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  if std_normalize:
    centred = centred / (rewards.std(axis=1, ddof=ddof, keepdims=True) + eps)
  return jnp.where(no_spread(rewards, axis=1), 0.0, centred)  # eps = 0 too: not 0 / 0


@registry.register("group_advantage", "dr_grpo")
def dr_grpo_advantages(rewards: jax.Array) -> jax.Array:
  """Dr. GRPO: A_i = r_i - mean_g r, no division by the group std.

  "Understanding R1-Zero-Like Training: A Critical Perspective": the std
  division up-weights prompts that are too easy or too hard (low variance);
  dropping it removes that question-level difficulty bias. Pair it with the
  "seq-mean-token-sum-norm" aggregation to also remove the length bias.

  Args:
    rewards: f32[P, G], G >= 2.

  Returns:
    f32[P, G].
  """
  return group_normalized_advantages(rewards, std_normalize=False)


@registry.register("group_advantage", "rloo")
def rloo_advantages(rewards: jax.Array) -> jax.Array:
  """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r).

  "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
  Human Feedback in LLMs" (RLOO); the baseline excludes the rollout itself, so
  the estimate is unbiased.

  Args:
    rewards: f32[P, G], G >= 2.

  Returns:
    f32[P, G].
  """
  _check_groups(rewards, min_group=2)
  g = rewards.shape[1]
  loo_mean = (rewards.sum(axis=1, keepdims=True) - rewards) / (g - 1)
  return jnp.where(no_spread(rewards, axis=1), 0.0, rewards - loo_mean)


def standardize(x: jax.Array, mask: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
  """(x - mean) / (std + eps) over the whole batch (the entries where `mask` holds).

  The batch normalization of advantages (REINFORCE++, GDPO's final step, PPO's
  token advantages): population statistics (ddof = 0). Entries outside the
  mask are standardized with the same statistics; callers zero them if needed.
  Group estimators normalize within groups instead (`group_normalized_advantages`).
  Entries (in the mask) that are all equal give exactly 0 (`no_spread`).
  """
  if mask is None:
    return jnp.where(no_spread(x), 0.0, (x - x.mean()) / (x.std() + eps))
  mask = jnp.asarray(mask).astype(bool)
  m = mask.astype(x.dtype)
  n = jnp.maximum(m.sum(), 1.0)
  mean = (x * m).sum() / n
  std = jnp.sqrt((jnp.square(x - mean) * m).sum() / n)
  return jnp.where(no_spread(x, mask=mask) & mask, 0.0, (x - mean) / (std + eps))


@registry.register("group_advantage", "reinforce_pp")
def reinforce_pp_advantages(
    rewards: jax.Array, *, group_baseline: bool = False, eps: float = 1e-6
) -> jax.Array:
  """REINFORCE++: advantages normalized over the whole batch, optionally after a group baseline.

  "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
  Models". Without a critic or a group std, the batch statistics give the
  scale: A = (a - mean_batch a) / (std_batch a + eps) with a = r, or
  a = r - mean_g r with `group_baseline` (verl's "reinforce_plus_plus_baseline").
  verl whitens token-level returns, which weights each rollout by its length;
  here every rollout counts once (the same when lengths are equal).

  Args:
    rewards: f32[P, G] (G may be 1 without a group baseline).
    group_baseline: subtract the group mean first.
    eps: added to the batch standard deviation.

  Returns:
    f32[P, G] with batch mean 0 and (population) std ~1.
  """
  _check_groups(rewards, min_group=2 if group_baseline else 1)
  a = group_centred(rewards) if group_baseline else rewards
  return standardize(a, eps=eps)


@registry.register("group_advantage", "reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: jax.Array, *, eps: float = 1e-6) -> jax.Array:
  """REINFORCE++ with a group-mean baseline before batch normalization; f32[P, G] -> f32[P, G]."""
  return reinforce_pp_advantages(rewards, group_baseline=True, eps=eps)


@registry.register("component_advantage", "gdpo")
def gdpo_advantages(
    rewards: jax.Array,
    weights: jax.Array | None = None,
    *,
    batch_normalize: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
  """GDPO: normalize each reward component within its group, then combine.

  "GDPO: Group reward-Decoupled Normalization Policy Optimization for
  Multi-reward RL Optimization":
    A_i = BN( sum_m w_m (r_im - mean_g r_m) / (std_g r_m + eps) ),
  where BN is the final batch-wise normalization the paper applies so the
  scale does not grow with the number of components. Normalizing the sum
  instead (GRPO on sum_m r_m) can map different reward combinations to the same
  advantage; GDPO keeps them apart. With one component and
  `batch_normalize=False` it equals GRPO.

  Args:
    rewards: f32[P, G, M], M reward components.
    weights: f32[M] component weights; all ones when None.
    batch_normalize: apply the final batch normalization.
    eps: added to each standard deviation.

  Returns:
    f32[P, G].
  """
  check_rank("rewards", rewards, 3)
  m = rewards.shape[2]
  if weights is None:
    weights = jnp.ones((m,), rewards.dtype)
  weights = jnp.asarray(weights, rewards.dtype)
  check_rank("weights", weights, 1)
  if weights.shape[0] != m:
    raise ValueError(
        f"weights has {weights.shape[0]} entries but rewards has {m} components "
        f"(shape {tuple(rewards.shape)})")
  # [P, G, M] -> per component [M, P, G] through the GRPO estimator.
  per_component = jax.vmap(
      lambda r: group_normalized_advantages(r, eps=eps), in_axes=2, out_axes=2)(rewards)
  combined = (per_component * weights).sum(axis=2)
  return standardize(combined, eps=eps) if batch_normalize else combined


@registry.register("token_advantage", "gae")
def generalized_advantage_estimation(
    rewards: jax.Array,
    values: jax.Array,
    dones: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap_value: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """GAE over the last axis with a reverse `lax.scan`; token level or turn level.

  "High-Dimensional Continuous Control Using Generalized Advantage Estimation":
    delta_t = r_t + gamma (1 - d_t) V_{t+1} - V_t
    A_t = delta_t + gamma lam (1 - d_t) A_{t+1}
  where d_t = 1 when the episode ends after step t (no bootstrap across it).
  Token level: steps are tokens of `[B, T]` and the outcome reward sits on the
  last policy token (set `dones` there; padding after it is ignored). Turn level:
  pass `[B, K]` turn rewards and values; broadcast the result to tokens with
  `jaxrl_agents.objectives.credit.turn_rewards_to_token_advantages(..., scope="none")`.
  lam = 1 gives the Monte-Carlo return minus V; lam = 0 the TD error.

  Args:
    rewards: f32[B, T] reward after step t.
    values: f32[B, T] V(s_t).
    dones: bool[B, T] episode ends after step t.
    gamma: discount.
    lam: GAE lambda.
    bootstrap_value: f32[B] V(s_T) for a trajectory truncated at the last step
      (used only where dones[:, -1] is False); zero when None.

  Returns:
    (advantages f32[B, T], returns f32[B, T] = advantages + values).
  """
  check_rank("rewards", rewards, 2)
  check_same_shape([("rewards", rewards), ("values", values), ("dones", dones)])
  if bootstrap_value is None:
    bootstrap_value = jnp.zeros(rewards.shape[:1], values.dtype)
  check_same_shape([("bootstrap_value", bootstrap_value), ("rewards[:, 0]", rewards[:, 0])])
  not_done = 1.0 - dones.astype(values.dtype)
  next_values = jnp.concatenate([values[:, 1:], bootstrap_value[:, None]], axis=1)
  deltas = rewards + gamma * not_done * next_values - values

  def step(next_advantage, xs):
    delta_t, not_done_t = xs
    advantage = delta_t + gamma * lam * not_done_t * next_advantage
    return advantage, advantage

  # Scan over time (leading axis after the transpose), last step first.
  _, advantages = jax.lax.scan(
      step, jnp.zeros_like(bootstrap_value), (deltas.T, not_done.T), reverse=True)
  advantages = advantages.T
  return advantages, advantages + values
