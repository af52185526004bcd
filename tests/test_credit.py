"""Op tests for jaxrl_agents.objectives.credit: hand-computed values, identities, jit/vmap,
shape errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.objectives import credit


def _np(x):
  return np.asarray(x)


# --- Turn rewards to token advantages (RLVMR) ---------------------------------------------


def test_normalize_turn_rewards_batch_scope_hand_values():
  r = jnp.array([[1.0, 2.0, 3.0], [0.0, 4.0, 9.0]])
  tm = jnp.array([[True, True, True], [False, True, False]])
  # valid: 1, 2, 3, 4 -> mean 2.5, population std sqrt(1.25) = 1.1180340
  out = credit.normalize_turn_rewards(r, tm, scope="batch", eps=0.0)
  expected = [[-1.3416408, -0.4472136, 0.4472136], [0.0, 1.3416408, 0.0]]
  np.testing.assert_allclose(_np(out), expected, rtol=1e-5, atol=1e-6)


def test_normalize_turn_rewards_group_scope_hand_values():
  # P=2 prompts x G=2 rollouts x K=2 turns.
  r = jnp.array([[1.0, 3.0], [5.0, 7.0], [2.0, 100.0], [4.0, 0.0]])
  tm = jnp.array([[True, True], [True, True], [True, False], [True, True]])
  out = credit.normalize_turn_rewards(r, tm, scope="group", group_size=2, eps=0.0)
  # group 0: mean 4, std sqrt(5) = 2.2360680; group 1 (valid 2, 4, 0): mean 2, std sqrt(8/3)
  expected = [
    [-1.3416408, -0.4472136],
    [0.4472136, 1.3416408],
    [0.0, 0.0],
    [1.2247449, -1.2247449],
  ]
  np.testing.assert_allclose(_np(out), expected, rtol=1e-5, atol=1e-6)
  # the invalid 100 does not leak into the statistics
  r2 = r.at[2, 1].set(-7.0)
  out2 = credit.normalize_turn_rewards(r2, tm, scope="group", group_size=2, eps=0.0)
  np.testing.assert_allclose(_np(out2), _np(out), atol=1e-6)


def test_normalize_turn_rewards_none_scope_and_no_std():
  r = jnp.array([[1.0, 2.0], [3.0, 6.0]])
  tm = jnp.array([[True, False], [True, True]])
  np.testing.assert_allclose(
    _np(credit.normalize_turn_rewards(r, tm, scope="none")), [[1.0, 0.0], [3.0, 6.0]]
  )
  # centring only: mean of 1, 3, 6 = 10/3
  out = credit.normalize_turn_rewards(r, tm, scope="batch", std_normalize=False)
  np.testing.assert_allclose(
    _np(out), [[1 - 10 / 3, 0.0], [3 - 10 / 3, 6 - 10 / 3]], rtol=1e-6, atol=1e-6
  )


def test_turn_rewards_to_token_advantages_broadcasts_hand_values():
  r = jnp.array([[1.0, 2.0, 3.0], [0.0, 4.0, 9.0]])
  tm = jnp.array([[True, True, True], [False, True, False]])
  turn_id = jnp.array([[0, 0, 1, 2, -1, 2], [1, 1, 1, 3, 0, 2]])
  mask = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]], bool)
  a0, a1, a2, a3 = -1.3416408, -0.4472136, 0.4472136, 1.3416408
  expected = [
    # turn 0, 0, 1, 2; turn_id -1 -> 0; mask False -> 0
    [a0, a0, a1, a2, 0.0, 0.0],
    # turn 1, 1; mask False; turn 3 out of range; turn 0 and 2 not in turn_mask
    [a3, a3, 0.0, 0.0, 0.0, 0.0],
  ]
  out = credit.turn_rewards_to_token_advantages(r, turn_id, mask, tm, scope="batch", eps=0.0)
  np.testing.assert_allclose(_np(out), expected, rtol=1e-5, atol=1e-6)
  # each valid token carries its turn's normalized value, masked tokens exactly 0
  turn_adv = credit.normalize_turn_rewards(r, tm, eps=0.0)
  for b in range(2):
    for t in range(6):
      k = int(turn_id[b, t])
      if mask[b, t] and 0 <= k < 3 and tm[b, k]:
        assert out[b, t] == pytest.approx(float(turn_adv[b, k]), abs=1e-6)
      else:
        assert out[b, t] == 0.0


def test_turn_rewards_to_token_advantages_jit_vmap():
  rng = np.random.default_rng(0)
  r = jnp.asarray(rng.normal(size=(3, 4, 3)), jnp.float32)
  tm = jnp.asarray(rng.random((3, 4, 3)) < 0.8)
  turn_id = jnp.asarray(rng.integers(-1, 4, size=(3, 4, 7)))
  mask = jnp.asarray(rng.random((3, 4, 7)) < 0.7)
  fn = functools.partial(credit.turn_rewards_to_token_advantages, scope="group", group_size=2)
  batched = jax.jit(jax.vmap(fn))(r, turn_id, mask, tm)
  for i in range(3):
    np.testing.assert_allclose(
      _np(batched[i]), _np(fn(r[i], turn_id[i], mask[i], tm[i])), rtol=1e-5, atol=1e-6
    )
  assert np.all(_np(batched)[~_np(mask)] == 0.0)


def test_turn_level_shape_errors_name_the_argument():
  r = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="turn_rewards"):
    credit.turn_rewards_to_token_advantages(
      jnp.zeros((2,)), jnp.zeros((2, 4), int), jnp.ones((2, 4), bool)
    )
  with pytest.raises(ValueError, match="mask"):
    credit.turn_rewards_to_token_advantages(r, jnp.zeros((2, 4), int), jnp.ones((2, 5), bool))
  with pytest.raises(ValueError, match="turn_mask"):
    credit.turn_rewards_to_token_advantages(
      r, jnp.zeros((2, 4), int), jnp.ones((2, 4), bool), jnp.ones((2, 2), bool)
    )
  with pytest.raises(ValueError, match="turn_id"):
    credit.turn_rewards_to_token_advantages(r, jnp.zeros((3, 4), int), jnp.ones((3, 4), bool))
  with pytest.raises(ValueError, match="group_size"):
    credit.normalize_turn_rewards(r, scope="group", group_size=3)
  with pytest.raises(ValueError, match="scope"):
    credit.normalize_turn_rewards(r, scope="prompt")


# --- Potential-based shaping -------------------------------------------------------------


# --- Turn returns and GiGPO step groups ---------------------------------------------------


def test_turn_returns_hand_values():
  r = jnp.array([[1.0, 0.0, 2.0], [0.5, 3.0, 7.0]])
  tm = jnp.array([[True, True, True], [True, True, False]])
  out = credit.turn_returns(r, tm, gamma=0.5)
  # row 0: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
  # row 1 (turn 2 invalid): G1 = 3, G0 = 0.5 + 1.5 = 2
  np.testing.assert_allclose(_np(out), [[1.5, 1.0, 2.0], [2.0, 3.0, 0.0]], rtol=1e-6)
  # gamma = 1: the first turn's return is the episode's return.
  full = credit.turn_returns(r, tm, gamma=1.0)
  np.testing.assert_allclose(_np(full[:, 0]), _np(jnp.where(tm, r, 0).sum(1)), rtol=1e-6)


def test_step_group_advantages_hand_values():
  # One group of G = 3 episodes, K = 2 turns. Keys: every turn 0 is state 7;
  # turn 1 of episodes 0 and 1 is state 4, of episode 2 state 5 (alone).
  returns = jnp.array([[1.0, 1.0], [0.0, 0.0], [0.5, 2.0]])
  keys = jnp.array([[7, 4], [7, 4], [7, 5]], jnp.int32)
  out = credit.step_group_advantages(returns, keys, group_size=3, std_normalize=False)
  # state 7: mean 0.5 -> 0.5, -0.5, 0; state 4: mean 0.5 -> 0.5, -0.5; state 5 alone -> 0
  np.testing.assert_allclose(_np(out), [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]], atol=1e-6)
  normed = credit.step_group_advantages(returns, keys, group_size=3, eps=0.0)
  # state 7: std sqrt(1/6) = 0.4082483; state 4: std 0.5
  np.testing.assert_allclose(_np(normed), [[1.2247449, 1.0], [-1.2247449, -1.0], [0.0, 0.0]],
                             rtol=1e-5, atol=1e-6)


def test_step_groups_stay_inside_their_group_and_skip_invalid_turns():
  # Two groups of G = 2 share key 3; only turns of the same group are compared.
  returns = jnp.array([[1.0, 9.0], [3.0, 9.0], [10.0, 9.0], [20.0, 9.0]])
  keys = jnp.array([[3, 1], [3, -1], [3, 1], [3, 1]], jnp.int32)
  tm = jnp.array([[True, True], [True, True], [True, False], [True, True]])
  out = credit.step_group_advantages(returns, keys, tm, group_size=2, std_normalize=False)
  # group 0: key 3 -> mean 2; key 1 has one keyed turn (row 1's key is -1) -> 0
  # group 1: key 3 -> mean 15; key 1: row 2's turn is invalid -> row 3 alone -> 0
  np.testing.assert_allclose(_np(out), [[-1.0, 0.0], [1.0, 0.0], [-5.0, 0.0], [5.0, 0.0]],
                             atol=1e-6)


def test_step_group_advantages_match_a_loop_reference():
  rng = np.random.default_rng(0)
  p, g, k = 3, 4, 5
  returns = rng.normal(size=(p * g, k)).astype(np.float32)
  keys = rng.integers(-1, 4, size=(p * g, k)).astype(np.int32)
  tm = rng.random((p * g, k)) < 0.8
  out = _np(jax.jit(functools.partial(credit.step_group_advantages, group_size=g, eps=1e-6))(
      jnp.asarray(returns), jnp.asarray(keys), jnp.asarray(tm)))
  for b in range(p * g):
    for t in range(k):
      rows = range(b // g * g, b // g * g + g)
      peers = [returns[i, j] for i in rows for j in range(k)
               if tm[i, j] and keys[i, j] == keys[b, t] and keys[i, j] >= 0]
      want = 0.0 if not (tm[b, t] and keys[b, t] >= 0) else \
          (returns[b, t] - np.mean(peers)) / (np.std(peers) + 1e-6)
      np.testing.assert_allclose(out[b, t], want, rtol=1e-4, atol=1e-5)


def test_step_group_advantages_errors():
  with pytest.raises(ValueError, match="state_keys"):
    credit.step_group_advantages(jnp.zeros((4, 2)), jnp.zeros((4, 3), jnp.int32), group_size=2)
  with pytest.raises(ValueError, match="group_size"):
    credit.step_group_advantages(jnp.zeros((4, 2)), jnp.zeros((4, 2), jnp.int32), group_size=3)


# --- Multi-turn GAE (PPO's gae_level) ------------------------------------------------------

# One episode: prompt (2 columns), turn 0 at columns 2-4, an observation at 5-6, turn 1 at
# 7-8, padding at 9. The environment's columns carry garbage values that must not matter.
_MASK = jnp.array([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0]], bool)
_TURN_ID = jnp.array([[-1, -1, 0, 0, 0, -1, -1, 1, 1, -1]], jnp.int32)
_VALUES = jnp.array([[0.0, 0.0, 0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 9.0]])
_TURN_REWARDS = jnp.array([[1.0, 2.0]])
_TURN_MASK = jnp.array([[True, True]])


def test_rewards_at_turn_ends_hand_values():
  out = credit.rewards_at_turn_ends(_TURN_REWARDS, _TURN_ID, _MASK, _TURN_MASK)
  np.testing.assert_array_equal(_np(out), [[0, 0, 0, 0, 1, 0, 0, 0, 2, 0]])


def test_policy_token_gae_skips_the_environment_tokens():
  rewards = credit.rewards_at_turn_ends(_TURN_REWARDS, _TURN_ID, _MASK, _TURN_MASK)
  adv, ret = credit.policy_token_gae(rewards, _VALUES, _MASK, gamma=0.9, lam=0.8)
  # The policy tokens in order: values .1 .2 .3 .4 .5, rewards 0 0 1 0 2, done at the last.
  v, r = [0.1, 0.2, 0.3, 0.4, 0.5], [0.0, 0.0, 1.0, 0.0, 2.0]
  want, later = [0.0] * 5, 0.0
  for i in reversed(range(5)):
    next_v = v[i + 1] if i < 4 else 0.0
    later = r[i] + 0.9 * next_v - v[i] + 0.9 * 0.8 * later
    want[i] = later
  cols = [2, 3, 4, 7, 8]
  np.testing.assert_allclose(_np(adv)[0, cols], want, rtol=1e-5)
  np.testing.assert_allclose(_np(ret)[0, cols], np.add(want, v), rtol=1e-5)
  assert (_np(adv)[0, [0, 1, 5, 6, 9]] == 0).all()
  np.testing.assert_allclose(want[4], 1.5, rtol=1e-6)  # 2 - 0.5 by hand


def test_policy_token_gae_on_one_turn_is_plain_gae():
  """A single-turn stream (contiguous policy tokens): the old path, GAE with done at the last
  policy token, gives the same numbers."""
  from jaxrl_agents import types
  from jaxrl_agents.objectives import advantages

  rng = np.random.default_rng(0)
  mask = np.zeros((3, 12), bool)
  for row, (start, n) in enumerate([(4, 6), (4, 8), (4, 1)]):
    mask[row, start:start + n] = True
  rewards = np.where(_np(types.last_policy_token(jnp.asarray(mask))), rng.normal(size=(3, 1)),
                     0.0).astype(np.float32)
  values = np.where(mask, rng.normal(size=(3, 12)), 0.0).astype(np.float32)
  adv, ret = credit.policy_token_gae(jnp.asarray(rewards), jnp.asarray(values),
                                     jnp.asarray(mask), gamma=0.99, lam=0.9)
  ref_adv, ref_ret = advantages.generalized_advantage_estimation(
      jnp.asarray(rewards), jnp.asarray(values), types.last_policy_token(jnp.asarray(mask)),
      gamma=0.99, lam=0.9)
  np.testing.assert_allclose(_np(adv)[mask], _np(ref_adv)[mask], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_np(ret)[mask], _np(ref_ret)[mask], rtol=1e-5, atol=1e-6)


def test_turn_level_gae_hand_values():
  adv, ret = credit.turn_level_gae(_TURN_REWARDS, _VALUES, _TURN_ID, _MASK, _TURN_MASK,
                                   gamma=0.9, lam=0.8)
  # V_0 = 0.1, V_1 = 0.4 (each turn's first token). delta_1 = 2 - 0.4 = 1.6;
  # delta_0 = 1 + 0.9 * 0.4 - 0.1 = 1.26; A_0 = 1.26 + 0.72 * 1.6 = 2.412.
  np.testing.assert_allclose(_np(adv)[0], [0, 0, 2.412, 2.412, 2.412, 0, 0, 1.6, 1.6, 0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_np(ret)[0], [0, 0, 2.512, 2.512, 2.512, 0, 0, 2.0, 2.0, 0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      _np(credit.turn_values(_VALUES, _TURN_ID, _MASK, 2, at="last")), [[0.3, 0.5]])


def test_bilevel_gae_hand_values():
  adv, ret = credit.bilevel_gae(_TURN_REWARDS, _VALUES, _TURN_ID, _MASK, _TURN_MASK, gamma=1.0,
                                lam=1.0, turn_gamma=0.9, turn_lam=0.8)
  # The turn level with V_k at each turn's last token: V_0 = 0.3, V_1 = 0.5, delta_1 = 1.5,
  # delta_0 = 1 + 0.9 * 0.5 - 0.3 = 1.15, A_0 = 1.15 + 0.72 * 1.5 = 2.23: returns
  # G_0 = 2.53, G_1 = 2.0. With gamma = lam = 1 inside a turn every token's advantage is
  # G_k - V_t, and its return is G_k.
  np.testing.assert_allclose(_np(adv)[0], [0, 0, 2.43, 2.33, 2.23, 0, 0, 1.6, 1.5, 0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_np(ret)[0], [0, 0, 2.53, 2.53, 2.53, 0, 0, 2.0, 2.0, 0],
                             rtol=1e-5, atol=1e-6)
  # The last token of each turn carries the turn-level advantage whatever gamma, lam inside.
  adv2, _ = credit.bilevel_gae(_TURN_REWARDS, _VALUES, _TURN_ID, _MASK, _TURN_MASK, gamma=0.5,
                               lam=0.3, turn_gamma=0.9, turn_lam=0.8)
  np.testing.assert_allclose(_np(adv2)[0, [4, 8]], [2.23, 1.5], rtol=1e-5)


def test_multi_turn_gae_on_a_batch_matches_row_by_row_and_jits():
  mask = jnp.concatenate([_MASK, jnp.array([[0, 0, 1, 0, 0, 0, 0, 0, 0, 0]], bool)])
  turn_id = jnp.concatenate([_TURN_ID, jnp.array([[-1, -1, 0] + [-1] * 7], jnp.int32)])
  values = jnp.concatenate([_VALUES, jnp.full((1, 10), 0.25)])
  rewards = jnp.array([[1.0, 2.0], [3.0, 0.0]])
  tm = jnp.array([[True, True], [True, False]])
  fn = jax.jit(functools.partial(credit.bilevel_gae, gamma=0.9, lam=0.8, turn_gamma=0.9,
                                 turn_lam=0.8))
  both, _ = fn(rewards, values, turn_id, mask, tm)
  alone, _ = fn(rewards[1:], values[1:], turn_id[1:], mask[1:], tm[1:])
  np.testing.assert_allclose(_np(both)[1], _np(alone)[0], rtol=1e-6)
  np.testing.assert_allclose(_np(both)[1, 2], 3.0 - 0.25, rtol=1e-6)  # one token, one turn


def test_pbrs_hand_values():
  rewards = jnp.array([[1.0, 0.0, 2.0]])
  phi = jnp.array([[0.5, 1.0, 0.0, 3.0]])
  out = credit.potential_based_shaping(rewards, phi, 0.9)
  # 1 + 0.9*1 - 0.5, 0 + 0 - 1, 2 + 0.9*3 - 0
  np.testing.assert_allclose(_np(out), [[1.4, -1.0, 4.7]], rtol=1e-6)
  masked = credit.potential_based_shaping(rewards, phi, 0.9, jnp.array([[True, True, False]]))
  np.testing.assert_allclose(_np(masked), [[1.4, -1.0, 0.0]], rtol=1e-6)


def test_pbrs_telescopes_with_gamma_one():
  rng = np.random.default_rng(1)
  rewards = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
  phi = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
  shaped = jax.jit(credit.potential_based_shaping)(rewards, phi, 1.0)
  np.testing.assert_allclose(
    _np(shaped.sum(1)), _np(rewards.sum(1) + phi[:, -1] - phi[:, 0]), rtol=1e-5, atol=1e-5
  )
  # with a prefix mask of length n the sum telescopes to phi_n - phi_0
  n = np.array([6, 3, 1, 0, 4])
  tm = jnp.asarray(np.arange(6)[None, :] < n[:, None])
  shaped = credit.potential_based_shaping(rewards, phi, 1.0, tm)
  expected = (_np(rewards) * _np(tm)).sum(1) + _np(phi)[np.arange(5), n] - _np(phi)[:, 0]
  expected[n == 0] = 0.0
  np.testing.assert_allclose(_np(shaped.sum(1)), expected, rtol=1e-5, atol=1e-5)


def _value_iteration(expected_reward, transitions, gamma, iters=2000):
  """Q(s,a) = R(s,a) + gamma sum_s' P(s'|s,a) max_a' Q(s',a')."""
  q = np.zeros(expected_reward.shape)
  for _ in range(iters):
    q = expected_reward + gamma * transitions @ q.max(axis=1)
  return q


def test_pbrs_leaves_optimal_policy_of_tabular_mdp_unchanged():
  rng = np.random.default_rng(2)
  n_s, n_a, gamma = 5, 3, 0.9
  transitions = rng.dirichlet(np.ones(n_s), size=(n_s, n_a))  # P[s, a, s']
  reward = rng.normal(size=(n_s, n_a))
  phi = 3.0 * rng.normal(size=n_s)
  # Shaped reward of every (s, a, s') triple through the library function, as K=1 "turns".
  s, a, s2 = np.meshgrid(np.arange(n_s), np.arange(n_a), np.arange(n_s), indexing="ij")
  rewards = jnp.asarray(reward[s, a].reshape(-1, 1), jnp.float32)
  potentials = jnp.asarray(np.stack([phi[s], phi[s2]], -1).reshape(-1, 2), jnp.float32)
  shaped = _np(credit.potential_based_shaping(rewards, potentials, gamma)).astype(np.float64)
  shaped = shaped.reshape(n_s, n_a, n_s)
  shaped_expected = (transitions * shaped).sum(-1)
  q = _value_iteration(reward, transitions, gamma)
  q_shaped = _value_iteration(shaped_expected, transitions, gamma)
  np.testing.assert_array_equal(q.argmax(1), q_shaped.argmax(1))
  # Ng et al.: Q'(s, a) = Q(s, a) - phi(s)
  np.testing.assert_allclose(q_shaped, q - phi[:, None], atol=1e-4)
  # a non-potential shaping of the same size does change the optimal policy here
  bonus = np.zeros((n_s, n_a))
  bonus[np.arange(n_s), q.argmin(1)] = 100.0
  assert not np.array_equal(
    q.argmax(1), _value_iteration(reward + bonus, transitions, gamma).argmax(1)
  )


def test_pbrs_vmap_and_shape_errors():
  rng = np.random.default_rng(3)
  rewards = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  phi = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
  batched = jax.vmap(credit.potential_based_shaping, in_axes=(0, 0, None))(rewards, phi, 0.5)
  np.testing.assert_allclose(
    _np(batched[1]), _np(credit.potential_based_shaping(rewards[1], phi[1], 0.5)), rtol=1e-6
  )
  with pytest.raises(ValueError, match="potentials"):
    credit.potential_based_shaping(rewards[0], phi[0, :, :4], 0.5)
  with pytest.raises(ValueError, match="rewards"):
    credit.potential_based_shaping(rewards[0, 0], phi[0], 0.5)


# --- IGPO information gain ---------------------------------------------------------------


def test_information_gain_hand_values_telescoping_and_noop_turn():
  p = jnp.array([[0.1, 0.3, 0.3, 0.8], [0.2, 0.5, 0.4, 0.9]])
  tm = jnp.array([[True, True, True], [True, True, False]])
  ig = jax.jit(credit.information_gain_rewards)(jnp.log(p), tm)
  # probability (not log-probability) differences; turn 1 of row 0 is a no-op -> 0
  np.testing.assert_allclose(_np(ig), [[0.2, 0.0, 0.5], [0.3, -0.1, 0.0]], atol=1e-6)
  np.testing.assert_allclose(_np(ig.sum(1)), [0.8 - 0.1, 0.4 - 0.2], atol=1e-6)


def test_information_gain_telescopes_to_last_valid_turn():
  rng = np.random.default_rng(4)
  logp = jnp.asarray(np.log(rng.uniform(0.01, 1.0, size=(6, 6))), jnp.float32)
  n = np.array([5, 0, 2, 3, 1, 4])
  tm = jnp.asarray(np.arange(5)[None, :] < n[:, None])
  ig = credit.information_gain_rewards(logp, tm)
  p = np.exp(_np(logp))
  np.testing.assert_allclose(_np(ig.sum(1)), p[np.arange(6), n] - p[:, 0], atol=1e-6)
  batched = jax.vmap(credit.information_gain_rewards)(logp[None], tm[None])
  np.testing.assert_allclose(_np(batched[0]), _np(ig), atol=1e-7)


def test_igpo_turn_rewards_puts_outcome_on_last_valid_turn():
  p = jnp.array([[0.1, 0.3, 0.3, 0.8], [0.2, 0.5, 0.4, 0.9], [0.2, 0.5, 0.4, 0.9]])
  tm = jnp.array([[True, True, True], [True, True, False], [False, False, False]])
  outcome = jnp.array([1.0, 0.5, 0.7])
  out = credit.igpo_turn_rewards(jnp.log(p), tm, outcome)
  np.testing.assert_allclose(
    _np(out), [[0.2, 0.0, 1.0], [0.3, 0.5, 0.0], [0.0, 0.0, 0.0]], atol=1e-6
  )
  added = credit.igpo_turn_rewards(jnp.log(p), tm, outcome, replace_last=False)
  np.testing.assert_allclose(
    _np(added), [[0.2, 0.0, 1.5], [0.3, 0.4, 0.0], [0.0, 0.0, 0.0]], atol=1e-6
  )


def test_igpo_shape_errors():
  with pytest.raises(ValueError, match="answer_logp"):
    credit.information_gain_rewards(jnp.zeros((2, 3)), jnp.ones((2, 3), bool))
  with pytest.raises(ValueError, match="outcome_rewards"):
    credit.igpo_turn_rewards(jnp.zeros((2, 4)), jnp.ones((2, 3), bool), jnp.zeros((3,)))


# --- OPRL --------------------------------------------------------------------------------


def test_implicit_step_rewards_hand_values_and_sum():
  logp = jnp.array([[-1.0, -2.0, -0.5, -1.0, -3.0]])
  ref = jnp.array([[-1.5, -1.0, -1.0, -1.0, -1.0]])
  turn_id = jnp.array([[0, 0, 1, 1, 2]])
  mask = jnp.array([[True, True, True, False, True]])
  out = jax.jit(credit.implicit_step_rewards, static_argnums=4)(logp, ref, turn_id, mask, 3, 0.1)
  np.testing.assert_allclose(_np(out), [[-0.05, 0.05, -0.2]], atol=1e-6)


def test_implicit_step_rewards_sum_to_trajectory_implicit_reward():
  rng = np.random.default_rng(5)
  b, t, k, beta = 4, 12, 3, 0.3
  logp = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
  ref = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
  turn_id = jnp.asarray(np.sort(rng.integers(0, k, size=(b, t)), axis=1))
  mask = jnp.asarray(rng.random((b, t)) < 0.7)
  steps = credit.implicit_step_rewards(logp, ref, turn_id, mask, k, beta)
  implicit = beta * ((_np(logp) - _np(ref)) * _np(mask)).sum(1)
  np.testing.assert_allclose(_np(steps.sum(1)), implicit, rtol=1e-5, atol=1e-5)
  # tokens with no turn are ignored
  tid = turn_id.at[:, 0].set(-1)
  steps2 = credit.implicit_step_rewards(logp, ref, tid, mask, k, beta)
  drop = beta * (_np(logp)[:, 0] - _np(ref)[:, 0]) * _np(mask)[:, 0]
  np.testing.assert_allclose(_np(steps2.sum(1)), implicit - drop, rtol=1e-5, atol=1e-5)


def test_combine_outcome_and_step_advantages():
  outcome = jnp.array([1.0, -1.0])
  step = jnp.array([[0.5, -1.0, 2.0], [0.0, 1.0, 1.0]])
  out = credit.combine_outcome_and_step_advantages(outcome, step, 0.5)
  np.testing.assert_allclose(_np(out), [[1.25, 0.5, 2.0], [-1.0, -0.5, -0.5]])
  np.testing.assert_allclose(
    _np(credit.combine_outcome_and_step_advantages(outcome, step, 0.0)),
    [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
  )
  # token level via turn_id
  turn_id = jnp.array([[0, 1, 2, 2], [2, 2, 0, -1]])
  mask = jnp.array([[True, True, True, False], [True, True, True, True]])
  tok = jax.jit(functools.partial(credit.combine_outcome_and_step_advantages, weight=0.5))(
    outcome, step, turn_id=turn_id, mask=mask
  )
  np.testing.assert_allclose(_np(tok), [[1.25, 0.5, 2.0, 0.0], [-0.5, -0.5, -1.0, -1.0]])
  tok0 = credit.combine_outcome_and_step_advantages(outcome, step, 0.0, turn_id=turn_id, mask=mask)
  np.testing.assert_allclose(_np(tok0), np.where(_np(mask), _np(outcome)[:, None], 0.0))
  # token-level step advantages directly
  step_tok = jnp.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(
    _np(credit.combine_outcome_and_step_advantages(outcome, step_tok, 2.0, mask=mask)),
    [[3.0, 5.0, 7.0, 0.0], [-1.0, -1.0, -1.0, -1.0]],
  )
  with pytest.raises(ValueError, match="step_adv"):
    credit.combine_outcome_and_step_advantages(outcome, step[:1], 0.5)
  with pytest.raises(ValueError, match="outcome_adv"):
    credit.combine_outcome_and_step_advantages(step, step, 0.5)


# --- R^3L --------------------------------------------------------------------------------


def test_pivotal_mask_masks_exactly_the_common_prefix():
  a = jnp.array([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0], [3, 3, 3, 3, 3]])
  b = jnp.array([[5, 6, 1, 8, 9], [1, 2, 3, 4, 0], [4, 3, 3, 3, 3]])
  mask_a = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], bool)
  out = jax.jit(credit.pivotal_mask)(a, b, mask_a)
  expected = [
    [False, False, True, True, True],  # diverges at 2; later re-agreement still kept
    [False, False, False, False, False],  # identical: no contrastive signal
    [False, True, True, True, True],  # diverges at 0; mask_a still applies
  ]
  np.testing.assert_array_equal(_np(out), expected)


def test_pivotal_mask_random_against_reference_and_vmap():
  rng = np.random.default_rng(6)
  a = rng.integers(0, 3, size=(8, 10))
  b = a.copy()
  cut = rng.integers(0, 11, size=8)
  for i, c in enumerate(cut):
    if c < 10:
      b[i, c] = (a[i, c] + 1) % 3
      b[i, c + 1 :] = rng.integers(0, 3, size=10 - c - 1)
  mask_a = rng.random((8, 10)) < 0.8
  out = _np(credit.pivotal_mask(jnp.asarray(a), jnp.asarray(b), jnp.asarray(mask_a)))
  expected = mask_a & (np.arange(10)[None, :] >= cut[:, None])
  np.testing.assert_array_equal(out, expected)
  batched = jax.vmap(credit.pivotal_mask)(
    jnp.asarray(a)[None], jnp.asarray(b)[None], jnp.asarray(mask_a)[None]
  )
  np.testing.assert_array_equal(_np(batched[0]), expected)


def test_pivotal_mask_with_mask_b_treats_padding_as_divergence():
  a = jnp.array([[1, 2, 0, 0]])
  b = jnp.array([[1, 2, 0, 0]])
  mask_a = jnp.array([[True, True, True, False]])
  mask_b = jnp.array([[True, True, False, False]])
  np.testing.assert_array_equal(_np(credit.pivotal_mask(a, b, mask_a)), [[False] * 4])
  np.testing.assert_array_equal(
    _np(credit.pivotal_mask(a, b, mask_a, mask_b)), [[False, False, True, False]]
  )
  with pytest.raises(ValueError, match="tokens_b"):
    credit.pivotal_mask(a, b[:, :3], mask_a)


def test_positive_amplification():
  adv = jnp.array([[-1.0, 0.0, 2.0]])
  np.testing.assert_allclose(_np(credit.positive_amplification(adv, 3.0)), [[-1.0, 0.0, 6.0]])
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
  np.testing.assert_array_equal(_np(jax.jit(credit.positive_amplification)(x, 1.0)), _np(x))
  amp = credit.positive_amplification(x, 2.0)
  np.testing.assert_allclose(_np(amp), np.where(_np(x) > 0, 2 * _np(x), _np(x)))


# --- SPIRAL RAE --------------------------------------------------------------------------


def test_role_conditioned_advantages_hand_values():
  rewards = jnp.array([1.0, -1.0, 1.0, 1.0])
  role = jnp.array([0, 1, 0, 1])
  adv, baseline = jax.jit(credit.role_conditioned_advantages, static_argnums=3)(
    rewards, role, jnp.zeros(2), 2, 0.5
  )
  # A0 = 1, b0 = 0.5; A1 = -1, b1 = -0.5; A2 = 1 - 0.5, b0 = 0.75; A3 = 1 + 0.5, b1 = 0.25
  np.testing.assert_allclose(_np(adv), [1.0, -1.0, 0.5, 1.5])
  np.testing.assert_allclose(_np(baseline), [0.75, 0.25])
  valid = jnp.array([True, True, False, True])
  adv, baseline = credit.role_conditioned_advantages(rewards, role, jnp.zeros(2), 2, 0.5, valid)
  np.testing.assert_allclose(_np(adv), [1.0, -1.0, 0.0, 1.5])
  np.testing.assert_allclose(_np(baseline), [0.5, 0.25])
  with pytest.raises(ValueError, match="baseline"):
    credit.role_conditioned_advantages(rewards, role, jnp.zeros(3), 2, 0.5)
  with pytest.raises(ValueError, match="role"):
    credit.role_conditioned_advantages(rewards, role[:3], jnp.zeros(2), 2, 0.5)


def test_role_baseline_removes_first_mover_edge():
  rae = credit.role_baseline(num_roles=2, decay=0.95)
  update = jax.jit(rae.update)
  state = rae.init()
  rng = np.random.default_rng(8)
  games, steps, warmup = 32, 200, 50
  advs, raws = {0: [], 1: []}, {0: [], 1: []}
  for step in range(steps):
    first_wins = rng.random(games) < 0.7  # player 0 wins 70% of zero-sum games
    r0 = np.where(first_wins, 1.0, -1.0)
    rewards = np.stack([r0, -r0], 1).reshape(-1)
    role = np.tile([0, 1], games)
    adv, state = update(jnp.asarray(rewards, jnp.float32), jnp.asarray(role), state)
    if step >= warmup:
      for p in (0, 1):
        advs[p].append(_np(adv)[role == p])
        raws[p].append(rewards[role == p])
  for p, sign in ((0, 1.0), (1, -1.0)):
    assert sign * np.concatenate(raws[p]).mean() > 0.3  # the edge is in the raw rewards
    assert abs(np.concatenate(advs[p]).mean()) < 0.05  # and not in the advantages
  np.testing.assert_allclose(_np(state.baseline), [0.4, -0.4], atol=0.25)
  np.testing.assert_array_equal(_np(state.count), [games * steps, games * steps])


# --- PAR ---------------------------------------------------------------------------------


def test_par_hand_values():
  rewards = jnp.array([0.0, 1.0, -2.0])
  refs = jnp.array([[0.0, 0.0], [0.0, 1.0], [0.0, 5.0]])
  ref_mask = jnp.array([[True, True], [True, True], [True, False]])
  out = jax.jit(credit.par_sigmoid_shaping)(rewards, refs, ref_mask)
  # 0.5; (sigmoid(1) + sigmoid(0)) / 2; sigmoid(-2) (second reference masked)
  np.testing.assert_allclose(_np(out), [0.5, 0.6155294, 0.1192029], rtol=1e-6)
  one_ref = credit.par_sigmoid_shaping(rewards, jnp.array([0.0, 0.0, 0.0]))
  np.testing.assert_allclose(_np(one_ref), [0.5, 0.7310586, 0.1192029], rtol=1e-6)
  none_valid = credit.par_sigmoid_shaping(rewards, refs, jnp.zeros((3, 2), bool))
  np.testing.assert_allclose(_np(none_valid), [0.5, 0.5, 0.5])


def test_par_bounded_half_at_reference_and_monotone():
  rng = np.random.default_rng(9)
  rewards = jnp.asarray(rng.uniform(-5, 5, size=64), jnp.float32)
  refs = jnp.asarray(rng.uniform(-5, 5, size=(64, 4)), jnp.float32)
  out = _np(credit.par_sigmoid_shaping(rewards, refs))
  assert np.all((out > 0.0) & (out < 1.0))
  at_ref = credit.par_sigmoid_shaping(refs[:, 0], jnp.repeat(refs[:, :1], 3, axis=1))
  np.testing.assert_allclose(_np(at_ref), 0.5)
  higher = _np(credit.par_sigmoid_shaping(rewards + 1.0, refs))
  assert np.all(higher > out)
  batched = jax.vmap(credit.par_sigmoid_shaping)(rewards[None], refs[None])
  np.testing.assert_allclose(_np(batched[0]), out, rtol=1e-6)
  with pytest.raises(ValueError, match="reference_rewards"):
    credit.par_sigmoid_shaping(rewards, refs[:10])
  with pytest.raises(ValueError, match="reference_mask"):
    credit.par_sigmoid_shaping(rewards, refs, jnp.ones((64, 3), bool))
