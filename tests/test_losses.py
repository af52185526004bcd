"""Policy losses, KL estimators, entropy, value loss, aggregation and KL controllers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import registry
from jaxrl_agents.objectives import losses


def _random_batch(seed=0, b=4, t=6, scale=0.3):
  rng = np.random.default_rng(seed)
  old = jnp.asarray(-rng.uniform(0.1, 3.0, size=(b, t)), jnp.float32)
  logp = old + jnp.asarray(rng.normal(scale=scale, size=(b, t)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=(b, t)) < 0.8).at[:, 0].set(True)
  return logp, old, adv, mask


def test_registered_names():
  assert {"ppo", "gspo", "cispo", "reinforce"} <= set(registry.names("policy_loss"))
  assert {"k1", "k2", "k3"} <= set(registry.names("kl"))
  assert {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
          "seq-mean-token-sum-norm"} <= set(registry.names("aggregation"))


# ----- aggregation -----

def test_aggregation_hand_values():
  v = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
  m = jnp.array([[True, True, True], [True, False, False]])
  agg = {n: registry.get("aggregation", n)(v, m) for n in registry.names("aggregation")}
  assert math.isclose(agg["token-mean"], 10 / 4, rel_tol=1e-6)
  assert math.isclose(agg["seq-mean-token-mean"], (2 + 4) / 2, rel_tol=1e-6)
  assert math.isclose(agg["seq-mean-token-sum"], (6 + 4) / 2, rel_tol=1e-6)
  assert math.isclose(agg["seq-mean-token-sum-norm"], 10 / (2 * 3), rel_tol=1e-6)
  assert math.isclose(losses.aggregate(v, m, "seq-mean-token-sum-norm", normalizer=5.0),
                      10 / (2 * 5), rel_tol=1e-6)
  # An empty row does not count in sequence means.
  m2 = m.at[1].set(False)
  assert math.isclose(registry.get("aggregation", "seq-mean-token-mean")(v, m2), 2.0)
  with pytest.raises(ValueError, match="unknown aggregation"):
    losses.aggregate(v, m, "tokenmean")


# ----- PPO family -----

def test_ppo_hand_values_and_clip_fractions():
  # ratios e^{0.5}=1.6487 (A=+1, clipped high), e^{-0.5}=0.6065 (A=-1, clipped low), 1.1 (A=2).
  old = jnp.zeros((1, 3))
  logp = jnp.log(jnp.array([[math.exp(0.5), math.exp(-0.5), 1.1]]))
  a = jnp.array([[1.0, -1.0, 2.0]])
  m = jnp.ones((1, 3), bool)
  loss, met = losses.ppo_loss(logp, old, a, m, eps_low=0.2, eps_high=0.28)
  expected = np.mean([-1.28, 0.8, -2.2])
  assert math.isclose(float(loss), expected, rel_tol=1e-5)
  assert math.isclose(float(met["clip_frac_high"]), 1 / 3, rel_tol=1e-6)
  assert math.isclose(float(met["clip_frac_low"]), 1 / 3, rel_tol=1e-6)
  assert math.isclose(float(met["ratio_max"]), math.exp(0.5), rel_tol=1e-5)
  # approx_kl = mean(old - logp) = -(0.5 - 0.5 + log 1.1)/3
  assert math.isclose(float(met["approx_kl"]), -math.log(1.1) / 3, rel_tol=1e-5)


def test_ppo_gradient_on_policy_is_minus_advantage():
  logp, _, adv, mask = _random_batch(1)
  g = jax.grad(lambda lp: losses.ppo_loss(lp, jax.lax.stop_gradient(lp), adv, mask)[0])(logp)
  n = mask.sum()
  np.testing.assert_allclose(g, np.where(mask, -adv / n, 0.0), rtol=1e-5, atol=1e-7)


def test_clipped_tokens_get_zero_gradient():
  logp, old, adv, mask = _random_batch(2, scale=0.6)
  g = jax.grad(lambda lp: losses.ppo_loss(lp, old, adv, mask, eps_low=0.1, eps_high=0.15)[0])(logp)
  ratio = np.exp(np.asarray(logp - old))
  clipped = ((ratio > 1.15) & (np.asarray(adv) > 0)) | ((ratio < 0.9) & (np.asarray(adv) < 0))
  assert clipped.any() and (~clipped & np.asarray(mask)).any()
  np.testing.assert_array_equal(np.asarray(g)[clipped], 0.0)
  assert np.all(np.asarray(g)[~clipped & np.asarray(mask)] != 0.0)
  np.testing.assert_array_equal(np.asarray(g)[~np.asarray(mask)], 0.0)


def test_symmetric_clip_equals_eps_low_eq_eps_high():
  logp, old, adv, mask = _random_batch(3, scale=0.5)
  a, ma = losses.ppo_loss(logp, old, adv, mask, eps_low=0.2)
  b, mb = losses.ppo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
  ratio = jnp.exp(logp - old)
  sym = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
  c = (sym * mask).sum() / mask.sum()
  assert float(a) == float(b)
  assert math.isclose(float(a), float(c), rel_tol=1e-6)
  assert float(ma["clip_frac"]) == float(mb["clip_frac"])


def test_dual_clip_bounds_negative_advantage_loss():
  old = jnp.zeros((1, 2))
  logp = jnp.log(jnp.array([[10.0, 10.0]]))
  a = jnp.array([[-1.0, 1.0]])
  m = jnp.ones((1, 2), bool)
  plain, _ = losses.ppo_loss(logp, old, a, m)
  dual, met = losses.ppo_loss(logp, old, a, m, dual_clip=3.0)
  # token 0: plain loss = max(10, 1.2) = 10, dual = min(10, 3) = 3; token 1: -1.2 both ways.
  assert math.isclose(float(plain), (10 - 1.2) / 2, rel_tol=1e-5)
  assert math.isclose(float(dual), (3 - 1.2) / 2, rel_tol=1e-5)
  assert math.isclose(float(met["dual_clip_frac"]), 0.5)
  with pytest.raises(ValueError, match="dual_clip"):
    losses.ppo_loss(logp, old, a, m, dual_clip=0.5)


def test_gspo_sequence_ratio_and_gradient():
  logp, old, _, mask = _random_batch(4, scale=0.05)
  seq_adv = jnp.array([1.0, -0.5, 2.0, -1.0])
  loss, met = losses.gspo_loss(logp, old, seq_adv, mask, eps_low=1.0, eps_high=1.0)
  m = np.asarray(mask, np.float32)
  s = np.exp(((np.asarray(logp - old)) * m).sum(1) / m.sum(1))
  assert math.isclose(float(loss), float(np.mean(-np.asarray(seq_adv) * s)), rel_tol=1e-5)
  assert math.isclose(float(met["ratio_max"]), float(s.max()), rel_tol=1e-5)

  # Unclipped, the gradient equals that of the sequence-level objective -mean_i A_i s_i.
  def seq_level(lp):
    sl = ((lp - old) * mask).sum(1) / mask.sum(1)
    return jnp.mean(-seq_adv * jnp.exp(sl))

  g = jax.grad(lambda lp: losses.gspo_loss(lp, old, seq_adv, mask, eps_low=1.0, eps_high=1.0)[0])
  np.testing.assert_allclose(g(logp), jax.grad(seq_level)(logp), rtol=1e-5, atol=1e-7)
  # With the paper's tiny ranges most sequences are clipped and lose their gradient.
  _, met = losses.gspo_loss(logp + 0.05, old, seq_adv, mask)
  assert float(met["clip_frac"]) > 0.5


def test_cispo_weight_is_clipped_and_stop_gradient():
  old = jnp.zeros((1, 3))
  logp = jnp.log(jnp.array([[2.0, 0.5, 1.0]]))
  a = jnp.array([[1.0, 1.0, -1.0]])
  m = jnp.ones((1, 3), bool)
  loss, met = losses.cispo_loss(logp, old, a, m, eps_high=0.2)
  # weights: min(2, 1.2) = 1.2, 0.5 (no lower bound), 1.0.
  expected = -(1.2 * math.log(2.0) + 0.5 * math.log(0.5) - 0.0) / 3
  assert math.isclose(float(loss), expected, rel_tol=1e-5)
  g = jax.grad(lambda lp: losses.cispo_loss(lp, old, a, m, eps_high=0.2)[0])(logp)
  # Clipped tokens keep their gradient (unlike PPO): d/dlogp = -w A / 3.
  np.testing.assert_allclose(g, [[-1.2 / 3, -0.5 / 3, 1.0 / 3]], rtol=1e-5)
  assert math.isclose(float(met["clip_frac_high"]), 1 / 3, rel_tol=1e-6)
  _, met_low = losses.cispo_loss(logp, old, a, m, eps_low=0.2)
  assert math.isclose(float(met_low["clip_frac_low"]), 1 / 3, rel_tol=1e-6)


def test_reinforce_and_family_agree_on_policy():
  logp, _, adv, mask = _random_batch(5)
  grads = {}
  for name in ("ppo", "cispo", "reinforce"):
    fn = registry.get("policy_loss", name)
    grads[name] = jax.grad(lambda lp, fn=fn: fn(lp, jax.lax.stop_gradient(lp), adv, mask)[0])(logp)
  np.testing.assert_allclose(grads["ppo"], grads["reinforce"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grads["cispo"], grads["reinforce"], rtol=1e-5, atol=1e-7)
  loss, _ = losses.reinforce_loss(logp, logp, adv, mask)
  assert math.isclose(float(loss), float((-adv * logp * mask).sum() / mask.sum()), rel_tol=1e-5)


def test_policy_losses_jit_vmap_and_per_sequence_advantages():
  logp, old, adv, mask = _random_batch(6)
  seq_adv = adv[:, 0]
  for name in registry.names("policy_loss"):
    fn = registry.get("policy_loss", name)
    eager, _ = fn(logp, old, seq_adv, mask)
    jitted, _ = jax.jit(fn)(logp, old, jnp.broadcast_to(seq_adv[:, None], logp.shape), mask)
    assert math.isclose(float(eager), float(jitted), rel_tol=1e-5, abs_tol=1e-7), name
    stacked = jnp.stack([logp, logp * 0.9])
    per_problem = jax.vmap(lambda lp, fn=fn: fn(lp, old, adv, mask)[0])(stacked)
    assert math.isclose(float(per_problem[1]), float(fn(logp * 0.9, old, adv, mask)[0]),
                        rel_tol=1e-5, abs_tol=1e-7), name


def test_policy_loss_shape_errors():
  logp, old, adv, mask = _random_batch(7)
  with pytest.raises(ValueError, match="old_logp"):
    losses.ppo_loss(logp, old[:, :3], adv, mask)
  with pytest.raises(ValueError, match="advantages"):
    losses.ppo_loss(logp, old, adv[:, :3], mask)
  with pytest.raises(ValueError, match="advantages"):
    losses.gspo_loss(logp, old, adv[:2, 0], mask)
  with pytest.raises(ValueError, match="mask"):
    losses.cispo_loss(logp, old, adv, mask[0])


# ----- KL, entropy, value -----

def test_kl_estimators_hand_values_and_identities():
  logp = jnp.array([[-1.0, -2.0]])
  ref = jnp.array([[-1.5, -1.0]])
  np.testing.assert_allclose(losses.kl_k1(logp, ref), [[0.5, -1.0]])
  np.testing.assert_allclose(losses.kl_k2(logp, ref), [[0.125, 0.5]])
  np.testing.assert_allclose(
      losses.kl_k3(logp, ref), [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]], rtol=1e-6)
  rng = np.random.default_rng(8)
  a = jnp.asarray(rng.normal(size=(5, 9)) * 3, jnp.float32)
  b = jnp.asarray(rng.normal(size=(5, 9)) * 3, jnp.float32)
  assert np.all(np.asarray(losses.kl_k3(a, b)) >= 0)
  for name in ("k1", "k2", "k3"):
    np.testing.assert_array_equal(registry.get("kl", name)(a, a), 0.0)


def test_k1_k3_unbiased_for_sampled_tokens():
  # E_{y ~ pi}[k1] = E[k3] = KL(pi || ref) exactly, computed over a 5-token vocabulary.
  pi = jax.nn.log_softmax(jnp.array([1.0, 0.2, -0.5, 2.0, 0.0]))
  ref = jax.nn.log_softmax(jnp.array([0.0, 0.5, 0.5, 1.0, -1.0]))
  exact = float(losses.kl_from_logits(pi, ref))
  weights = jnp.exp(pi)
  for est in (losses.kl_k1, losses.kl_k3):
    expectation = float(jnp.sum(weights * est(pi[None], ref[None])[0]))
    assert math.isclose(expectation, exact, rel_tol=1e-5)
  assert math.isclose(float(losses.reverse_kl_from_logits(pi, ref)), exact, rel_tol=1e-6)
  fwd = float(jnp.sum(jnp.exp(ref) * (ref - pi)))
  assert math.isclose(float(losses.forward_kl_from_logits(pi, ref)), fwd, rel_tol=1e-5)
  assert float(losses.forward_kl_from_logits(pi, pi)) == pytest.approx(0.0, abs=1e-7)


def test_kl_loss_and_reward_penalty():
  logp = jnp.array([[-1.0, -2.0, -3.0]])
  ref = jnp.array([[-1.5, -1.0, 0.0]])
  m = jnp.array([[True, True, False]])
  value, met = losses.kl_loss(logp, ref, m, estimator="k1")
  assert math.isclose(float(value), (0.5 - 1.0) / 2)
  r = jnp.array([[0.0, 1.0, 0.0]])
  penalized, met = losses.kl_reward_penalty(r, logp, ref, m, beta=0.1)
  np.testing.assert_allclose(penalized, [[-0.05, 1.1, 0.0]], rtol=1e-6)
  assert math.isclose(float(met["kl_penalty"]), -0.5, rel_tol=1e-6)
  g = jax.grad(lambda lp: losses.kl_reward_penalty(r, lp, ref, m, 0.1)[0].sum())(logp)
  np.testing.assert_array_equal(g, 0.0)


def test_entropy_from_logits():
  assert math.isclose(float(losses.entropy_from_logits(jnp.zeros(8))), math.log(8), rel_tol=1e-6)
  p = np.array([0.5, 0.25, 0.25])
  h = float(losses.entropy_from_logits(jnp.log(jnp.asarray(p))))
  assert math.isclose(h, -(p * np.log(p)).sum(), rel_tol=1e-6)
  assert float(losses.entropy_from_logits(jnp.array([0.0, -1e9]))) == pytest.approx(0.0, abs=1e-6)
  ent = losses.entropy_from_logits(jnp.zeros((2, 3, 4)))
  value, met = losses.entropy_bonus(ent, jnp.ones((2, 3), bool))
  assert math.isclose(float(value), math.log(4), rel_tol=1e-6) and "entropy" in met


def test_clipped_value_loss_hand_values():
  values = jnp.array([[1.0, 0.0]])
  old = jnp.array([[0.0, 0.0]])
  returns = jnp.array([[2.0, 1.0]])
  m = jnp.ones((1, 2), bool)
  loss, met = losses.clipped_value_loss(values, old, returns, m, clip_eps=0.2)
  # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 1: 1 both.
  assert math.isclose(float(loss), 0.5 * (3.24 + 1.0) / 2, rel_tol=1e-6)
  assert math.isclose(float(met["value_clip_frac"]), 0.5)
  loss, _ = losses.clipped_value_loss(values, old, returns, m, clip_eps=None)
  assert math.isclose(float(loss), 0.5 * (1.0 + 1.0) / 2, rel_tol=1e-6)
  g = jax.grad(lambda v: losses.clipped_value_loss(v, old, returns, m)[0])(values)
  assert float(g[0, 0]) == 0.0  # the clipped branch is constant in V


# ----- KL controllers -----

def test_adaptive_kl_controller():
  ctrl = losses.adaptive_kl_controller(init_beta=0.1, target=1.0, horizon=100)
  s = ctrl.init()
  up = jax.jit(ctrl.update)(s, 5.0, 10)  # error clipped to 0.2: beta * (1 + 0.2 * 0.1)
  assert math.isclose(float(up.beta), 0.1 * 1.02, rel_tol=1e-6)
  down = ctrl.update(s, 0.5, 10)  # error -0.5 -> -0.2
  assert math.isclose(float(down.beta), 0.1 * 0.98, rel_tol=1e-6)
  same = ctrl.update(s, 1.0, 10)
  assert math.isclose(float(same.beta), 0.1, rel_tol=1e-7)
  with pytest.raises(ValueError, match="target"):
    losses.adaptive_kl_controller(0.1, 0.0, 10)


def test_accuracy_conditioned_beta():
  accs = jnp.linspace(0, 1, 11)
  betas = np.asarray(jax.vmap(lambda a: losses.accuracy_conditioned_beta(a, 0.001, 0.1, 2.0))(accs))
  assert np.all(np.diff(betas) > 0) and betas[0] == pytest.approx(0.001)
  assert betas[-1] == pytest.approx(0.1) and betas[5] == pytest.approx(0.001 + 0.099 * 0.25)
  const = [float(losses.accuracy_conditioned_beta(a, 0.01, 0.04, 0.0)) for a in (0.0, 0.3, 1.0)]
  assert const == pytest.approx([0.04] * 3)
  ctrl = losses.accuracy_conditioned_kl_controller(0.0, 0.1, shape=1.0)
  assert float(ctrl.update(ctrl.init(), accuracy=0.5).beta) == pytest.approx(0.05)
  fixed = losses.fixed_kl_controller(0.04)
  assert float(fixed.update(fixed.init(), observed_kl=3.0).beta) == pytest.approx(0.04)
