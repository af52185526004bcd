"""Advantage estimators: hand-computed values, identities, jit/vmap, shape errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import registry
from jaxrl_agents.objectives import advantages as adv
from jaxrl_agents.objectives import credit
from jaxrl_agents.rollout import groups

R = jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_registered_names():
  assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"} <= \
      set(registry.names("group_advantage"))
  assert registry.names("component_advantage") == ["gdpo"]
  assert registry.names("token_advantage") == ["gae"]


def test_grpo_hand_values():
  # Row 0: mean 0.5, unbiased std sqrt(1/3) = 0.57735; row 1: mean 2, std sqrt(2/3) = 0.81650.
  a = adv.group_normalized_advantages(R, eps=0.0)
  s0, s1 = 0.5 / np.sqrt(1 / 3), 1.0 / np.sqrt(2 / 3)
  np.testing.assert_allclose(a, [[s0, -s0, -s0, s0], [s1, -s1, 0.0, 0.0]], rtol=1e-6)


def test_group_advantages_sum_to_zero_and_vanish_on_ties():
  rng = np.random.default_rng(0)
  r = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
  for name in ("grpo", "dr_grpo", "rloo"):
    a = registry.get("group_advantage", name)(r)
    np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-5)
    ties = registry.get("group_advantage", name)(jnp.full((3, 4), 0.7))
    np.testing.assert_array_equal(ties, 0.0)


def test_tied_groups_get_exact_zeros_when_the_reward_is_not_representable():
  # 0.2 and 1.2 are the race's short-wrong and short-correct rewards. In float32 the mean of
  # eight 0.2s is not 0.2, and (r - mean) / (std + eps) with std ~ 0 made that rounding an
  # advantage of about -0.0147 per reply; the same sum done as the estimators once did it:
  # (Which sizes and values round depends on the summation order; on this CPU some do.)
  naive = [(r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
           for g in (6, 7, 8) for v in (0.2, 1.2) for r in [jnp.full((1, g), v, jnp.float32)]]
  assert max(float(jnp.abs(a).max()) for a in naive) > 1e-3  # so the checks below can fail
  for value, g in itertools.product((0.2, 1.2, 0.1, 0.3, 1e-3, -0.7, 1.0), (7, 8)):
    tied = jnp.full((2, g), value, jnp.float32)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
      np.testing.assert_array_equal(registry.get("group_advantage", name)(tied), 0.0,
                                    err_msg=f"{name} at {value}")
    # eps = 0: an exact tie (1.0) is 0, not 0 / 0.
    np.testing.assert_array_equal(adv.group_normalized_advantages(tied, eps=0.0), 0.0)
    np.testing.assert_array_equal(adv.gdpo_advantages(tied[..., None], jnp.ones(1)), 0.0)
    np.testing.assert_array_equal(adv.standardize(tied, eps=0.0), 0.0)
    masked = jnp.concatenate([tied, jnp.full((2, 1), 5.0)], axis=1)
    keep = jnp.arange(g + 1)[None, :].repeat(2, 0) < g
    for m in (keep, keep.astype(jnp.float32)):  # a float mask works as a bool one
      np.testing.assert_array_equal(adv.standardize(masked, m)[:, :g], 0.0)
    turns = jnp.full((2 * g, 3), value, jnp.float32)
    for scope in ("batch", "group"):
      np.testing.assert_array_equal(
          credit.normalize_turn_rewards(turns, scope=scope, group_size=g, eps=0.0), 0.0)
    # GiGPO: every turn from the same state, equal returns.
    np.testing.assert_array_equal(credit.step_group_advantages(
        turns, jnp.zeros(turns.shape, jnp.int32), group_size=g), 0.0)
  # Every group tied, at different values: the group baseline leaves exact zeros, so the
  # batch whitening of REINFORCE++ has nothing to blow up.
  two = jnp.array([[1.2] * 8, [0.2] * 8], jnp.float32)
  np.testing.assert_array_equal(adv.reinforce_pp_baseline_advantages(two), 0.0)
  # Infinite rewards are not a tie: they stay non-finite for the run's checks.
  inf = jnp.full((1, 8), jnp.inf)
  for name in ("grpo", "dr_grpo", "rloo"):
    assert not np.isfinite(registry.get("group_advantage", name)(inf)).all(), name
  # Tie detection on the host (oversampling, drop_tied_groups, zero_variance_groups) is the
  # same rule: numpy's std of seven 0.2s is not 0, max == min is.
  seven = np.full((2, 7), 0.2, np.float32)
  seven[1, 0] = 1.2
  assert seven[0].std() != 0  # the rule it replaced would miss this tie
  np.testing.assert_array_equal(groups.tied_groups(seven), [True, False])
  assert not groups.tied_groups(np.full((1, 8), np.inf, np.float32))[0]  # as no_spread
  # A tied group beside one with spread: the tied one is 0, the other is untouched.
  mixed = jnp.array([[1.2] * 7 + [0.2], [0.2] * 8])
  a = adv.group_normalized_advantages(mixed, eps=0.0)
  np.testing.assert_array_equal(a[1], 0.0)
  s = np.sqrt(1 / 8)  # unbiased std of seven 1s and one 0 is sqrt(1/8); mean 7/8
  np.testing.assert_allclose(a[0], np.array([1 / 8] * 7 + [-7 / 8]) / s, rtol=1e-5)


def test_dr_grpo_is_grpo_without_std():
  np.testing.assert_allclose(
      registry.get("group_advantage", "dr_grpo")(R),
      adv.group_normalized_advantages(R, std_normalize=False))
  np.testing.assert_allclose(registry.get("group_advantage", "dr_grpo")(R)[1],
                             [1.0, -1.0, 0.0, 0.0])


def test_grpo_affine_invariance():
  rng = np.random.default_rng(1)
  r = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
  np.testing.assert_allclose(
      adv.group_normalized_advantages(r, eps=0.0),
      adv.group_normalized_advantages(3.0 * r + 5.0, eps=0.0), rtol=1e-4, atol=1e-5)


def test_rloo_hand_values():
  # Row 1: 3 - (1+2+2)/3 = 4/3, 1 - 7/3 = -4/3, 2 - 6/3 = 0, 0.
  np.testing.assert_allclose(
      adv.rloo_advantages(R)[1], [4 / 3, -4 / 3, 0.0, 0.0], rtol=1e-6)
  np.testing.assert_allclose(adv.rloo_advantages(R), 4 / 3 * adv.dr_grpo_advantages(R), rtol=1e-6)


def test_reinforce_pp_batch_whitened():
  a = adv.reinforce_pp_advantages(R, eps=0.0)
  flat = np.asarray(R).ravel()
  np.testing.assert_allclose(np.asarray(a).ravel(), (flat - flat.mean()) / flat.std(), rtol=1e-6)
  b = registry.get("group_advantage", "reinforce_pp_baseline")(R, eps=0.0)
  centred = np.asarray(adv.dr_grpo_advantages(R)).ravel()
  np.testing.assert_allclose(np.asarray(b).ravel(), centred / centred.std(), rtol=1e-6)
  # A single rollout per prompt is fine without a group baseline.
  assert adv.reinforce_pp_advantages(jnp.array([[1.0], [0.0]])).shape == (2, 1)


def test_gdpo_one_component_is_grpo():
  rng = np.random.default_rng(2)
  r = jnp.asarray(rng.normal(size=(4, 5, 1)), jnp.float32)
  np.testing.assert_allclose(
      adv.gdpo_advantages(r, jnp.ones(1), batch_normalize=False),
      adv.group_normalized_advantages(r[..., 0]), rtol=1e-5, atol=1e-6)
  a = adv.gdpo_advantages(r, jnp.ones(1))
  g = np.asarray(adv.group_normalized_advantages(r[..., 0])).ravel()
  np.testing.assert_allclose(np.asarray(a).ravel(), (g - g.mean()) / g.std(), rtol=1e-4, atol=1e-5)


def test_gdpo_separates_what_grpo_ties():
  # The catalog's example: r1 = [1,0,0,0], r2 = [0,1,1,0]; sum = [1,1,1,0].
  r = jnp.array([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]])
  grpo = adv.group_normalized_advantages(r.sum(-1))
  assert np.allclose(grpo[0, 0], grpo[0, 1]) and np.allclose(grpo[0, 1], grpo[0, 2])
  gdpo = adv.gdpo_advantages(r, jnp.ones(2), batch_normalize=False)
  # Component 1: centred [.75, -.25, -.25, -.25], unbiased std 0.5;
  # component 2: centred [-.5, .5, .5, -.5], unbiased std sqrt(1/3).
  s1, s2 = np.sqrt(0.25), np.sqrt(1 / 3)
  expected = np.array([0.75 / s1 - 0.5 / s2, -0.25 / s1 + 0.5 / s2, -0.25 / s1 + 0.5 / s2,
                       -0.25 / s1 - 0.5 / s2])
  np.testing.assert_allclose(gdpo[0], expected, rtol=1e-5)
  assert not np.isclose(gdpo[0, 0], gdpo[0, 1])


def test_gdpo_component_scale_invariance_and_weights():
  rng = np.random.default_rng(3)
  r = jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)
  scaled = r.at[..., 1].multiply(10.0)
  np.testing.assert_allclose(adv.gdpo_advantages(r), adv.gdpo_advantages(scaled), rtol=1e-4,
                             atol=1e-5)
  only_first = adv.gdpo_advantages(r, jnp.array([1.0, 0.0]), batch_normalize=False)
  np.testing.assert_allclose(only_first, adv.group_normalized_advantages(r[..., 0]), rtol=1e-5,
                             atol=1e-6)


def _gae_reference(r, v, d, gamma, lam, bootstrap):
  b, t = r.shape
  out = np.zeros_like(r)
  for i in range(b):
    nxt_adv, nxt_v = 0.0, bootstrap[i]
    for s in reversed(range(t)):
      nd = 1.0 - d[i, s]
      delta = r[i, s] + gamma * nd * nxt_v - v[i, s]
      nxt_adv = delta + gamma * lam * nd * nxt_adv
      out[i, s], nxt_v = nxt_adv, v[i, s]
  return out


def test_gae_hand_values():
  # One step: delta = r + gamma V' - V; two steps with lam: A0 = d0 + gamma lam d1.
  r = jnp.array([[0.0, 1.0]])
  v = jnp.array([[0.5, 0.25]])
  d = jnp.array([[False, True]])
  a, ret = adv.generalized_advantage_estimation(r, v, d, gamma=0.9, lam=0.5)
  d1 = 1.0 - 0.25
  d0 = 0.0 + 0.9 * 0.25 - 0.5
  np.testing.assert_allclose(a, [[d0 + 0.9 * 0.5 * d1, d1]], rtol=1e-6)
  np.testing.assert_allclose(ret, a + v, rtol=1e-6)


def test_gae_lambda_limits_and_reference():
  rng = np.random.default_rng(4)
  b, t, gamma = 3, 7, 0.95
  r = rng.normal(size=(b, t)).astype(np.float32)
  v = rng.normal(size=(b, t)).astype(np.float32)
  d = np.zeros((b, t), bool)
  d[:, -1] = True
  d[0, 3] = True  # an episode boundary inside the first row
  boot = rng.normal(size=b).astype(np.float32)
  # lam = 0: TD errors.
  a0, _ = adv.generalized_advantage_estimation(r, v, d, gamma=gamma, lam=0.0)
  v_next = np.concatenate([v[:, 1:], boot[:, None]], 1)
  np.testing.assert_allclose(a0, r + gamma * (1 - d) * v_next - v, rtol=1e-5, atol=1e-6)
  # lam = 1: Monte-Carlo return minus V.
  a1, ret1 = adv.generalized_advantage_estimation(r, v, d, gamma=gamma, lam=1.0)
  mc = np.zeros_like(r)
  for i in range(b):
    g = 0.0
    for s in reversed(range(t)):
      g = r[i, s] + gamma * (0.0 if d[i, s] else g)
      mc[i, s] = g
  np.testing.assert_allclose(a1, mc - v, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret1, mc, rtol=1e-5, atol=1e-5)
  # Truncated (no done at the end) with a bootstrap value, against a loop.
  d2 = np.zeros((b, t), bool)
  a, _ = adv.generalized_advantage_estimation(r, v, d2, gamma=gamma, lam=0.7,
                                              bootstrap_value=boot)
  np.testing.assert_allclose(a, _gae_reference(r, v, d2, gamma, 0.7, boot), rtol=1e-5, atol=1e-5)


def test_jit_and_vmap():
  rng = np.random.default_rng(5)
  r = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)  # a leading batch of problems
  for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
    fn = registry.get("group_advantage", name)
    batched = jax.vmap(jax.jit(fn))(r)
    np.testing.assert_allclose(batched[1], fn(r[1]), rtol=1e-5, atol=1e-6)
  gdpo = jax.jit(adv.gdpo_advantages)
  r3 = jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32)
  np.testing.assert_allclose(gdpo(r3, jnp.array([1.0, 0.5])),
                             adv.gdpo_advantages(r3, jnp.array([1.0, 0.5])), rtol=1e-5)
  gae = jax.jit(lambda r, v, d: adv.generalized_advantage_estimation(r, v, d, lam=0.9)[0])
  rr, vv = r[0], r[1]
  dd = jnp.zeros((3, 4), bool)
  per_row = jax.vmap(lambda a, b, c: gae(a[None], b[None], c[None])[0])(rr, vv, dd)
  np.testing.assert_allclose(per_row, gae(rr, vv, dd), rtol=1e-5, atol=1e-6)


def test_shape_errors_name_the_argument():
  with pytest.raises(ValueError, match="rewards"):
    adv.group_normalized_advantages(jnp.ones(4))
  with pytest.raises(ValueError, match="at least 2"):
    adv.group_normalized_advantages(jnp.ones((4, 1)))
  with pytest.raises(ValueError, match="weights"):
    adv.gdpo_advantages(jnp.ones((2, 3, 2)), jnp.ones(3))
  with pytest.raises(ValueError, match="values"):
    adv.generalized_advantage_estimation(jnp.ones((2, 3)), jnp.ones((2, 4)),
                                         jnp.zeros((2, 3), bool))
  with pytest.raises(KeyError, match="grpo"):
    registry.get("group_advantage", "grpoo")


def test_standardize_uses_only_the_masked_entries():
  x = jnp.array([[1.0, 3.0, 100.0], [5.0, -50.0, 7.0]])
  mask = jnp.array([[True, True, False], [True, False, True]])
  out = np.asarray(adv.standardize(x, mask, eps=0.0))
  # The masked values 1, 3, 5, 7: mean 4, population variance (9 + 1 + 1 + 9) / 4 = 5.
  np.testing.assert_allclose(out[np.asarray(mask)], (np.array([1, 3, 5, 7]) - 4) / np.sqrt(5),
                             rtol=1e-6)
  flat = np.asarray(x).ravel()
  np.testing.assert_allclose(adv.standardize(jnp.asarray(flat), eps=0.0),
                             (flat - flat.mean()) / flat.std(), rtol=1e-5)
