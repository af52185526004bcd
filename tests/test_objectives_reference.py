"""Cross-check of the PPO/GRPO family against numpy transcriptions of verl and TRL.

The reference functions below transcribe, in numpy, the definitions published
in verl (`verl/trainer/ppo/core_algos.py`: GRPO/RLOO/REINFORCE++ advantages,
GAE, vanilla and GSPO policy losses with dual clip, value loss, agg_loss, KL
penalties) and TRL (`GRPOTrainer`: group advantages with scale_rewards, the
"grpo", "bnpo", "dr_grpo" loss types and the k3 KL term). They are written from
those definitions, independently of the library, and compared on random inputs.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import registry
from jaxrl_agents.objectives import advantages as adv
from jaxrl_agents.objectives import losses

# ---------------- verl transcription ----------------


def verl_masked_mean(x, mask):
  return (x * mask).sum() / mask.sum()


def verl_masked_whiten(x, mask):
  mean = verl_masked_mean(x, mask)
  var = verl_masked_mean((x - mean) ** 2, mask)
  n = mask.sum()
  var = var * n / (n - 1)  # unbiased, as verl's masked_var(unbiased=True)
  return (x - mean) / np.sqrt(var + 1e-8)


def verl_agg_loss(loss_mat, mask, mode):
  if mode == "token-mean":
    return verl_masked_mean(loss_mat, mask)
  if mode == "seq-mean-token-sum":
    return (loss_mat * mask).sum(-1).mean()
  if mode == "seq-mean-token-mean":
    return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()
  if mode == "seq-mean-token-sum-norm":
    return (loss_mat * mask).sum() / mask.shape[-1]
  raise ValueError(mode)


def verl_grpo_outcome_advantage(scores, index, norm_by_std=True, eps=1e-6):
  out = scores.copy()
  for uid in np.unique(index):
    sel = index == uid
    if sel.sum() == 1:
      mean, std = 0.0, 1.0
    else:
      mean, std = scores[sel].mean(), scores[sel].std(ddof=1)
    out[sel] = (scores[sel] - mean) / (std + eps) if norm_by_std else scores[sel] - mean
  return out


def verl_rloo_outcome_advantage(scores, index):
  out = scores.copy()
  for uid in np.unique(index):
    sel = index == uid
    n = sel.sum()
    out[sel] = scores[sel] * n / (n - 1) - scores[sel].mean() * n / (n - 1)
  return out


def verl_reinforce_pp_baseline(scores, index, mask):
  centred = scores.copy()
  for uid in np.unique(index):
    sel = index == uid
    centred[sel] = scores[sel] - scores[sel].mean()
  token_scores = centred[:, None] * mask
  return verl_masked_whiten(token_scores, mask) * mask


def verl_gae(token_rewards, values, mask, gamma, lam):
  t_len = token_rewards.shape[1]
  last = np.zeros(token_rewards.shape[0])
  out = np.zeros_like(token_rewards)
  for t in reversed(range(t_len)):
    next_values = values[:, t + 1] if t < t_len - 1 else 0.0
    delta = token_rewards[:, t] + gamma * next_values - values[:, t]
    last = delta + gamma * lam * last
    out[:, t] = last
  returns = out + values
  return out, returns


def verl_kl_penalty(logp, ref_logp, kind):
  if kind == "k1":
    return logp - ref_logp
  if kind == "k2":
    return 0.5 * (logp - ref_logp) ** 2
  if kind == "k3":
    kl = np.clip(ref_logp - logp, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)
  raise ValueError(kind)


def verl_vanilla_policy_loss(old_logp, logp, advantages, mask, clip_low, clip_high, clip_c,
                             mode):
  neg_kl = np.clip(logp - old_logp, -20, 20)
  ratio = np.exp(neg_kl)
  ppo_kl = verl_masked_mean(-neg_kl, mask)
  l1 = -advantages * ratio
  l2 = -advantages * np.clip(ratio, 1 - clip_low, 1 + clip_high)
  c1 = np.maximum(l1, l2)
  clipfrac = verl_masked_mean((l2 > l1).astype(float), mask)
  l3 = -advantages * clip_c
  c2 = np.minimum(l3, c1)
  clipfrac_lower = verl_masked_mean(((c1 > l3) & (advantages < 0)).astype(float), mask)
  pg = np.where(advantages < 0, c2, c1)
  return verl_agg_loss(pg, mask, mode), clipfrac, ppo_kl, clipfrac_lower


def verl_gspo_policy_loss(old_logp, logp, advantages, mask, clip_low, clip_high):
  neg_kl = logp - old_logp
  seq = (neg_kl * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
  # value of log_prob - log_prob.detach() + seq.detach() is seq at every token
  ratio = np.exp(np.minimum(np.broadcast_to(seq[:, None], logp.shape), 10.0))
  l1 = -advantages * ratio
  l2 = -advantages * np.clip(ratio, 1 - clip_low, 1 + clip_high)
  return verl_agg_loss(np.maximum(l1, l2), mask, "seq-mean-token-mean")


def verl_value_loss(vpreds, returns, values, mask, clip):
  clipped = np.clip(vpreds, values - clip, values + clip)
  l1 = (vpreds - returns) ** 2
  l2 = (clipped - returns) ** 2
  return 0.5 * verl_agg_loss(np.maximum(l1, l2), mask, "token-mean"), verl_masked_mean(
      (l2 > l1).astype(float), mask)


# ---------------- TRL transcription ----------------


def trl_advantages(rewards, group, scale_rewards=True):
  grouped = rewards.reshape(-1, group)
  mean = np.repeat(grouped.mean(1), group)
  std = np.repeat(grouped.std(1, ddof=1), group)
  out = rewards - mean
  return out / (std + 1e-4) if scale_rewards else out


def trl_grpo_loss(logp, old_logp, ref_logp, advantages, mask, eps_low, eps_high, beta, loss_type,
                  max_completion_length):
  ratio = np.exp(logp - old_logp)
  clipped = np.clip(ratio, 1 - eps_low, 1 + eps_high)
  per_token = -np.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
  if beta:
    per_token = per_token + beta * (np.exp(ref_logp - logp) - (ref_logp - logp) - 1)
  if loss_type == "grpo":
    return ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
  if loss_type == "bnpo":
    return (per_token * mask).sum() / max(mask.sum(), 1)
  if loss_type == "dr_grpo":
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
  raise ValueError(loss_type)


# ---------------- the comparisons ----------------


def _inputs(seed, p=4, g=4, t=12, scale=0.3):
  rng = np.random.default_rng(seed)
  b = p * g
  rewards = rng.integers(0, 3, size=b).astype(np.float64) + rng.normal(scale=0.1, size=b)
  old = -rng.uniform(0.05, 4.0, size=(b, t))
  logp = old + rng.normal(scale=scale, size=(b, t))
  ref = old + rng.normal(scale=scale, size=(b, t))
  lengths = rng.integers(1, t + 1, size=b)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
  return rewards, old, logp, ref, mask


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_match_verl_and_trl(seed):
  rewards, *_ , mask = _inputs(seed)
  p, g = 4, 4
  index = np.repeat(np.arange(p), g)
  r = jnp.asarray(rewards.reshape(p, g), jnp.float32)
  np.testing.assert_allclose(
      np.ravel(adv.group_normalized_advantages(r)), verl_grpo_outcome_advantage(rewards, index),
      rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(
      np.ravel(adv.group_normalized_advantages(r, eps=1e-4)), trl_advantages(rewards, g),
      rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(
      np.ravel(registry.get("group_advantage", "dr_grpo")(r)),
      verl_grpo_outcome_advantage(rewards, index, norm_by_std=False), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(
      np.ravel(adv.rloo_advantages(r)), verl_rloo_outcome_advantage(rewards, index),
      rtol=1e-4, atol=1e-5)
  # REINFORCE++ with a baseline: verl whitens over tokens (length-weighted, Bessel-corrected);
  # with equal lengths that is our per-rollout whitening up to the factor sqrt(n / (n - 1)).
  full = np.ones_like(mask)
  ref = verl_reinforce_pp_baseline(rewards, index, full)[:, 0]
  ours = np.ravel(registry.get("group_advantage", "reinforce_pp_baseline")(r))
  n = full.sum()
  np.testing.assert_allclose(ours, ref * math.sqrt(n / (n - 1)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_verl(seed):
  rng = np.random.default_rng(seed)
  *_, mask = _inputs(seed)
  b, t = mask.shape
  values = rng.normal(size=(b, t)) * mask  # verl masks values to the response
  token_rewards = np.zeros((b, t))
  last = mask.sum(1).astype(int) - 1
  token_rewards[np.arange(b), last] = rng.normal(size=b)
  dones = np.zeros((b, t), bool)
  dones[np.arange(b), last] = True
  ref_adv, ref_ret = verl_gae(token_rewards, values, mask, gamma=0.99, lam=0.95)
  a, ret = adv.generalized_advantage_estimation(
      *_f32(token_rewards, values), jnp.asarray(dones), gamma=0.99, lam=0.95)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(a)[valid], ref_adv[valid], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret)[valid], ref_ret[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_verl(kind):
  _, old, logp, ref, _ = _inputs(3, scale=1.0)
  ours = registry.get("kl", kind)(*_f32(logp, ref))
  if kind == "k3":  # verl clamps k3 to [-10, 10]; ours is unclamped so that k3 >= 0 holds
    assert float(ours.max()) > 10.0
    ours = jnp.minimum(ours, 10.0)
  np.testing.assert_allclose(ours, verl_kl_penalty(logp, ref, kind), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_matches_verl_vanilla_with_dual_clip(mode, clip):
  rewards, old, logp, _, mask = _inputs(4, scale=0.4)
  advantages = np.repeat(verl_grpo_outcome_advantage(rewards, np.repeat(np.arange(4), 4))[:, None],
                         old.shape[1], 1)
  ref_loss, clipfrac, ppo_kl, dual_frac = verl_vanilla_policy_loss(
      old, logp, advantages, mask, clip[0], clip[1], 3.0, mode)
  loss, met = losses.ppo_loss(*_f32(logp, old, advantages), jnp.asarray(mask, bool),
                              eps_low=clip[0], eps_high=clip[1], dual_clip=3.0, aggregation=mode)
  if mode == "seq-mean-token-sum-norm":
    ref_loss = ref_loss / old.shape[0]  # verl divides by T only; we (and TRL) by B * T
  assert float(loss) == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
  assert float(met["clip_frac"]) == pytest.approx(clipfrac, abs=1e-6)
  assert float(met["approx_kl"]) == pytest.approx(ppo_kl, rel=1e-4, abs=1e-6)
  assert float(met["dual_clip_frac"]) == pytest.approx(dual_frac, abs=1e-6)


def test_gspo_matches_verl():
  rewards, old, logp, _, mask = _inputs(5, scale=0.02)
  seq_adv = verl_grpo_outcome_advantage(rewards, np.repeat(np.arange(4), 4))
  advantages = np.repeat(seq_adv[:, None], old.shape[1], 1)
  ref = verl_gspo_policy_loss(old, logp, advantages, mask, 3e-4, 4e-4)
  loss, _ = losses.gspo_loss(*_f32(logp, old, advantages), jnp.asarray(mask, bool))
  assert float(loss) == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_value_loss_matches_verl():
  rng = np.random.default_rng(6)
  *_, mask = _inputs(6)
  values, vpreds, returns = (rng.normal(size=mask.shape) for _ in range(3))
  ref, ref_frac = verl_value_loss(vpreds, returns, values, mask, 0.2)
  loss, met = losses.clipped_value_loss(*_f32(vpreds, values, returns), jnp.asarray(mask, bool),
                                        clip_eps=0.2)
  assert float(loss) == pytest.approx(ref, rel=1e-4)
  assert float(met["value_clip_frac"]) == pytest.approx(ref_frac, abs=1e-6)


@pytest.mark.parametrize("loss_type,mode", [("grpo", "seq-mean-token-mean"),
                                            ("bnpo", "token-mean"),
                                            ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_types_match_trl(loss_type, mode, beta):
  rewards, old, logp, ref, mask = _inputs(7, scale=0.3)
  g = 4
  scale = loss_type != "dr_grpo"
  seq_adv = trl_advantages(rewards, g, scale_rewards=scale)
  ref_loss = trl_grpo_loss(logp, old, ref, seq_adv, mask, 0.2, 0.28, beta, loss_type,
                           max_completion_length=old.shape[1])
  name = "grpo" if scale else "dr_grpo"
  a = registry.get("group_advantage", name)(jnp.asarray(rewards.reshape(-1, g), jnp.float32),
                                      **({"eps": 1e-4} if scale else {}))
  lp, op, rp = _f32(logp, old, ref)
  m = jnp.asarray(mask, bool)
  loss, _ = losses.ppo_loss(lp, op, a.reshape(-1), m, eps_low=0.2, eps_high=0.28,
                            aggregation=mode)
  if beta:
    kl = registry.get("kl", "k3")(lp, rp)
    loss = loss + beta * losses.aggregate(kl, m, mode)
  assert float(loss) == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
