"""Op tests for the preference and supervised objectives against hand-computed values."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import registry
from jaxrl_agents.objectives.losses import preference as pref

# -log sigmoid(x), written out (math.log1p(math.exp(-x))).
NLS = {
  2.0: 0.12692801104297263,
  1.0: 0.3132616875182228,
  0.5: 0.47407698418010663,
  0.0: 0.6931471805599453,  # log 2
  -0.5: 0.9740769841801068,
  -1.0: 1.3132616875182228,
  -1.5: 1.7014132779827524,
}
SIGMOID_MINUS_1 = 0.2689414213699951  # sigmoid(-1)


def close(actual, expected, rtol=1e-6, atol=1e-6):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- SFT


LOGP = jnp.array([[-1.0, -2.0, -jnp.inf], [-4.0, -5.0, -6.0]])
MASK = jnp.array([[True, True, False], [True, False, False]])


def test_sft_token_mean_hand_values():
  loss, metrics = pref.sft_nll(LOGP, MASK)
  close(loss, 7.0 / 3.0)  # (1 + 2 + 4) / 3; the -inf pad is ignored
  close(metrics["num_tokens"], 3.0)
  close(metrics["perplexity"], 10.312258501325767, rtol=1e-5)  # exp(7/3)


def test_sft_seq_mean_token_mean_and_jit():
  fn = jax.jit(pref.sft_nll, static_argnames="aggregation")
  loss, metrics = fn(LOGP, MASK, aggregation="seq-mean-token-mean")
  close(loss, 2.75)  # ((1 + 2) / 2 + 4) / 2
  close(metrics["token_nll"], 7.0 / 3.0)  # independent of the aggregation


def test_sft_gradient_is_minus_mask_over_tokens_and_finite_on_padding():
  grad = jax.grad(lambda lp: pref.sft_nll(lp, MASK)[0])(LOGP)
  assert np.all(np.isfinite(grad))
  close(grad, -MASK.astype(jnp.float32) / 3.0)


def test_sft_unknown_aggregation_and_shape_errors():
  with pytest.raises(ValueError, match="aggregation"):
    pref.sft_nll(LOGP, MASK, aggregation="token-median")
  with pytest.raises(ValueError, match="mask"):
    pref.sft_nll(LOGP, MASK[:, :2])
  with pytest.raises(ValueError, match="logp"):
    pref.sft_nll(LOGP[0], MASK[0])


# ----------------------------------------------------------------------------- Bradley-Terry


R_CHOSEN = jnp.array([2.0, 0.0, 1.0])
R_REJECTED = jnp.array([1.0, 1.0, 1.0])  # gaps r+ - r- = [1, -1, 0]


def test_bradley_terry_hand_values():
  loss, metrics = pref.bradley_terry_loss(R_CHOSEN, R_REJECTED)
  close(loss, (NLS[1.0] + NLS[-1.0] + NLS[0.0]) / 3)  # 0.7732235185321303
  close(metrics["accuracy"], 1.0 / 3.0)
  close(metrics["margin"], 0.0)
  close(metrics["chosen_reward"], 1.0)


def test_bradley_terry_with_scalar_and_per_pair_margin():
  loss, metrics = pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, margin=0.5)
  close(loss, (NLS[0.5] + NLS[-1.5] + NLS[-0.5]) / 3)  # 1.0498557487809885
  close(metrics["accuracy"], 1.0 / 3.0)  # the margin does not enter the accuracy
  loss, _ = pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, margin=jnp.array([1.0, 0.0, 0.0]))
  close(loss, (NLS[0.0] + NLS[-1.0] + NLS[0.0]) / 3)  # 0.8998520162127045


def test_bradley_terry_weights_drop_pairs_and_all_zero_gives_zero():
  loss, metrics = pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, weights=jnp.array([1.0, 0.0, 1.0]))
  close(loss, (NLS[1.0] + NLS[0.0]) / 2)  # 0.503204434039084
  close(metrics["accuracy"], 0.5)
  loss, _ = pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, weights=jnp.zeros(3))
  close(loss, 0.0)


def test_bradley_terry_shift_invariant_jit_and_vmap():
  fn = jax.jit(pref.bradley_terry_loss)
  close(fn(R_CHOSEN + 7.0, R_REJECTED + 7.0)[0], fn(R_CHOSEN, R_REJECTED)[0])
  stacked = jax.vmap(lambda c, r: pref.bradley_terry_loss(c, r)[0])(
    jnp.stack([R_CHOSEN, R_REJECTED]), jnp.stack([R_REJECTED, R_CHOSEN])
  )
  close(stacked, [0.7732235185321303, 0.7732235185321303])  # symmetric gaps [1, -1, 0]


def test_bradley_terry_shape_errors_name_the_argument():
  with pytest.raises(ValueError, match="rejected_rewards"):
    pref.bradley_terry_loss(R_CHOSEN, R_REJECTED[:2])
  with pytest.raises(ValueError, match="chosen_rewards"):
    pref.bradley_terry_loss(R_CHOSEN[None], R_REJECTED[None])
  with pytest.raises(ValueError, match="weights"):
    pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, weights=jnp.ones(2))
  with pytest.raises(ValueError, match="margin"):
    pref.bradley_terry_loss(R_CHOSEN, R_REJECTED, margin=jnp.ones(4))


# ----------------------------------------------------------------------------- DPO / IPO / RPO


def _random_logps(n=4, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return tuple(-jnp.abs(jax.random.normal(k, (n,))) * 10.0 for k in keys)


def test_dpo_is_log2_when_policy_equals_reference():
  chosen, rejected, _, _ = _random_logps()
  for eps in (0.0, 0.2):
    loss, metrics = pref.dpo_loss(chosen, rejected, chosen, rejected, beta=0.3, label_smoothing=eps)
    close(loss, NLS[0.0])
    close(metrics["reward_margin"], 0.0)
    close(metrics["reward_accuracy"], 0.0)  # strict: ties are not counted


def test_dpo_hand_values():
  # log-ratios +1 (chosen) and -1 (rejected): h = 2, z = beta * h = 1.
  args = (jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]), jnp.array([-2.0]))
  loss, metrics = pref.dpo_loss(*args, beta=0.5)
  close(loss, NLS[1.0])
  close(metrics["chosen_reward"], 0.5)
  close(metrics["rejected_reward"], -0.5)
  close(metrics["reward_margin"], 1.0)
  close(metrics["reward_accuracy"], 1.0)
  # Conservative DPO: 0.9 * -log sigmoid(1) + 0.1 * -log sigmoid(-1).
  loss, _ = pref.dpo_loss(*args, beta=0.5, label_smoothing=0.1)
  close(loss, 0.41326168751822284)
  # Gradient: dL/d chosen_logp = -beta * sigmoid(-z).
  grad = jax.grad(lambda c: pref.dpo_loss(c, *args[1:], beta=0.5)[0])(args[0])
  close(grad, [-0.5 * SIGMOID_MINUS_1])


def test_dpo_jit_vmap_and_single_trace():
  logps = _random_logps(n=6)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def batched(c, r, rc, rr):
    return jax.vmap(lambda *a: pref.dpo_loss(*a, beta=0.1)[0])(c, r, rc, rr)

  stacked = [x.reshape(2, 3) for x in logps]
  out = batched(*stacked)
  batched(*[x + 1.0 for x in stacked])  # a second call must not retrace
  expected = [pref.dpo_loss(*[x[i] for x in stacked], beta=0.1)[0] for i in range(2)]
  close(out, expected)


def test_dpo_errors_name_the_argument():
  c, r, rc, rr = _random_logps()
  with pytest.raises(ValueError, match="ref_rejected_logp"):
    pref.dpo_loss(c, r, rc, rr[:3])
  with pytest.raises(ValueError, match="chosen_logp"):
    pref.dpo_loss(c[None], r, rc, rr)
  with pytest.raises(ValueError, match="label_smoothing"):
    pref.dpo_loss(c, r, rc, rr, label_smoothing=0.7)


def test_ipo_at_reference_and_hand_values():
  chosen, rejected, _, _ = _random_logps()
  loss, _ = jax.jit(pref.ipo_loss)(chosen, rejected, chosen, rejected, 0.1)
  close(loss, 25.0, rtol=1e-5)  # (1 / (2 * 0.1))^2
  # h = [2, 0.5], target 1 / (2 * 0.5) = 1: ((2 - 1)^2 + (0.5 - 1)^2) / 2.
  c = jnp.array([-1.0, -1.0])
  r = jnp.array([-3.0, -1.5])
  ref = jnp.array([-2.0, -1.0])
  loss, metrics = pref.ipo_loss(c, r, ref, ref, tau=0.5)
  close(loss, 0.625)
  close(metrics["log_ratio_margin"], 1.25)
  # The minimum sits at h = 1 / (2 tau): gap 2 with tau 0.25.
  close(pref.ipo_loss(c[:1], r[:1], ref[:1], ref[:1], tau=0.25)[0], 0.0)
  with pytest.raises(ValueError, match="tau"):
    pref.ipo_loss(c, r, ref, ref, tau=0.0)
  with pytest.raises(ValueError, match="rejected_logp"):
    pref.ipo_loss(c, r[:1], ref, ref)


def test_rpo_with_eta_zero_equals_dpo_in_value_and_gradient():
  c, r, rc, rr = _random_logps()
  nll = -c / 7.0

  def rpo(chosen):
    return pref.rpo_loss(chosen, r, rc, rr, nll, eta=0.0, beta=0.2, label_smoothing=0.1)[0]

  def dpo(chosen):
    return pref.dpo_loss(chosen, r, rc, rr, beta=0.2, label_smoothing=0.1)[0]

  close(rpo(c), dpo(c))
  close(jax.grad(rpo)(c), jax.grad(dpo)(c))


def test_rpo_hand_values_and_gradient_through_nll():
  args = (jnp.array([-1.0, -1.0]), jnp.array([-3.0, -3.0]), jnp.array([-2.0, -2.0]))
  args = (*args, jnp.array([-2.0, -2.0]))
  loss, metrics = jax.jit(pref.rpo_loss)(*args, jnp.array([2.0, 4.0]), 0.5, 0.5)
  close(metrics["dpo_loss"], NLS[1.0])
  close(metrics["sft_nll"], 3.0)
  close(loss, NLS[1.0] + 0.5 * 3.0)
  # With chosen_nll = -chosen_logp the SFT term adds -eta / N to the chosen gradient.
  grad = jax.grad(lambda c: pref.rpo_loss(c, *args[1:], -c, eta=0.5, beta=0.5)[0])(args[0])
  close(grad, [(-0.5 * SIGMOID_MINUS_1 - 0.5) / 2] * 2)
  with pytest.raises(ValueError, match="chosen_nll"):
    pref.rpo_loss(*args, jnp.ones(3))


# ----------------------------------------------------------------------------- CPL


CPL_CHOSEN = jnp.array([[-1.0, -2.0, -jnp.inf]])
CPL_CHOSEN_MASK = jnp.array([[True, True, False]])
CPL_REJECTED = jnp.array([[-3.0, -1.0, -2.0]])
CPL_REJECTED_MASK = jnp.array([[True, True, True]])


def test_cpl_hand_values():
  # gamma = 0.5: S+ = -1 + 0.5 * -2 = -2, S- = -3 - 0.5 - 0.5 = -4; alpha * 2 = 1.
  loss, metrics = pref.cpl_loss(
    CPL_CHOSEN, CPL_REJECTED, CPL_CHOSEN_MASK, CPL_REJECTED_MASK, alpha=0.5, gamma=0.5
  )
  close(loss, NLS[1.0])
  close(metrics["chosen_score"], -2.0)
  close(metrics["rejected_score"], -4.0)
  close(metrics["accuracy"], 1.0)
  # Left padding gives the same: the discount counts valid tokens, not columns.
  left_chosen = jnp.array([[-jnp.inf, -1.0, -2.0]])
  left_mask = jnp.array([[False, True, True]])
  loss_left, _ = jax.jit(pref.cpl_loss)(
    left_chosen, CPL_REJECTED, left_mask, CPL_REJECTED_MASK, 0.5, 0.5
  )
  close(loss_left, NLS[1.0])


def test_cpl_gradient_hand_values():
  grads = jax.grad(
    lambda c, r: pref.cpl_loss(c, r, CPL_CHOSEN_MASK, CPL_REJECTED_MASK, 0.5, 0.5)[0],
    argnums=(0, 1),
  )(CPL_CHOSEN, CPL_REJECTED)
  # dL/dlogp+_t = -alpha * sigmoid(-1) * gamma^t, dL/dlogp-_t = +alpha * sigmoid(-1) * gamma^t.
  scale = 0.5 * SIGMOID_MINUS_1
  close(grads[0], [[-scale, -scale * 0.5, 0.0]])
  close(grads[1], [[scale, scale * 0.5, scale * 0.25]])


def test_cpl_swapping_the_pair_flips_the_gradient():
  key_c, key_r = jax.random.split(jax.random.PRNGKey(1))
  chosen = -jnp.abs(jax.random.normal(key_c, (3, 5)))
  rejected = -jnp.abs(jax.random.normal(key_r, (3, 5)))
  mask = jnp.array([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])

  def grad_wrt(c, r, gamma=0.9):
    loss = lambda c, r: pref.cpl_loss(c, r, mask, mask, 0.7, gamma)[0]
    return jax.grad(loss, argnums=(0, 1))(c, r)

  g_c, g_r = grad_wrt(chosen, rejected)
  s_r, s_c = grad_wrt(rejected, chosen)  # the same sequences with the roles swapped
  valid = np.asarray(mask)
  assert np.all(np.asarray(g_c)[valid] < 0)  # descent raises the chosen log-probs
  assert np.all(np.asarray(g_r)[valid] > 0)
  assert np.all(np.sign(g_c)[valid] == -np.sign(s_c)[valid])
  assert np.all(np.sign(g_r)[valid] == -np.sign(s_r)[valid])
  # At a tie (equal scores: a permutation with gamma = 1), the swap negates it exactly.
  full = jnp.ones((3, 5), bool)
  tied = chosen[:, ::-1]
  g_c, g_r = jax.grad(lambda c, r: pref.cpl_loss(c, r, full, full, 0.7)[0], (0, 1))(chosen, tied)
  s_r, s_c = jax.grad(lambda c, r: pref.cpl_loss(c, r, full, full, 0.7)[0], (0, 1))(tied, chosen)
  close(g_c, -s_c)
  close(g_r, -s_r)
  close(g_c, jnp.full((3, 5), -0.7 * 0.5 / 3))  # -alpha * sigmoid(0) / N


def test_cpl_vmap_and_shape_errors():
  stacked = jax.vmap(
    lambda c, r: pref.cpl_loss(c, r, CPL_CHOSEN_MASK, CPL_REJECTED_MASK, 0.5, 0.5)[0]
  )(jnp.stack([CPL_CHOSEN, CPL_CHOSEN]), jnp.stack([CPL_REJECTED, CPL_REJECTED]))
  close(stacked, [NLS[1.0], NLS[1.0]])
  with pytest.raises(ValueError, match="chosen_mask"):
    pref.cpl_loss(CPL_CHOSEN, CPL_REJECTED, CPL_CHOSEN_MASK[:, :2], CPL_REJECTED_MASK)
  with pytest.raises(ValueError, match="rejected_logp"):
    pref.cpl_loss(
      CPL_CHOSEN,
      jnp.tile(CPL_REJECTED, (2, 1)),
      CPL_CHOSEN_MASK,
      jnp.tile(CPL_REJECTED_MASK, (2, 1)),
    )


# ----------------------------------------------------------------------------- RAFT


def test_raft_tie_break_by_index_and_nan_last():
  rewards = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [jnp.nan, -jnp.inf, 5.0, 1.0]])
  np.testing.assert_array_equal(
    pref.raft_select(rewards, 2),
    [[False, True, True, False], [True, True, False, False], [False, False, True, True]],
  )
  np.testing.assert_array_equal(pref.raft_select(rewards[:1], 1), [[False, True, False, False]])


def test_raft_selected_rewards_dominate_dropped_ones():
  # Few distinct values so that ties occur.
  rewards = jax.random.randint(jax.random.PRNGKey(2), (16, 6), 0, 4).astype(jnp.float32)
  select = jax.jit(pref.raft_select, static_argnames="k")
  for k in range(1, 7):
    keep = np.asarray(select(rewards, k=k))
    np.testing.assert_array_equal(keep.sum(-1), k)
    r = np.asarray(rewards)
    lowest_kept = np.where(keep, r, np.inf).min(-1)
    highest_dropped = np.where(keep, -np.inf, r).max(-1)
    assert np.all(lowest_kept >= highest_dropped)


def test_raft_with_k_equal_g_is_sft_on_everything():
  num_prompts, group_size, length = 3, 4, 5
  rewards = jax.random.normal(jax.random.PRNGKey(3), (num_prompts, group_size))
  logp = -jnp.abs(jax.random.normal(jax.random.PRNGKey(4), (num_prompts * group_size, length)))
  mask = jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, logp.shape)
  keep = pref.raft_select(rewards, group_size)
  assert bool(keep.all())
  raft, _ = pref.sft_nll(logp, mask & keep.reshape(-1)[:, None])
  sft, _ = pref.sft_nll(logp, mask)
  close(raft, sft)
  # k < G selects a strict subset and so changes the loss.
  keep_one = pref.raft_select(rewards, 1)
  raft_one, _ = pref.sft_nll(logp, mask & keep_one.reshape(-1)[:, None])
  assert not np.isclose(float(raft_one), float(sft))


def test_raft_vmap_and_errors():
  rewards = jnp.array([[[0.0, 1.0, 2.0]], [[2.0, 1.0, 0.0]]])  # [S=2, P=1, G=3]
  keep = jax.vmap(lambda r: pref.raft_select(r, 1))(rewards)
  np.testing.assert_array_equal(keep, [[[False, False, True]], [[True, False, False]]])
  for bad_k in (0, 4, 1.5):
    with pytest.raises(ValueError, match="k"):
      pref.raft_select(rewards[0], bad_k)
  with pytest.raises(ValueError, match="static"):
    jax.jit(pref.raft_select)(rewards[0], 1)
  with pytest.raises(ValueError, match="rewards"):
    pref.raft_select(rewards, 1)


# ----------------------------------------------------------------------------- SPO


def _strict_order_preferences(ranking):
  """preferences[i, j] = 1 if i is ranked above j; NaN on the diagonal (must be ignored)."""
  ranking = np.asarray(ranking)
  prefs = (ranking[:, None] < ranking[None, :]).astype(np.float32)
  np.fill_diagonal(prefs, np.nan)
  return prefs


def test_spo_transitive_preferences_give_normalized_ranks():
  rewards = pref.spo_win_rate_rewards(jnp.asarray(_strict_order_preferences([0, 1, 2]))[None])
  close(rewards, [[1.0, 0.5, 0.0]])
  ranking = [2, 0, 3, 1]  # sample i has rank ranking[i], 0 = best
  rewards = jax.jit(pref.spo_win_rate_rewards)(
    jnp.asarray(_strict_order_preferences(ranking))[None]
  )
  close(rewards, [[1.0 / 3.0, 1.0, 0.0, 2.0 / 3.0]])  # (G - 1 - rank) / (G - 1)


def test_spo_rock_paper_scissors_gives_one_half():
  rps = jnp.array([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # 0>1, 1>2, 2>0
  close(pref.spo_win_rate_rewards(rps), [[0.5, 0.5, 0.5]])


def test_spo_probabilities_and_vmap():
  prefs = jnp.array([[[9.0, 0.7], [0.3, -9.0]], [[0.0, 0.5], [0.5, 0.0]]])  # diagonal ignored
  close(pref.spo_win_rate_rewards(prefs), [[0.7, 0.3], [0.5, 0.5]])
  stacked = jax.vmap(pref.spo_win_rate_rewards)(jnp.stack([prefs, 1.0 - prefs]))
  close(stacked[1], [[0.3, 0.7], [0.5, 0.5]])


def test_spo_shape_errors():
  with pytest.raises(ValueError, match="preferences"):
    pref.spo_win_rate_rewards(jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match="preferences"):
    pref.spo_win_rate_rewards(jnp.ones((3, 3)))
  with pytest.raises(ValueError, match="preferences"):
    pref.spo_win_rate_rewards(jnp.ones((2, 1, 1)))


# ----------------------------------------------------------------------------- registry


def test_registered_preference_losses():
  expected = {
    "sft": pref.sft_nll,
    "bradley_terry": pref.bradley_terry_loss,
    "dpo": pref.dpo_loss,
    "ipo": pref.ipo_loss,
    "rpo": pref.rpo_loss,
    "cpl": pref.cpl_loss,
  }
  for name, fn in expected.items():
    assert registry.get("preference_loss", name) is fn
  assert set(expected) <= set(registry.names("preference_loss"))
