"""Credit assignment and reward shaping for multi-turn rollouts.

Turn-level signals (per-turn rewards, potentials, answer probabilities, implicit
process rewards) become per-turn or per-token advantages. Shapes:

  turn_rewards: f32[B, K]   K turns per rollout (padded), turn_mask: bool[B, K]
  turn_id:      int[B, T]   the turn each token belongs to (-1 or >= K: none)
  mask:         bool[B, T]  policy tokens (environment/tool tokens excluded)

Rows are ordered prompt-major: B = P * G, the G rollouts of prompt p are rows
p*G .. p*G + G - 1. Everything here is pure and jittable; string arguments
(`scope`) and sizes (`group_size`, `num_turns`, `num_roles`) are static.

```
turn_adv = normalize_turn_rewards(turn_rewards, turn_mask, scope="group", group_size=G)
token_adv = broadcast_turn_values(turn_adv, turn_id, mask, turn_mask)   # f32[B, T]
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives import advantages as advantages_lib
from jaxrl_agents.objectives.losses._checks import check_bt, check_rank, check_same_shape

_SCOPES = ("batch", "group", "none")


def _check_turns(turn_values: jax.Array, turn_mask: jax.Array | None, name: str) -> jax.Array:
  """Checks f32[B, K] + bool[B, K]; returns the mask (all True when None)."""
  check_rank(name, turn_values, 2)
  if turn_mask is None:
    return jnp.ones(turn_values.shape, dtype=bool)
  check_rank("turn_mask", turn_mask, 2)
  check_same_shape([(name, turn_values), ("turn_mask", turn_mask)])
  return turn_mask.astype(bool)


def _check_rows(name: str, x, batch: int) -> None:
  if jnp.shape(x)[0] != batch:
    raise ValueError(
      f"{name} has {jnp.shape(x)[0]} rows (shape {tuple(jnp.shape(x))}) but the batch has "
      f"{batch}; they must match"
    )


def _masked_standardize(
  x: jax.Array, m: jax.Array, axis, std_normalize: bool, eps: float
) -> jax.Array:
  """(x - mean) / (std + eps) with statistics over entries where m is True, along `axis`."""
  mf = m.astype(x.dtype)
  n = jnp.maximum(mf.sum(axis=axis, keepdims=True), 1.0)
  mean = jnp.where(m, x, 0.0).sum(axis=axis, keepdims=True) / n
  tied = advantages_lib.no_spread(x, axis, m)
  centred = jnp.where(m & ~tied, x - mean, 0.0)
  if not std_normalize:
    return centred
  std = jnp.sqrt((centred**2).sum(axis=axis, keepdims=True) / n)
  return jnp.where(tied, 0.0, centred / (std + eps))  # an exact tie with eps = 0: not 0 / 0


def normalize_turn_rewards(
  turn_rewards: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  scope: str = "batch",
  group_size: int | None = None,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """Standardizes turn rewards over the valid turns of a scope.

    A_{b,k} = (r_{b,k} - mean_S r) / (std_S r + eps),   S = valid turns in the scope of b,

  with the population standard deviation. Scopes: "batch" (all valid turns of
  the batch), "group" (the valid turns of the G rollouts of the same prompt,
  GRPO-style, rows prompt-major B = P * G), "none" (no normalization). Invalid
  turns get 0. `std_normalize=False` only centres (Dr. GRPO style).

  Args:
    turn_rewards: f32[B, K].
    turn_mask: bool[B, K], which turns exist; None means all.
    scope: "batch", "group" or "none" (static).
    group_size: G, required for scope="group"; B must be a multiple of G.
    std_normalize: divide by the standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  if scope not in _SCOPES:
    raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")
  if scope == "none":
    return jnp.where(tm, turn_rewards, 0.0)
  if scope == "batch":
    return _masked_standardize(turn_rewards, tm, None, std_normalize, eps)
  b, k = turn_rewards.shape
  if group_size is None or group_size < 1 or b % group_size:
    raise ValueError(
      f"group_size must be a positive divisor of the batch size {b} for scope='group', "
      f"got {group_size!r}"
    )
  grouped = turn_rewards.reshape(b // group_size, group_size * k)
  gmask = tm.reshape(b // group_size, group_size * k)
  out = _masked_standardize(grouped, gmask, -1, std_normalize, eps)
  return out.reshape(b, k)


def broadcast_turn_values(
  turn_values: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  turn_mask: jax.Array | None = None,
) -> jax.Array:
  """Gives each token the value of its turn: out_{b,t} = v_{b, turn_id_{b,t}}.

  Tokens with mask False, turn_id outside [0, K), or a turn that is not in
  `turn_mask` get 0.

  Args:
    turn_values: f32[B, K].
    turn_id: int[B, T].
    mask: bool[B, T].
    turn_mask: bool[B, K] or None (all turns exist).

  Returns:
    f32[B, T].
  """
  tm = _check_turns(turn_values, turn_mask, "turn_values")
  check_bt(turn_id=turn_id, mask=mask)
  _check_rows("turn_id", turn_id, turn_values.shape[0])
  k = turn_values.shape[1]
  in_range = (turn_id >= 0) & (turn_id < k)
  idx = jnp.clip(turn_id, 0, k - 1)
  values = jnp.take_along_axis(turn_values, idx, axis=1)
  exists = jnp.take_along_axis(tm, idx, axis=1)
  return jnp.where(mask.astype(bool) & in_range & exists, values, 0.0)


def turn_rewards_to_token_advantages(
  turn_rewards: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  scope: str = "batch",
  group_size: int | None = None,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """Turn-level rewards to token advantages: normalize within a scope, then broadcast.

  "RLVMR: Reinforcement Learning with Verifiable Meta-Reasoning Rewards for
  Robust Long-Horizon Agents" rewards individual (tagged) steps and optimizes
  them with a critic-free, group-normalized policy gradient. Here

    A_{b,k} = (r_{b,k} - mean_S r) / (std_S r + eps),    A_{b,t} = A_{b, turn_id_{b,t}},

  where S is the set of valid turns in the scope ("batch", "group" of the G
  rollouts of one prompt, or "none"; see `normalize_turn_rewards`). Tokens
  with mask False or outside any valid turn get 0.

  Args:
    turn_rewards: f32[B, K].
    turn_id: int[B, T].
    mask: bool[B, T].
    turn_mask: bool[B, K], which turns exist; None means all K.
    scope: "batch", "group" or "none" (static).
    group_size: G for scope="group".
    std_normalize: divide by the scope's standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, T] token advantages.
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  adv = normalize_turn_rewards(
    turn_rewards, tm, scope=scope, group_size=group_size, std_normalize=std_normalize, eps=eps
  )
  return broadcast_turn_values(adv, turn_id, mask, tm)


def turn_returns(
  turn_rewards: jax.Array, turn_mask: jax.Array | None = None, *, gamma: float = 1.0
) -> jax.Array:
  """Discounted return-to-go of each turn: G_k = sum_{j >= k, j valid} gamma^(j - k) r_j.

  Invalid turns contribute no reward and get 0 themselves (the discount still
  counts turn indices, so with a prefix mask this is the textbook return).

  Args:
    turn_rewards: f32[B, K].
    turn_mask: bool[B, K] or None (all turns exist).
    gamma: discount per turn.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  r = jnp.where(tm, turn_rewards, 0.0)

  def back(later, r_k):
    g = r_k + gamma * later
    return g, g

  _, returns = jax.lax.scan(back, jnp.zeros(r.shape[:1], r.dtype), r.T, reverse=True)
  return jnp.where(tm, returns.T, 0.0)


def step_group_advantages(
  returns: jax.Array,
  state_keys: jax.Array,
  turn_mask: jax.Array | None = None,
  *,
  group_size: int,
  std_normalize: bool = True,
  eps: float = 1e-6,
) -> jax.Array:
  """GiGPO's step-level advantages: turns from the same state are compared with each other.

  "Group-in-Group Policy Optimization for LLM Agent Training" (GiGPO) finds,
  among the G episodes of one task, the turns taken from the same environment
  state (an anchor state) and forms a step group of them; a turn's step
  advantage is its return relative to its step group's:

    A_{b,k} = (R_{b,k} - mean_S R) / (std_S R + eps),
    S = {(b', k') in the group of b : key_{b',k'} = key_{b,k}, turn k' of b' valid},

  with the population standard deviation (`std_normalize=False` only centres).
  A turn alone in its step group, an invalid turn and a turn with a negative
  key (no state identity) get 0. The paper adds these to the episode-level
  GRPO advantage with a weight (`combine_outcome_and_step_advantages`).

  Args:
    returns: f32[B, K], e.g. `turn_returns` (discounted, the paper's choice).
    state_keys: int32[B, K] the state each turn was taken from (equal keys are
      the same state; compared within a group only).
    turn_mask: bool[B, K] or None.
    group_size: G; B must be a multiple of it (rows prompt-major).
    std_normalize: divide by the step group's standard deviation.
    eps: added to the standard deviation.

  Returns:
    f32[B, K].
  """
  tm = _check_turns(returns, turn_mask, "returns")
  check_rank("state_keys", state_keys, 2)
  check_same_shape([("returns", returns), ("state_keys", state_keys)])
  b, k = returns.shape
  if group_size < 1 or b % group_size:
    raise ValueError(f"group_size must be a positive divisor of the batch size {b}, "
                     f"got {group_size!r}")
  n = group_size * k
  r = returns.reshape(-1, n)
  keys = state_keys.reshape(-1, n)
  ok = (tm & (state_keys >= 0)).reshape(-1, n)
  same = (keys[:, :, None] == keys[:, None, :]) & ok[:, :, None] & ok[:, None, :]
  w = same.astype(r.dtype)
  count = jnp.maximum(w.sum(-1), 1.0)
  mean = (w * r[:, None, :]).sum(-1) / count
  # A step group whose returns all tie: exactly 0 (the float32 rounding of its mean over
  # std + eps is not; see advantages.no_spread).
  tied = advantages_lib.no_spread(jnp.broadcast_to(r[:, None, :], same.shape), -1,
                                  same)[..., 0]
  centred = jnp.where(ok & ~tied, r - mean, 0.0)
  if std_normalize:
    var = (w * (r[:, None, :] - mean[:, :, None]) ** 2).sum(-1) / count
    scale = jnp.sqrt(var) + eps
    centred = centred / jnp.where(scale > 0, scale, 1.0)  # a lone turn: 0 / 0 -> 0
  return centred.reshape(b, k)


def _policy_first(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(order, inverse) int32[B, T]: a stable permutation putting each row's policy tokens
  first, in order, and the permutation that undoes it."""
  order = jnp.argsort(~mask.astype(bool), axis=1, stable=True)
  return order, jnp.argsort(order, axis=1)


def _turn_edges(turn_id: jax.Array, mask: jax.Array, which: str) -> jax.Array:
  """bool[B, T]: the "first" or "last" policy token of each turn."""
  m = mask.astype(bool)
  order, inverse = _policy_first(m)
  tid = jnp.take_along_axis(jnp.where(m, turn_id, -1), order, axis=1)
  pm = jnp.take_along_axis(m, order, axis=1)
  if which == "last":
    other = jnp.concatenate([tid[:, 1:], jnp.full(tid[:, :1].shape, -1)], axis=1)
    other_m = jnp.concatenate([pm[:, 1:], jnp.zeros_like(pm[:, :1])], axis=1)
  else:
    other = jnp.concatenate([jnp.full(tid[:, :1].shape, -1), tid[:, :-1]], axis=1)
    other_m = jnp.concatenate([jnp.zeros_like(pm[:, :1]), pm[:, :-1]], axis=1)
  edges = pm & (~other_m | (other != tid))
  return jnp.take_along_axis(edges, inverse, axis=1)


def _ends_of_turns(turn_id: jax.Array, mask: jax.Array) -> jax.Array:
  """bool[B, T]: the last policy token of each turn."""
  return _turn_edges(turn_id, mask, "last")


def _gae(rewards, values, dones, gamma, lam):
  return advantages_lib.generalized_advantage_estimation(rewards, values, dones, gamma=gamma,
                                                         lam=lam)


def rewards_at_turn_ends(turn_rewards: jax.Array, turn_id: jax.Array, mask: jax.Array,
                         turn_mask: jax.Array | None = None) -> jax.Array:
  """f32[B, T]: each turn's reward on its last policy token, 0 elsewhere (a single-turn
  stream: the outcome on the last token)."""
  ends = _ends_of_turns(turn_id, mask)
  return jnp.where(ends, broadcast_turn_values(turn_rewards, turn_id, mask, turn_mask), 0.0)


def policy_token_gae(
  token_rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE over a multi-turn stream's policy tokens, skipping everything else.

  The environment's tokens are not actions: the value after a turn's last token
  is the value at the next turn's first token (which has read the
  observation), the discount counts policy tokens only, and the episode ends
  at its last policy token. Rewards sit on policy tokens (a turn's reward on its
  last token). Computed by moving each row's policy tokens to the front (a
  stable permutation), running `generalized_advantage_estimation` there, and
  moving the results back.

  Args:
    token_rewards: f32[B, T] (0 off the policy tokens).
    values: f32[B, T] V before each token.
    mask: bool[B, T] policy tokens.
    gamma, lam: GAE's discount and lambda per policy token.

  Returns:
    (advantages f32[B, T], returns f32[B, T]), 0 off the policy tokens.
  """
  check_bt(token_rewards=token_rewards, values=values, mask=mask)
  return _gae_on_policy_tokens(token_rewards, values, mask, _episode_ends(mask),
                               gamma, lam)


def _episode_ends(mask: jax.Array) -> jax.Array:
  """bool[B, T]: each row's last policy token (the episode ends there)."""
  m = mask.astype(bool)
  t = m.shape[1]
  last = t - 1 - jnp.argmax(m[:, ::-1], axis=1)
  return m & (jnp.arange(t)[None, :] == last[:, None])


def _gae_on_policy_tokens(rewards, values, mask, dones, gamma, lam):
  """GAE over each row's policy tokens in order, everything else skipped: the policy tokens
  are moved to the front (a stable permutation), GAE runs there with `dones` (stream-aligned)
  ending its recursions, and the advantages move back. (advantages, returns), 0 elsewhere."""
  m = mask.astype(bool)
  order, inverse = _policy_first(m)
  take = lambda x: jnp.take_along_axis(x, order, axis=1)
  pm = take(m)
  adv, _ = _gae(jnp.where(pm, take(rewards), 0.0), jnp.where(pm, take(values), 0.0),
                take(dones) | ~pm, gamma, lam)
  adv = jnp.where(m, jnp.take_along_axis(adv, inverse, axis=1), 0.0)
  return adv, jnp.where(m, adv + values, 0.0)


def turn_values(values: jax.Array, turn_id: jax.Array, mask: jax.Array, num_turns: int, *,
                at: str = "first") -> jax.Array:
  """f32[B, K]: each turn's value, read at its "first" policy token (the state the turn
  starts from, before any of the reply) or its "last" (after all but one token of it);
  0 for a turn without tokens."""
  check_bt(values=values, turn_id=turn_id, mask=mask)
  if at not in ("first", "last"):
    raise ValueError(f"at must be 'first' or 'last', got {at!r}")
  edges = _turn_edges(turn_id, mask, at)
  return _turn_sums(jnp.where(edges, values, 0.0), turn_id, edges, num_turns)


def turn_level_gae(
  turn_rewards: jax.Array, values: jax.Array, turn_id: jax.Array, mask: jax.Array,
  turn_mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """GAE over turns, each token getting its turn's: the agentic MDP of a multi-turn episode.

  V_k is the value of the state turn k starts from, read at its first policy
  token (`turn_values`; the value there has seen the observation and none of
  the reply), r_k the turn's reward, and the episode ends after its last valid
  turn:

    delta_k = r_k + gamma V_{k+1} - V_k,   A_k = delta_k + gamma lam A_{k+1},

  every policy token of turn k gets A_k and the return target G_k = A_k + V_k.

  Args:
    turn_rewards: f32[B, K].
    values: f32[B, T] token values.
    turn_id: int[B, T].
    mask: bool[B, T] policy tokens.
    turn_mask: bool[B, K] turns that happened (a prefix).
    gamma, lam: per turn.

  Returns:
    (advantages f32[B, T], returns f32[B, T]), 0 off the policy tokens.
  """
  return _turn_gae(turn_rewards, values, turn_id, mask, turn_mask, gamma=gamma, lam=lam,
                   at="first")


def _turn_gae(turn_rewards, values, turn_id, mask, turn_mask, *, gamma, lam, at):
  tm = _check_turns(turn_rewards, turn_mask, "turn_rewards")
  k = turn_rewards.shape[1]
  v = jnp.where(tm, turn_values(values, turn_id, mask, k, at=at), 0.0)
  last, _ = _last_valid_turn(tm)
  dones = (jnp.arange(k)[None, :] >= last[:, None]) | ~tm
  adv, _ = _gae(jnp.where(tm, turn_rewards, 0.0), v, dones, gamma, lam)
  adv = jnp.where(tm, adv, 0.0)
  return (broadcast_turn_values(adv, turn_id, mask, tm),
          broadcast_turn_values(adv + v, turn_id, mask, tm))


def bilevel_gae(
  turn_rewards: jax.Array, values: jax.Array, turn_id: jax.Array, mask: jax.Array,
  turn_mask: jax.Array, *, gamma: float, lam: float, turn_gamma: float, turn_lam: float
) -> tuple[jax.Array, jax.Array]:
  """Bi-level GAE (RAGEN's and VAGEN's multi-turn PPO): turn-level GAE across turns, then
  token-level GAE inside each turn started from the turn's.

  The turn level is GAE over turns (turn_gamma, turn_lam) as in
  `turn_level_gae`, but with V_k read at turn k's last token (RAGEN's choice:
  the value after the turn's action, so that the last token's advantage below
  is exactly the turn's). Inside turn k, token-level GAE (gamma, lam) runs over its
  policy tokens with no reward until the last, whose target is the turn's
  return G_k = A_k + V_k and after which nothing is bootstrapped: the last
  token's advantage is the turn's A_k, earlier tokens' are GAE towards it.

  Returns:
    (advantages f32[B, T], returns f32[B, T] = advantages + values), 0 off the
    policy tokens.
  """
  _, turn_returns_ = _turn_gae(turn_rewards, values, turn_id, mask, turn_mask,
                               gamma=turn_gamma, lam=turn_lam, at="last")
  ends = _ends_of_turns(turn_id, mask)
  # The turn's return is the last token's reward, with values[last] subtracted back by
  # GAE's delta: r_last = G_k gives delta_last = G_k - V_last = A_k.
  return _gae_on_policy_tokens(jnp.where(ends, turn_returns_, 0.0), values, mask, ends,
                               gamma, lam)


def potential_based_shaping(
  rewards: jax.Array,
  potentials: jax.Array,
  gamma: float,
  turn_mask: jax.Array | None = None,
) -> jax.Array:
  """Potential-based reward shaping: r'_k = r_k + gamma * phi_{k+1} - phi_k.

  "Policy invariance under reward transformations: Theory and application to
  reward shaping" (Ng, Harada and Russell, 1999) shows that adding
  F(s, s') = gamma * phi(s') - phi(s) leaves the optimal policy unchanged
  (Q'(s, a) = Q(s, a) - phi(s)); "Behavior Alignment via Reward Function
  Optimization" learns such shaping terms. phi_k is the potential of the state
  before turn k and phi_K the potential after the last turn; the terminal
  potential is used as given (pass 0 for the textbook episodic form, where
  the shaped return then differs from the true one by -phi_0 only). With
  gamma = 1 the shaped rewards telescope:
  sum_k r'_k = sum_k r_k + phi_K - phi_0.

  Args:
    rewards: f32[B, K].
    potentials: f32[B, K + 1].
    gamma: discount.
    turn_mask: bool[B, K] or None; invalid turns get 0. With a prefix mask of
      length n the last valid turn uses phi_n.

  Returns:
    f32[B, K] shaped rewards.
  """
  tm = _check_turns(rewards, turn_mask, "rewards")
  check_rank("potentials", potentials, 2)
  b, k = rewards.shape
  if potentials.shape != (b, k + 1):
    raise ValueError(
      f"potentials must have shape {(b, k + 1)} (one more than rewards {(b, k)}), "
      f"got {tuple(potentials.shape)}"
    )
  shaped = rewards + gamma * potentials[:, 1:] - potentials[:, :-1]
  return jnp.where(tm, shaped, 0.0)


def information_gain_rewards(answer_logp: jax.Array, turn_mask: jax.Array) -> jax.Array:
  """IGPO turn rewards: the gain in the policy's probability of the ground-truth answer.

  "Information Gain-based Policy Optimization: A Simple and Effective Approach
  for Multi-Turn LLM Agents" scores the gold answer a = (a_1..a_L) after each
  turn with the policy itself,

    p_k = pi_theta(a | q, o_{<=k}) = exp( (1/L) sum_j log pi_theta(a_j | q, o_{<=k}, a_{<j}) ),

  and defines the reward of turn k as the difference of probabilities (not of
  log-probabilities): IG_k = p_k - p_{k-1}. So `answer_logp[:, k]` must be the
  length-normalized (per-token mean) log-probability of the answer after k
  turns, index 0 being the prompt alone; the rewards lie in [-1, 1] and
  telescope: sum_{k valid} IG_k = p_n - p_0 for a prefix mask of length n.
  A turn that leaves the answer probability unchanged gets 0.

  Args:
    answer_logp: f32[B, K + 1].
    turn_mask: bool[B, K]; invalid turns get 0.

  Returns:
    f32[B, K].
  """
  check_rank("answer_logp", answer_logp, 2)
  check_rank("turn_mask", turn_mask, 2)
  b, k = turn_mask.shape
  if answer_logp.shape != (b, k + 1):
    raise ValueError(
      f"answer_logp must have shape {(b, k + 1)} (one more than turn_mask {(b, k)}), "
      f"got {tuple(answer_logp.shape)}"
    )
  p = jnp.exp(answer_logp)
  return jnp.where(turn_mask.astype(bool), p[:, 1:] - p[:, :-1], 0.0)


def _last_valid_turn(turn_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Index of the last True per row (0 if none) and whether the row has any."""
  k = turn_mask.shape[1]
  last = k - 1 - jnp.argmax(turn_mask[:, ::-1], axis=1)
  return last, turn_mask.any(axis=1)


def igpo_turn_rewards(
  answer_logp: jax.Array,
  turn_mask: jax.Array,
  outcome_rewards: jax.Array,
  *,
  replace_last: bool = True,
) -> jax.Array:
  """IGPO's dense reward trajectory: information gain per turn, outcome on the last turn.

  "Information Gain-based Policy Optimization: A Simple and Effective Approach
  for Multi-Turn LLM Agents": r_k = IG_k for the turns before the answer and
  r_K = the outcome reward (e.g. F1 of the answer) on the last turn. IGPO then
  standardizes all turn rewards of a group jointly (`normalize_turn_rewards`
  with scope="group") and uses discounted turn returns as advantages.

  Args:
    answer_logp: f32[B, K + 1], see `information_gain_rewards`.
    turn_mask: bool[B, K].
    outcome_rewards: f32[B].
    replace_last: True (the paper) puts only the outcome on the last valid
      turn; False adds it to that turn's information gain.

  Returns:
    f32[B, K]; rows with no valid turn are 0.
  """
  ig = information_gain_rewards(answer_logp, turn_mask)
  check_rank("outcome_rewards", outcome_rewards, 1)
  _check_rows("outcome_rewards", outcome_rewards, ig.shape[0])
  tm = turn_mask.astype(bool)
  last, has_any = _last_valid_turn(tm)
  is_last = (jnp.arange(ig.shape[1])[None, :] == last[:, None]) & has_any[:, None]
  base = jnp.where(is_last, 0.0, ig) if replace_last else ig
  return base + jnp.where(is_last, outcome_rewards[:, None], 0.0)


def _turn_sums(values: jax.Array, turn_id: jax.Array, mask: jax.Array, num_turns: int):
  """sum_t [turn_id_t == k] m_t v_t per row: f32[B, T] -> f32[B, K]."""
  # Out-of-range segment ids are dropped by segment_sum; masked tokens are sent there.
  ids = jnp.where(mask.astype(bool), turn_id, num_turns)
  return jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=num_turns))(values, ids)


def implicit_step_rewards(
  logp: jax.Array,
  ref_logp: jax.Array,
  turn_id: jax.Array,
  mask: jax.Array,
  num_turns: int,
  beta: float,
) -> jax.Array:
  """OPRL implicit process rewards: r_k = beta * sum_{t in turn k} (log pi_phi - log pi_ref).

  "Online Process Reward Leanring for Agentic Reinforcement Learning" trains an
  implicit PRM pi_phi with a trajectory-level DPO objective against the
  previous policy snapshot pi_ref = pi_theta_old; the reward of step (turn) k
  is r_phi(o_{1:k}, a_k) = beta log pi_phi(a_k | o_{1:k}) / pi_ref(a_k | o_{1:k}),
  i.e. the per-token log-ratio summed over the turn's action tokens. The step
  rewards of a trajectory therefore sum to its implicit (DPO) reward
  beta * sum_t m_t (logp_t - ref_logp_t) when every valid token lies in a turn.

  Args:
    logp: f32[B, T] token log-probabilities under the PRM pi_phi.
    ref_logp: f32[B, T] under the reference (old policy).
    turn_id: int[B, T]; tokens outside [0, num_turns) are ignored.
    mask: bool[B, T].
    num_turns: K (static).
    beta: DPO temperature.

  Returns:
    f32[B, K].
  """
  check_bt(logp=logp, ref_logp=ref_logp, turn_id=turn_id, mask=mask)
  return beta * _turn_sums(logp - ref_logp, turn_id, mask, num_turns)


def combine_outcome_and_step_advantages(
  outcome_adv: jax.Array,
  step_adv: jax.Array,
  weight: float,
  *,
  turn_id: jax.Array | None = None,
  mask: jax.Array | None = None,
) -> jax.Array:
  """OPRL's advantage fusion: A = A_outcome + w * A_step.

  "Online Process Reward Leanring for Agentic Reinforcement Learning" combines
  the episode-level advantage from outcome rewards (shared by every step of a
  trajectory) with step-level advantages from implicit step rewards. With
  w = 0 this is outcome-only training.

  Three layouts:
    * step_adv f32[B, K], no turn_id: per-turn result f32[B, K];
    * step_adv f32[B, T] (token level), no turn_id: per-token result f32[B, T];
    * step_adv f32[B, K] with turn_id int[B, T] and mask bool[B, T]: the step
      advantage is broadcast to the tokens of each turn, result f32[B, T]
      (valid tokens outside [0, K) get the outcome advantage only).
  `mask` (same shape as the result) zeroes invalid entries.

  Args:
    outcome_adv: f32[B].
    step_adv: f32[B, K] or f32[B, T].
    weight: w.
    turn_id: int[B, T] or None.
    mask: bool, shape of the result, or None.

  Returns:
    f32[B, K] or f32[B, T].
  """
  check_rank("outcome_adv", outcome_adv, 1)
  check_rank("step_adv", step_adv, 2)
  _check_rows("step_adv", step_adv, outcome_adv.shape[0])
  if turn_id is not None:
    if mask is None:
      raise ValueError("mask is required with turn_id")
    step_tok = broadcast_turn_values(step_adv, turn_id, mask)
    out = outcome_adv[:, None] + weight * step_tok
    return jnp.where(mask.astype(bool), out, 0.0)
  out = outcome_adv[:, None] + weight * step_adv
  if mask is None:
    return out
  check_same_shape([("step_adv", step_adv), ("mask", mask)])
  return jnp.where(mask.astype(bool), out, 0.0)


def pivotal_mask(
  tokens_a: jax.Array,
  tokens_b: jax.Array,
  mask_a: jax.Array,
  mask_b: jax.Array | None = None,
) -> jax.Array:
  """R^3L pivotal credit: keep gradient only on the suffix where a pair diverges.

  "R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
  Exploration, Pivotal Credit, and Positive Amplification" retries a failed
  attempt from the diagnosed failure point, so the two trajectories share a
  prefix that carries no contrastive signal; it is excluded from the update.
  With L_b the length of the common prefix of rows b (the first position where
  the tokens differ, T if none),

    out_{b,t} = mask_a_{b,t} and t >= L_b.

  Apply it to both members of a pair (swap the arguments for the other one).

  Args:
    tokens_a: int[B, T] trajectory whose mask is returned.
    tokens_b: int[B, T] its partner, aligned position by position.
    mask_a: bool[B, T].
    mask_b: bool[B, T] or None; when given, a position where exactly one of
      the two is valid also counts as a divergence (so padding never extends
      the common prefix).

  Returns:
    bool[B, T].
  """
  check_bt(tokens_a=tokens_a, tokens_b=tokens_b, mask_a=mask_a)
  same = tokens_a == tokens_b
  if mask_b is not None:
    check_same_shape([("mask_a", mask_a), ("mask_b", mask_b)])
    same = same & (mask_a.astype(bool) == mask_b.astype(bool))
  in_prefix = jnp.cumprod(same.astype(jnp.int32), axis=1).astype(bool)
  return mask_a.astype(bool) & ~in_prefix


def positive_amplification(advantages: jax.Array, weight: float) -> jax.Array:
  """R^3L positive amplification: A' = w * A where A > 0, else A.

  "R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
  Exploration, Pivotal Credit, and Positive Amplification" upweights
  successful trajectories so that failure-dominated groups do not drown the
  few positive signals. Any shape; w = 1 is the identity.
  """
  return jnp.where(advantages > 0, weight * advantages, advantages)


def role_conditioned_advantages(
  rewards: jax.Array,
  role: jax.Array,
  baseline: jax.Array,
  num_roles: int,
  decay: float,
  valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """SPIRAL's Role-conditioned Advantage Estimation (RAE) with an EMA baseline per role.

  "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via Multi-Agent
  Multi-Turn Reinforcement Learning" keeps one baseline b_{G,p} per game G and
  role p, an exponential moving average of that role's return, and uses
  A = R_p - b_{G,p}; a first-mover edge is then not credited to the policy.
  Encode (game, role) pairs as one index, e.g. role = game * 2 + player.
  Trajectories are processed in batch order, as in the reference
  implementation, with the baseline read before it is updated (unbiased):

    A_i = r_i - b_{role_i};   b_{role_i} <- decay * b_{role_i} + (1 - decay) * r_i.

  (The paper writes the update first; reading it first keeps A_i independent
  of r_i.) Rows that are not valid, or whose role is outside [0, R), get
  A = 0 and do not update the baseline.

  Args:
    rewards: f32[B] trajectory returns.
    role: int[B].
    baseline: f32[R] current baselines (zeros to start).
    num_roles: R (static).
    decay: EMA decay in [0, 1].
    valid: bool[B] or None.

  Returns:
    (advantages f32[B], new_baseline f32[R]).
  """
  check_rank("rewards", rewards, 1)
  check_rank("role", role, 1)
  check_same_shape([("rewards", rewards), ("role", role)])
  check_rank("baseline", baseline, 1)
  if baseline.shape[0] != num_roles:
    raise ValueError(f"baseline has shape {tuple(baseline.shape)} but num_roles is {num_roles}")
  ok = (role >= 0) & (role < num_roles)
  if valid is not None:
    check_same_shape([("rewards", rewards), ("valid", valid)])
    ok = ok & valid.astype(bool)
  idx = jnp.clip(role, 0, num_roles - 1)

  def step(b, x):
    r, i, v = x
    adv = jnp.where(v, r - b[i], 0.0)
    b = b.at[i].set(jnp.where(v, decay * b[i] + (1.0 - decay) * r, b[i]))
    return b, adv

  new_baseline, adv = jax.lax.scan(step, baseline.astype(rewards.dtype), (rewards, idx, ok))
  return adv, new_baseline


class RoleBaselineState(NamedTuple):
  """State of `role_baseline`: baseline f32[R] and number of updates per role int32[R]."""

  baseline: jax.Array
  count: jax.Array


class RoleBaseline(NamedTuple):
  """(init, update): init() -> state; update(rewards, role, state, valid=None) -> (adv, state)."""

  init: Callable[[], RoleBaselineState]
  update: Callable[..., tuple[jax.Array, RoleBaselineState]]


def role_baseline(num_roles: int, decay: float = 0.95) -> RoleBaseline:
  """Carried-state form of `role_conditioned_advantages` (SPIRAL's RAE), optax style.

  "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via Multi-Agent
  Multi-Turn Reinforcement Learning" uses decay 0.95.

  ```
  rae = role_baseline(num_roles=2)
  state = rae.init()
  adv, state = rae.update(rewards, role, state)   # jittable
  ```

  Args:
    num_roles: R.
    decay: EMA decay.

  Returns:
    RoleBaseline(init, update).
  """

  def init() -> RoleBaselineState:
    return RoleBaselineState(
      baseline=jnp.zeros((num_roles,), jnp.float32), count=jnp.zeros((num_roles,), jnp.int32)
    )

  def update(
    rewards: jax.Array,
    role: jax.Array,
    state: RoleBaselineState,
    valid: jax.Array | None = None,
  ) -> tuple[jax.Array, RoleBaselineState]:
    adv, baseline = role_conditioned_advantages(
      rewards, role, state.baseline, num_roles, decay, valid
    )
    ok = (role >= 0) & (role < num_roles)
    if valid is not None:
      ok = ok & valid.astype(bool)
    hits = jax.ops.segment_sum(ok.astype(jnp.int32), jnp.clip(role, 0, num_roles - 1), num_roles)
    return adv, RoleBaselineState(baseline=baseline, count=state.count + hits)

  return RoleBaseline(init=init, update=update)


def par_sigmoid_shaping(
  rewards: jax.Array,
  reference_rewards: jax.Array,
  reference_mask: jax.Array | None = None,
) -> jax.Array:
  """Preference As Reward (PAR): r_RL = (1/M) sum_m sigmoid(r - r_ref_m).

  "Reward Shaping to Mitigate Reward Hacking in RLHF" argues the RL reward
  should be bounded, grow fast at first and then saturate, and be centred on
  a reference; PAR uses the reward model's own preference probability over
  reference responses: with M reference responses y_ref_m to the same prompt
  (sampled from the SFT policy and scored by the same reward model), the
  shaped reward is the mean Bradley-Terry win probability
  (1/M) sum_m sigmoid(r(x, y) - r(x, y_ref_m)) (the form in the authors'
  reference code; the paper reports a single reference already suffices).
  The result lies in (0, 1) and is 0.5 when r equals every reference reward.

  Args:
    rewards: f32[B].
    reference_rewards: f32[B] (one reference) or f32[B, M].
    reference_mask: bool[B, M] or None; rows with no valid reference get 0.5
      (the neutral value) so the output stays bounded.

  Returns:
    f32[B].
  """
  check_rank("rewards", rewards, 1)
  check_rank("reference_rewards", reference_rewards, (1, 2))
  _check_rows("reference_rewards", reference_rewards, rewards.shape[0])
  refs = reference_rewards if reference_rewards.ndim == 2 else reference_rewards[:, None]
  if reference_mask is None:
    m = jnp.ones(refs.shape, rewards.dtype)
  else:
    check_same_shape([("reference_rewards", refs), ("reference_mask", reference_mask)])
    m = reference_mask.astype(rewards.dtype)
  win = jax.nn.sigmoid(rewards[:, None] - refs)
  n = m.sum(axis=1)
  return jnp.where(n > 0, (win * m).sum(axis=1) / jnp.maximum(n, 1.0), 0.5)
