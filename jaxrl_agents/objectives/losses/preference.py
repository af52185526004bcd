"""Preference and supervised objectives: SFT, Bradley-Terry, DPO, IPO, RPO, CPL, RAFT, SPO.

Pairwise losses take one entry per preference pair, `f32[N]`, where "chosen"
is the preferred response y+ and "rejected" the dispreferred y- to the same
prompt. Sequence log-probabilities are sums of per-token log-probabilities
over the response tokens, log pi(y | x) = sum_t m_t log pi(y_t | x, y_<t);
the reference ones come from the frozen reference policy and carry no
gradient (the caller applies `jax.lax.stop_gradient` or computes them
outside the differentiated function).

Every loss returns `(loss f32[], metrics)` where `metrics` is a dict of
`f32[]` scalars; `raft_select` and `spo_win_rate_rewards` build training data
for the other objectives and return arrays only.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses._checks import check_bt, check_rank, check_same_shape
from jaxrl_agents.objectives.losses.aggregation import aggregate


def _check_pairs(**arrays) -> None:
  """Each keyword array must be rank 1 ([N]) and all shapes must agree."""
  for name, x in arrays.items():
    check_rank(name, x, 1)
  check_same_shape(list(arrays.items()))


def _is_number(x) -> bool:
  """True for concrete Python numbers, whose range can be checked before tracing."""
  return isinstance(x, int | float) and not isinstance(x, bool)


def _safe_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
  """sum_i w_i v_i / sum_i w_i, and 0 when every weight is 0."""
  total = weights.sum()
  return (weights * values).sum() / jnp.where(total > 0, total, 1.0)


def _log_ratio_terms(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  ref_chosen_logp: jax.Array,
  ref_rejected_logp: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Checks the four sequence log-prob arrays and returns the two log-ratios f32[N]."""
  _check_pairs(
    chosen_logp=chosen_logp,
    rejected_logp=rejected_logp,
    ref_chosen_logp=ref_chosen_logp,
    ref_rejected_logp=ref_rejected_logp,
  )
  return chosen_logp - ref_chosen_logp, rejected_logp - ref_rejected_logp


def _implicit_reward_metrics(
  chosen_rewards: jax.Array, rejected_rewards: jax.Array
) -> dict[str, jax.Array]:
  return {
    "reward_accuracy": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
    "chosen_reward": chosen_rewards.mean(),
    "rejected_reward": rejected_rewards.mean(),
    "reward_margin": (chosen_rewards - rejected_rewards).mean(),
  }


@registry.register("preference_loss", "sft")
def sft_nll(
  logp: jax.Array, mask: jax.Array, aggregation: str = "token-mean"
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Supervised fine-tuning: negative log-likelihood of the target tokens.

  L = agg_{b,t}( -m_bt log pi(y_bt | x_b, y_b,<t) ), with `agg` one of the
  modes of `jaxrl_agents.objectives.losses.aggregation` ("token-mean" weights every
  token equally, "seq-mean-token-mean" every sequence equally).

  Args:
    logp: f32[B, T] log-probabilities of the target tokens under the policy.
    mask: bool[B, T], True on target tokens (prompt and padding excluded).
    aggregation: name of the aggregation mode.

  Returns:
    (loss f32[], metrics) with metrics "loss", "token_nll" (the token-mean
    NLL whatever the aggregation), "perplexity" (exp of it) and "num_tokens".
  """
  check_bt(logp=logp, mask=mask)
  # where, not multiply: padded positions may hold -inf, and -inf * 0 is NaN.
  nll = jnp.where(mask, -logp, 0.0)
  loss = aggregate(nll, mask, aggregation)
  num_tokens = mask.astype(jnp.float32).sum()
  token_nll = nll.sum() / jnp.maximum(num_tokens, 1.0)
  metrics = {
    "loss": loss,
    "token_nll": token_nll,
    "perplexity": jnp.exp(token_nll),
    "num_tokens": num_tokens,
  }
  return loss, metrics


@registry.register("preference_loss", "bradley_terry")
def bradley_terry_loss(
  chosen_rewards: jax.Array,
  rejected_rewards: jax.Array,
  margin: float | jax.Array = 0.0,
  weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Bradley-Terry reward-model loss, with an optional margin and per-pair weights.

  Under the Bradley-Terry model P(y+ > y- | x) = sigmoid(r(x, y+) - r(x, y-)),
  and the reward model is fit by maximum likelihood ("Reinforcement Learning
  from Human Feedback: A Statistical Perspective"):

    l_i = -log sigmoid(r+_i - r-_i - m_i),
    L = sum_i w_i l_i / sum_i w_i.

  The margin m_i follows Llama 2's reward model, which asks the reward gap to
  exceed a margin that grows with the annotated preference strength; m = 0
  is the plain Bradley-Terry loss. Weights w = 1 give the plain mean; w_i = 0
  drops pair i (padding), and L = 0 if all weights are 0.

  Args:
    chosen_rewards: f32[N] rewards r(x, y+) of the preferred responses.
    rejected_rewards: f32[N] rewards r(x, y-) of the dispreferred responses.
    margin: f32[] or f32[N] margin m.
    weights: optional f32[N] non-negative per-pair weights w.

  Returns:
    (loss f32[], metrics) with the weighted means "loss", "accuracy" (fraction
    of pairs with r+ > r-, margin not included), "margin" (mean r+ - r-),
    "chosen_reward" and "rejected_reward".
  """
  _check_pairs(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
  check_rank("margin", margin, (0, 1))
  if jnp.ndim(margin) == 1:
    check_same_shape([("chosen_rewards", chosen_rewards), ("margin", margin)])
  if weights is None:
    weights = jnp.ones_like(chosen_rewards)
  else:
    _check_pairs(chosen_rewards=chosen_rewards, weights=weights)
  gap = chosen_rewards - rejected_rewards
  per_pair = -jax.nn.log_sigmoid(gap - margin)
  loss = _safe_mean(per_pair, weights)
  metrics = {
    "loss": loss,
    "accuracy": _safe_mean((gap > 0).astype(per_pair.dtype), weights),
    "margin": _safe_mean(gap, weights),
    "chosen_reward": _safe_mean(chosen_rewards, weights),
    "rejected_reward": _safe_mean(rejected_rewards, weights),
  }
  return loss, metrics


def _dpo_per_pair(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  ref_chosen_logp: jax.Array,
  ref_rejected_logp: jax.Array,
  beta: float | jax.Array,
  label_smoothing: float | jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-pair DPO losses f32[N] and the implicit-reward metrics."""
  if _is_number(label_smoothing) and not 0.0 <= label_smoothing <= 0.5:
    raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
  chosen_ratio, rejected_ratio = _log_ratio_terms(
    chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp
  )
  chosen_rewards = beta * chosen_ratio
  rejected_rewards = beta * rejected_ratio
  logits = chosen_rewards - rejected_rewards
  agree = -jax.nn.log_sigmoid(logits)
  flipped = -jax.nn.log_sigmoid(-logits)
  per_pair = (1.0 - label_smoothing) * agree + label_smoothing * flipped
  return per_pair, _implicit_reward_metrics(chosen_rewards, rejected_rewards)


@registry.register("preference_loss", "dpo")
def dpo_loss(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  ref_chosen_logp: jax.Array,
  ref_rejected_logp: jax.Array,
  beta: float | jax.Array = 0.1,
  label_smoothing: float | jax.Array = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Direct Preference Optimization, with conservative label smoothing.

  "Direct Preference Optimization: Your Language Model is Secretly a Reward
  Model": the KL-regularized reward maximizer is pi*(y|x) ∝ pi_ref(y|x)
  exp(r(x, y) / beta), so r_hat(x, y) = beta log(pi(y|x) / pi_ref(y|x)) is an
  implicit reward and the Bradley-Terry loss on it trains the policy directly:

    z_i = beta * [(log pi(y+_i) - log pi_ref(y+_i)) - (log pi(y-_i) - log pi_ref(y-_i))],
    L = mean_i [ -(1 - eps) log sigmoid(z_i) - eps log sigmoid(-z_i) ].

  eps is the probability that a label is flipped (conservative DPO, TRL's
  `label_smoothing`); eps = 0 is the published loss. At pi = pi_ref, z = 0 and
  L = log 2 for every eps.

  Args:
    chosen_logp: f32[N] sequence log-probs log pi(y+ | x) under the policy.
    rejected_logp: f32[N] sequence log-probs log pi(y- | x) under the policy.
    ref_chosen_logp: f32[N] log pi_ref(y+ | x).
    ref_rejected_logp: f32[N] log pi_ref(y- | x).
    beta: KL-regularization strength (inverse temperature of the implicit reward).
    label_smoothing: eps in [0, 0.5].

  Returns:
    (loss f32[], metrics) with "loss", "reward_accuracy" (fraction with
    r_hat(y+) > r_hat(y-)), mean "chosen_reward" and "rejected_reward" (the
    implicit rewards beta * log-ratio) and "reward_margin" (mean z).
  """
  per_pair, metrics = _dpo_per_pair(
    chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta, label_smoothing
  )
  loss = per_pair.mean()
  return loss, {"loss": loss, **metrics}


@registry.register("preference_loss", "ipo")
def ipo_loss(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  ref_chosen_logp: jax.Array,
  ref_rejected_logp: jax.Array,
  tau: float | jax.Array = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Identity Preference Optimization: regress the log-ratio gap onto 1 / (2 tau).

  "A General Theoretical Paradigm to Understand Learning from Human
  Preferences" (Psi-PO with Psi the identity) replaces DPO's log-sigmoid,
  which keeps pushing deterministic preferences to infinite log-ratios, by a
  square loss with a finite target:

    h_i = (log pi(y+_i) - log pi_ref(y+_i)) - (log pi(y-_i) - log pi_ref(y-_i)),
    L = mean_i (h_i - 1 / (2 tau))^2.

  tau is the regularization strength towards pi_ref (TRL's `beta` for
  loss_type="ipo"). TRL feeds length-averaged log-probs to IPO; pass
  per-token means instead of sums here to get that variant.

  Args:
    chosen_logp: f32[N] log pi(y+ | x).
    rejected_logp: f32[N] log pi(y- | x).
    ref_chosen_logp: f32[N] log pi_ref(y+ | x).
    ref_rejected_logp: f32[N] log pi_ref(y- | x).
    tau: regularization strength, > 0.

  Returns:
    (loss f32[], metrics) with "loss", "log_ratio_margin" (mean h), and
    "reward_accuracy" / "chosen_reward" / "rejected_reward" / "reward_margin"
    computed from the implicit rewards tau * log-ratio, as for DPO.
  """
  if _is_number(tau) and tau <= 0:
    raise ValueError(f"tau must be > 0, got {tau}")
  chosen_ratio, rejected_ratio = _log_ratio_terms(
    chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp
  )
  h = chosen_ratio - rejected_ratio
  loss = jnp.square(h - 1.0 / (2.0 * tau)).mean()
  metrics = {
    "loss": loss,
    "log_ratio_margin": h.mean(),
    **_implicit_reward_metrics(tau * chosen_ratio, tau * rejected_ratio),
  }
  return loss, metrics


@registry.register("preference_loss", "rpo")
def rpo_loss(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  ref_chosen_logp: jax.Array,
  ref_rejected_logp: jax.Array,
  chosen_nll: jax.Array,
  eta: float | jax.Array = 1.0,
  beta: float | jax.Array = 0.1,
  label_smoothing: float | jax.Array = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Regularized Preference Optimization: DPO plus an SFT loss on the chosen responses.

  "Provably Mitigating Overoptimization in RLHF: Your SFT Loss is Implicitly
  an Adversarial Regularizer" shows that maximum likelihood against an
  adversarially chosen reward with a reward penalty is equivalent to adding
  an imitation (SFT) loss to DPO, which keeps the probability of the
  preferred responses from collapsing:

    L = L_DPO + eta * mean_i NLL(y+_i | x_i).

  `chosen_nll` is the caller's choice of NLL per pair: -chosen_logp (the
  sequence NLL of the paper) or the per-token mean (as TRL's `rpo_alpha`,
  which is eta here). eta = 0 is DPO exactly.

  Args:
    chosen_logp: f32[N] log pi(y+ | x).
    rejected_logp: f32[N] log pi(y- | x).
    ref_chosen_logp: f32[N] log pi_ref(y+ | x).
    ref_rejected_logp: f32[N] log pi_ref(y- | x).
    chosen_nll: f32[N] NLL of the chosen responses under the policy.
    eta: weight of the SFT term, >= 0.
    beta: DPO's beta.
    label_smoothing: DPO's eps.

  Returns:
    (loss f32[], metrics) with "loss", "dpo_loss", "sft_nll" (mean
    chosen_nll) and the implicit-reward metrics of `dpo_loss`.
  """
  if _is_number(eta) and eta < 0:
    raise ValueError(f"eta must be >= 0, got {eta}")
  _check_pairs(chosen_logp=chosen_logp, chosen_nll=chosen_nll)
  per_pair, metrics = _dpo_per_pair(
    chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta, label_smoothing
  )
  dpo = per_pair.mean()
  sft = chosen_nll.mean()
  loss = dpo + eta * sft
  return loss, {"loss": loss, "dpo_loss": dpo, "sft_nll": sft, **metrics}


def discounted_logp_sum(logp: jax.Array, mask: jax.Array, gamma) -> jax.Array:
  """sum_t gamma^t logp_t over valid tokens, t counting the valid tokens before."""
  # Counting valid tokens (not columns) makes left and right padding agree.
  t = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(logp.dtype)
  discount = jnp.where(mask, jnp.power(gamma, t), 0.0)
  return (discount * jnp.where(mask, logp, 0.0)).sum(-1)


@registry.register("preference_loss", "cpl")
def cpl_loss(
  chosen_logp: jax.Array,
  rejected_logp: jax.Array,
  chosen_mask: jax.Array,
  rejected_mask: jax.Array,
  alpha: float | jax.Array = 0.1,
  gamma: float | jax.Array = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Contrastive Preference Learning: a preference loss on discounted sums of log-probs.

  "Contrastive Prefence Learning: Learning from Human Feedback without RL"
  models preferences by the regret of each segment; with the optimal
  advantage of the maximum-entropy policy, A*(s, a) = alpha log pi*(a|s),
  this needs no reward model and no RL:

    S(y) = sum_t gamma^t log pi(y_t | x, y_<t),
    L = mean_i -log sigmoid(alpha * (S(y+_i) - S(y-_i))).

  t counts the valid (mask True) tokens before position t, so left- and
  right-padded inputs give the same result. The paper's conservative variant
  multiplies S(y-) by a bias lambda < 1; it is not included here. Chosen and
  rejected may be padded to different lengths.

  Args:
    chosen_logp: f32[N, T+] per-token log pi(y+_t | x, y+_<t).
    rejected_logp: f32[N, T-] per-token log pi(y-_t | x, y-_<t).
    chosen_mask: bool[N, T+], True on the response tokens of y+.
    rejected_mask: bool[N, T-], True on the response tokens of y-.
    alpha: temperature of the maximum-entropy objective.
    gamma: discount in [0, 1].

  Returns:
    (loss f32[], metrics) with "loss", "accuracy" (fraction with
    S(y+) > S(y-)), mean "chosen_score" / "rejected_score" (S) and "margin"
    (mean alpha * (S(y+) - S(y-))).
  """
  check_bt(chosen_logp=chosen_logp, chosen_mask=chosen_mask)
  check_bt(rejected_logp=rejected_logp, rejected_mask=rejected_mask)
  if rejected_logp.shape[0] != chosen_logp.shape[0]:
    raise ValueError(
      f"rejected_logp has {rejected_logp.shape[0]} pairs but chosen_logp has "
      f"{chosen_logp.shape[0]}; the leading dimensions must match"
    )
  chosen_score = discounted_logp_sum(chosen_logp, chosen_mask, gamma)
  rejected_score = discounted_logp_sum(rejected_logp, rejected_mask, gamma)
  logits = alpha * (chosen_score - rejected_score)
  loss = -jax.nn.log_sigmoid(logits).mean()
  metrics = {
    "loss": loss,
    "accuracy": (chosen_score > rejected_score).astype(jnp.float32).mean(),
    "chosen_score": chosen_score.mean(),
    "rejected_score": rejected_score.mean(),
    "margin": logits.mean(),
  }
  return loss, metrics


def raft_select(rewards: jax.Array, k: int) -> jax.Array:
  """RAFT selection: the k highest-reward responses of each prompt's group.

  "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment"
  samples G responses per prompt, ranks them by reward and fine-tunes on the
  best ones only:

    keep[p, i] = rank of rewards[p, i] within group p < k,

  with ranks in descending reward and ties broken by index (the earlier
  response wins), so exactly k responses are kept per group. NaN rewards rank
  below every number. The mask is the whole output: combine it with the token
  mask and train with `sft_nll`, e.g.
  `sft_nll(logp, mask & keep.reshape(-1)[:, None])` for `logp: f32[P*G, T]`.

  Args:
    rewards: f32[P, G] rewards of G responses to each of P prompts.
    k: static Python int, 1 <= k <= G.

  Returns:
    bool[P, G] mask, True on the k selected responses of each group.
  """
  check_rank("rewards", rewards, 2)
  group_size = rewards.shape[-1]
  try:
    k = operator.index(k)
  except TypeError as e:
    raise ValueError(f"k must be a static Python int, got {k!r}") from e
  if not 1 <= k <= group_size:
    raise ValueError(f"k must satisfy 1 <= k <= G = {group_size}, got k={k}")
  # Stable ascending sort of -r: descending rewards, ties by index, NaN last.
  order = jnp.argsort(-rewards, axis=-1, stable=True)
  ranks = jnp.argsort(order, axis=-1)
  return ranks < k


def spo_win_rate_rewards(preferences: jax.Array) -> jax.Array:
  """Self-Play Preference Optimization reward: win rate against the group's other samples.

  "A Minimaximalist Approach to Reinforcement Learning from Human Feedback"
  rewards each sample by the fraction of comparisons it wins against other
  samples of the same policy, which needs no reward model and handles
  intransitive preferences:

    r[p, i] = 1 / (G - 1) * sum_{j != i} preferences[p, i, j].

  A strict transitive order gives normalized ranks (G = 3: [1, 0.5, 0]); a
  rock-paper-scissors cycle gives 0.5 to everyone.

  Args:
    preferences: f32[P, G, G]; preferences[p, i, j] = P(sample i beats sample j)
      for prompt p, 0/1 or a probability. The diagonal is ignored (it may
      hold anything, NaN included).

  Returns:
    f32[P, G] win-rate rewards in [0, 1] when the preferences are.
  """
  check_rank("preferences", preferences, 3)
  group_size = preferences.shape[-1]
  if preferences.shape[-2] != group_size:
    raise ValueError(f"preferences must have shape [P, G, G], got {tuple(preferences.shape)}")
  if group_size < 2:
    raise ValueError(f"preferences needs G >= 2 samples per group, got G={group_size}")
  off_diagonal = ~jnp.eye(group_size, dtype=bool)
  wins = jnp.where(off_diagonal, preferences, 0.0).sum(-1)
  return wins / (group_size - 1)
