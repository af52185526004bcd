"""Training-time log-probs of sampled completions against the sampler's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import types
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import scoring, shapes
from jaxrl_agents.rollout.scoring import policy_logprobs, token_logprobs

# Model calls below run under jax.jit: eagerly, a forward or its gradient compiles each op on
# its own (877 compiles in one test). A new jitted lambda per call, so a test that patches
# the code traces it afresh.


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_matches_the_sampling_distribution(tiny_model, temperature):
  """The update's log pi_T(y) equals what the sampler drew y with (no truncation)."""
  params, cfg = tiny_model.params, tiny_model.cfg
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3], [40]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=10, temperature=temperature,
                                        stop_tokens=(4,), pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(1), sampling)
  traj = types.single_turn(jnp.asarray(tokens), jnp.asarray(mask), out.tokens, out.mask,
                           out.sampling_logprobs).check()
  logp, entropy = jax.jit(lambda p, t: policy_logprobs(
      p, cfg, t, temperature=temperature, with_entropy=True))(params, traj)
  assert logp.shape == traj.tokens.shape
  np.testing.assert_allclose(np.asarray(logp), np.asarray(traj.sampling_logprobs), atol=3e-5)
  assert np.all(np.asarray(logp)[~np.asarray(traj.policy_mask)] == 0)
  assert np.all(np.asarray(entropy)[:, 8:] > 0) and np.all(np.asarray(entropy)[:, :8] == 0)


def test_temperature_scales_logits_before_the_softmax():
  logits = jnp.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
  tokens = jnp.array([[0, 2]])
  mask = jnp.array([[True, True]])
  logp, entropy = token_logprobs(logits, tokens, mask, temperature=0.5, with_entropy=True)
  z = np.array([[4.0, 0.0, -2.0], [1.0, 1.0, 0.0]])
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  np.testing.assert_allclose(logp[0], np.log([p[0, 0], p[1, 2]]), rtol=1e-6)
  np.testing.assert_allclose(entropy[0], -(p * np.log(p)).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("group_size", [2, 3])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "prefill_then_cache"])
def test_shared_prompt_scoring_equals_the_full_forward(tiny_model, group_size, one_pass,
                                                        monkeypatch):
  """One prompt pass per group gives the full forward's log-probs, entropies and gradient,
  both ways: prompts and replies through each layer together (`apply_shared_prefix`), and
  the prompts' prefill, then the replies against its repeated cache (models without it)."""
  params, cfg = tiny_model.params, tiny_model.cfg
  assert scoring._one_pass(cfg)
  if not one_pass:
    monkeypatch.setattr(scoring, "_one_pass", lambda cfg: False)
  tokens, mask = tokenizer_lib.pad_left([[5, 9, 14, 20, 31], [7, 3]], pad_id=0, length=8)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=9, temperature=1.0, stop_tokens=(4, 11),
                                        pad_id=0)
  out = sampler_lib.generate(params, cfg, jnp.asarray(tokens), jnp.asarray(mask),
                             jax.random.key(3), sampling, samples_per_prompt=group_size)
  # Completions of different lengths (ended early, padding after), as stop tokens would.
  lengths = np.arange(out.tokens.shape[0]) % 9 + 1
  m = np.arange(9)[None, :] < lengths[:, None]
  completion = jnp.where(m, out.tokens, 0)
  batch = types.single_turn(jnp.repeat(tokens, group_size, 0), jnp.repeat(mask, group_size, 0),
                            completion, jnp.asarray(m), out.logprobs)
  full_logp, full_ent = jax.jit(lambda p, b: policy_logprobs(
      p, cfg, b, with_entropy=True))(params, batch)
  shared_logp, shared_ent = jax.jit(lambda p, b: policy_logprobs(
      p, cfg, b, with_entropy=True, group_size=group_size))(params, batch)
  np.testing.assert_allclose(shared_logp, full_logp, atol=2e-5)
  policy = np.asarray(batch.policy_mask)
  np.testing.assert_allclose(np.asarray(shared_ent)[policy], np.asarray(full_ent)[policy],
                             atol=2e-5)
  # And the sampler's own record of the same tokens.
  np.testing.assert_allclose(shared_logp, batch.sampling_logprobs, atol=3e-5)

  weights = jax.random.normal(jax.random.key(0), policy.shape)

  def objective(p, g):
    logp, _ = policy_logprobs(p, cfg, batch, group_size=g)
    return jnp.sum(logp * weights)

  full_grad = jax.jit(jax.grad(lambda p: objective(p, 1)))(params)
  shared_grad = jax.jit(jax.grad(lambda p: objective(p, group_size)))(params)
  for a, b in zip(jax.tree.leaves(full_grad), jax.tree.leaves(shared_grad), strict=True):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(shared_grad)) > 1e-3


def _packed_logprobs(params, cfg, traj, group_size, slots):
  """(logp, entropy) f32[B, T] through the packed pass, as the GRPO loss computes them."""
  logits, packing = scoring.packed_policy_logits(params, cfg, traj, group_size=group_size,
                                                 slots=slots)
  logp, entropy = token_logprobs(logits, scoring.packed_tokens(traj, packing), packing.valid,
                                 with_entropy=True)
  return scoring.unpack(logp, packing, traj), scoring.unpack(entropy, packing, traj)


@pytest.mark.parametrize("group_size", [2, 4])
def test_packed_scoring_equals_the_padded_rows(tiny_model, group_size):
  """Packed scoring (only the reply tokens that need running, in one stream) gives the
  padded rows' log-probs, entropies at the policy tokens, and gradient; with replies of
  every length, an empty one, a row whose tokens are all masked out of the loss (as the
  overlong filter does) and a masked token inside a reply."""
  params, cfg = tiny_model.params, tiny_model.cfg
  n, rows = 9, 4 * group_size
  prompts = [[5, 9, 14, 20, 31], [7, 3], [40, 41, 42], [8]]
  tokens, mask = tokenizer_lib.pad_left(prompts, pad_id=0, length=8)
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, n + 1, rows)
  lengths[0], lengths[1] = n, 0
  m = np.arange(n)[None, :] < lengths[:, None]
  completion = jnp.asarray(np.where(m, rng.integers(3, cfg.vocab_size, (rows, n)), 0), jnp.int32)
  traj = types.single_turn(jnp.repeat(jnp.asarray(tokens), group_size, 0),
                           jnp.repeat(jnp.asarray(mask), group_size, 0), completion,
                           jnp.asarray(m), jnp.zeros((rows, n)))
  policy = np.asarray(traj.policy_mask).copy()
  policy[2] = False  # valid tokens, none in the loss
  policy[0, 8 + 3] = False  # one token inside a reply
  policy[3, 8 + lengths[3] - 2:] = False  # the reply's last two tokens out of the loss
  traj = traj.replace(policy_mask=jnp.asarray(policy))
  assert scoring.can_pack(cfg, traj, group_size)
  slots = scoring.packed_slots(traj, rows=rows, group_size=group_size)
  assert policy.sum() <= slots <= rows * n
  want_logp, want_ent = jax.jit(lambda p, t: policy_logprobs(
      p, cfg, t, with_entropy=True, group_size=group_size))(params, traj)
  packed = jax.jit(_packed_logprobs, static_argnums=(1, 3, 4))
  stacked = transformer.stack_layers(params)
  layouts = ((params, cfg, 0), (params, cfg, 16),  # empty slots change nothing
             (stacked, cfg.replace(remat="full"), 0),
             (transformer.fuse_projections(params), cfg, 0))
  for layout, c, extra in layouts:
    logp, ent = packed(layout, c, traj, group_size, slots + extra)
    np.testing.assert_allclose(logp, np.where(policy, want_logp, 0.0), atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent)[policy], np.asarray(want_ent)[policy], atol=2e-5)
    assert np.all(np.asarray(ent)[~policy] == 0)
  # Padded to a wider reply budget (GRPO's `pack_width`): the same slots and values,
  # zeros on the new columns.
  wide = types.with_reply_width(traj, n + 7)
  assert wide.tokens.shape == (rows, 8 + n + 7)
  assert scoring.packed_slots(wide, rows=rows, group_size=group_size) == slots
  logp, ent = packed(params, cfg, wide, group_size, slots)
  np.testing.assert_allclose(logp[:, :8 + n], np.where(policy, want_logp, 0.0), atol=2e-5)
  assert np.all(np.asarray(logp)[:, 8 + n:] == 0) and np.all(np.asarray(ent)[:, 8 + n:] == 0)
  # Too few slots: the packing says its values are incomplete.
  complete = lambda m: jax.jit(lambda p, t: scoring.packed_policy_logits(
      p, cfg, t, group_size=group_size, slots=m)[1].complete)(params, traj)
  assert bool(complete(int(policy.sum()))) and not bool(complete(int(policy.sum()) - 1))
  with pytest.raises(ValueError, match="group_size >= 2, got 1"):
    scoring.packed_policy_logits(params, cfg, traj, group_size=1, slots=slots)
  assert np.isclose(float(np.abs(np.asarray(logp)).sum()), float(np.abs(
      np.asarray(want_logp)[policy]).sum()), rtol=1e-5)

  weights = jax.random.normal(jax.random.key(0), policy.shape)
  padded_grad = jax.jit(jax.grad(lambda p: jnp.sum(policy_logprobs(
      p, cfg, traj, group_size=group_size)[0] * weights)))(params)
  packed_grad = jax.jit(jax.grad(lambda p: jnp.sum(_packed_logprobs(
      p, cfg, traj, group_size, slots)[0] * weights)))(params)
  for a, b in zip(jax.tree.leaves(padded_grad), jax.tree.leaves(packed_grad), strict=True):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(packed_grad)) > 1e-3


def test_packed_slots_bound_any_minibatch_of_whole_groups():
  """The slots cover the minibatch of whole groups with the most tokens, rounded up."""
  lp, n = 2, 6
  lengths = np.array([6, 6, 1, 1, 3, 0, 2, 2])  # groups of 2: 12, 2, 3, 4 tokens
  m = np.arange(n)[None, :] < lengths[:, None]
  traj = types.single_turn(jnp.ones((8, lp), jnp.int32), jnp.ones((8, lp), bool),
                           jnp.ones((8, n), jnp.int32), jnp.asarray(m), jnp.zeros((8, n)))
  exact = lambda k: k
  assert scoring.packed_slots(traj, rows=8, group_size=2, rounding=exact) == 21
  assert scoring.packed_slots(traj, rows=4, group_size=2, rounding=exact) == 16  # 12 + 4
  assert scoring.packed_slots(traj, rows=4, group_size=2, rounding=lambda k: -(-k // 5) * 5) == 20
  assert scoring.packed_slots(traj, rows=2, group_size=2, rounding=lambda k: 16) == 12  # 2 x 6
  assert scoring.packed_slots(traj, rows=8, group_size=2) == 24  # the default: half octaves


def test_half_octaves_round_up_to_powers_of_two_and_one_and_a_half_times_them():
  want = {1: 16, 16: 16, 17: 24, 24: 24, 25: 32, 33: 48, 49: 64, 65: 96, 97: 128, 385: 512,
          513: 768, 769: 1024}
  assert {n: shapes.half_octave(n) for n in want} == want
  assert shapes.half_octave(5, minimum=4) == 6


def test_shared_prompt_scoring_rejects_a_partial_group(tiny_model):
  tokens, mask = tokenizer_lib.pad_left([[5, 9], [7, 3], [1, 2]], pad_id=0, length=4)
  batch = types.single_turn(jnp.asarray(tokens), jnp.asarray(mask), jnp.ones((3, 2), jnp.int32),
                            jnp.ones((3, 2), bool), jnp.zeros((3, 2)))
  with pytest.raises(ValueError, match="not a whole number of groups of 2"):
    policy_logprobs(tiny_model.params, tiny_model.cfg, batch, group_size=2)


def _multi_turn_batch():
  """Two turns per row in fixed-width blocks: reply (right-padded, 4), observation
  (left-padded, 3), reply (4), after a left-padded prompt of 4.

  Returns (Trajectory, for each row the stream without its gaps and which of
  those tokens the policy sampled).
  """
  layout = [  # (prompt, reply 1, observation, reply 2)
      ([5, 9, 14], [20, 31], [8, 2], [17, 18, 19, 21]),
      ([7, 3, 1, 6], [22, 23, 24, 25], [26], [27]),
  ]
  tokens = np.zeros((2, 15), np.int32)
  valid = np.zeros((2, 15), bool)
  policy = np.zeros((2, 15), bool)
  compact = []
  for i, (prompt, r1, obs, r2) in enumerate(layout):
    for start, width, piece, left, is_policy in ((0, 4, prompt, True, False),
                                                 (4, 4, r1, False, True),
                                                 (8, 3, obs, True, False),
                                                 (11, 4, r2, False, True)):
      cols = range(start + width - len(piece), start + width) if left else \
          range(start, start + len(piece))
      for c, tok in zip(cols, piece, strict=True):
        tokens[i, c], valid[i, c], policy[i, c] = tok, True, is_policy
    compact.append((prompt + r1 + obs + r2,
                    [False] * len(prompt) + [True] * len(r1) + [False] * len(obs)
                    + [True] * len(r2)))
  turn_id = np.where(policy, (np.arange(15) >= 11).astype(np.int32)[None, :], -1)
  traj = types.Trajectory(
      tokens=jnp.asarray(tokens), valid=jnp.asarray(valid), policy_mask=jnp.asarray(policy),
      turn_id=jnp.asarray(turn_id), sampling_logprobs=jnp.zeros((2, 15)),
      turn_rewards=jnp.zeros((2, 2)), turn_mask=jnp.ones((2, 2), bool), prompt_width=4)
  return traj.check(), compact


@pytest.mark.parametrize("group_size", [1, 2])
def test_multi_turn_scoring_skips_gaps_and_environment_tokens(tiny_model, group_size):
  """Policy tokens of a gapped multi-turn stream score as in the same stream without gaps;
  environment tokens get nothing."""
  params, cfg = tiny_model.params, tiny_model.cfg
  traj, compact = _multi_turn_batch()
  if group_size == 2:  # both rows share row 0's prompt
    traj = traj.replace(tokens=traj.tokens.at[1, :4].set(traj.tokens[0, :4]),
                        valid=traj.valid.at[1, :4].set(traj.valid[0, :4]))
    compact[1] = ([5, 9, 14] + compact[1][0][4:], [False] * 3 + compact[1][1][4:])
  logp, _ = jax.jit(lambda p, t: policy_logprobs(p, cfg, t, group_size=group_size))(params,
                                                                                      traj)
  policy = np.asarray(traj.policy_mask)
  apply = jax.jit(lambda p, ids, pos: transformer.apply(p, ids, pos, cfg))
  for i, (ids, sampled) in enumerate(compact):
    logits, _ = apply(params, jnp.asarray([ids]), jnp.arange(len(ids))[None])
    ref = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    expected = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids)) if sampled[j]]
    np.testing.assert_allclose(np.asarray(logp[i])[policy[i]], expected, atol=2e-5)
  assert np.all(np.asarray(logp)[~policy] == 0)


def test_trajectory_check_names_the_bad_field():
  traj, _ = _multi_turn_batch()
  with pytest.raises(ValueError, match="policy_mask marks prompt columns"):
    traj.replace(policy_mask=traj.policy_mask.at[0, 0].set(True)).check()
  with pytest.raises(ValueError, match="not valid"):
    traj.replace(valid=traj.valid.at[0, 5].set(False)).check()
  with pytest.raises(ValueError, match="turn_id"):
    traj.replace(turn_id=traj.turn_id[:, :3]).check()


def test_with_reply_width_pads_invalid_columns_and_keeps_the_episodes():
  traj = types.single_turn(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), bool),
                           jnp.full((2, 4), 7, jnp.int32), jnp.asarray([[1, 1, 0, 0]] * 2, bool),
                           jnp.full((2, 4), -0.5), rewards=jnp.asarray([1.0, 0.0]))
  wide = types.with_reply_width(traj, 6).check()
  assert wide.tokens.shape == (2, 9) and wide.prompt_width == 3
  np.testing.assert_array_equal(wide.tokens[:, :7], traj.tokens)
  for name, fill in (("valid", False), ("policy_mask", False), ("turn_id", -1),
                     ("sampling_logprobs", 0.0), ("tokens", 0)):
    np.testing.assert_array_equal(getattr(wide, name)[:, :7], getattr(traj, name))
    assert np.all(np.asarray(getattr(wide, name))[:, 7:] == fill), name
  np.testing.assert_array_equal(wide.rewards, traj.rewards)
  assert types.with_reply_width(traj, 4) is traj and types.with_reply_width(traj, 2) is traj
  blocks = traj.replace(reply_spans=((3, 4),))  # turn blocks keep their columns
  assert types.with_reply_width(blocks, 6) is blocks


def test_rewards_sum_the_turns_that_happened():
  traj, _ = _multi_turn_batch()
  traj = traj.replace(turn_rewards=jnp.asarray([[1.0, 2.0], [0.5, 9.0]]),
                      turn_mask=jnp.asarray([[True, True], [True, False]]))
  np.testing.assert_allclose(traj.rewards, [3.0, 0.5])
  np.testing.assert_allclose(types.with_outcome(traj, jnp.asarray([4.0, 5.0])).turn_rewards,
                             [[1.0, 4.0], [0.5, 5.0]])
  np.testing.assert_array_equal(types.last_policy_token(traj.policy_mask)[:, 14], [True, False])
  np.testing.assert_array_equal(types.last_policy_token(traj.policy_mask)[:, 11], [False, True])


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_hidden_logprobs_in_chunks_equal_the_whole_logits(chunk):
  """scoring.hidden_logprobs: log-probs, entropies and their gradients as token_logprobs of
  the whole logits, for a chunk that divides N, one that does not, and one above N."""
  rng = np.random.default_rng(0)
  b, n, d, v = 3, 13, 8, 40
  hidden = jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32)
  mask = jnp.asarray(np.arange(n)[None] < np.array([[13], [6], [1]]))

  def total(w, hidden, chunked):
    head = lambda h: h @ w
    if chunked:
      logp, entropy = scoring.hidden_logprobs(head, hidden, tokens, mask, chunk=chunk,
                                              temperature=0.7, with_entropy=True)
    else:
      logp, entropy = scoring.token_logprobs(head(hidden), tokens, mask, temperature=0.7,
                                             with_entropy=True)
    return jnp.sum(logp * 1.5) + jnp.sum(jnp.where(mask, entropy, 0.0)), (logp, entropy)

  grad = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)
  (whole, (logp, entropy)), (gw, gh) = grad(w, hidden, False)
  (chunked, (logp_c, entropy_c)), (gw_c, gh_c) = grad(w, hidden, True)
  assert logp_c.shape == (b, n) and entropy_c.shape == (b, n)
  np.testing.assert_allclose(logp_c, logp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(entropy_c, entropy, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(logp_c)[~np.asarray(mask)], 0.0)
  np.testing.assert_allclose(chunked, whole, rtol=1e-5)
  np.testing.assert_allclose(gw_c, gw, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(gh_c, gh, rtol=1e-4, atol=1e-5)
  # A packed stream (one row of M columns, given as [M]): its row's values.
  stream_logp, stream_entropy = scoring.hidden_logprobs(
      lambda h: h @ w, hidden[0], tokens[0], mask[0], chunk=chunk, temperature=0.7,
      with_entropy=True)
  assert stream_logp.shape == (n,)
  np.testing.assert_allclose(stream_logp, logp[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stream_entropy, entropy[0], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="chunk must be > 0"):
    scoring.hidden_logprobs(lambda h: h @ w, hidden, tokens, mask, chunk=0)
