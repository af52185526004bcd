"""Dynamic sampling (config.resample_rounds): trajectories joined row-wise, the varied groups
kept first, the resampling loop, its validation and a tiny GRPO run with it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo, ppo
from experiments.configs import grpo_arithmetic, ppo_arithmetic
from jaxrl_agents import types
from jaxrl_agents.models import lm
from jaxrl_agents.rollout import groups
from jaxrl_agents.train import metrics as metrics_lib


def _traj(prompt_lens, reply_lens, prompt_width, reply_width, first_id=0):
  """Rows whose token ids count up from `first_id` (prompt, then reply), left-padded
  prompts and right-padded replies of the given lengths."""
  b = len(prompt_lens)
  prompt = np.zeros((b, prompt_width), np.int32)
  reply = np.zeros((b, reply_width), np.int32)
  pm = np.zeros((b, prompt_width), bool)
  rm = np.zeros((b, reply_width), bool)
  ids = iter(range(first_id + 1, first_id + 10_000))
  for i, (lp, lr) in enumerate(zip(prompt_lens, reply_lens, strict=True)):
    prompt[i, prompt_width - lp:] = [next(ids) for _ in range(lp)]
    pm[i, prompt_width - lp:] = True
    reply[i, :lr] = [next(ids) for _ in range(lr)]
    rm[i, :lr] = True
  logprobs = -np.arange(1, reply_width + 1, dtype=np.float32)[None].repeat(b, 0) / 10
  return types.single_turn(jnp.asarray(prompt), pm, jnp.asarray(reply), rm, logprobs)


def _real(traj, row):
  """(token ids, sampling log-probs of the policy tokens, RoPE positions) of a row's
  real tokens: what padding must not change."""
  valid = np.asarray(traj.valid[row])
  positions = np.asarray(lm.positions_from_mask(traj.valid))[row]
  policy = np.asarray(traj.policy_mask[row])
  return (np.asarray(traj.tokens[row])[valid].tolist(),
          np.asarray(traj.sampling_logprobs[row])[policy].tolist(), positions[valid].tolist())


def test_concatenate_rows_pads_prompts_left_and_replies_right():
  a = _traj([2, 3], [1, 4], prompt_width=3, reply_width=4)
  b = _traj([5], [2], prompt_width=6, reply_width=2, first_id=100)
  joined = types.concatenate_rows([a, b])
  assert joined.prompt_width == 6 and joined.tokens.shape == (3, 10)
  joined.check()
  for row, (src, i) in enumerate([(a, 0), (a, 1), (b, 0)]):
    assert _real(joined, row) == _real(src, i)
  # Padding columns: invalid, no policy token, no turn, nothing sampled.
  assert not np.asarray(joined.valid[:2, :3]).any()
  assert not np.asarray(joined.valid[2, 8:]).any()
  assert (np.asarray(joined.turn_id)[~np.asarray(joined.policy_mask)] == -1).all()
  assert types.with_prompt_width(a, 3) is a
  with pytest.raises(ValueError, match="narrower"):
    types.with_prompt_width(b, 3)


def test_with_reply_columns_cuts_only_empty_columns():
  t = _traj([2, 2], [1, 3], prompt_width=2, reply_width=8)
  cut = types.with_reply_columns(t, 3)
  assert cut.tokens.shape == (2, 5)
  assert _real(cut, 1) == _real(t, 1)
  assert types.with_reply_columns(t, 10).tokens.shape == (2, 12)  # padded instead
  with pytest.raises(ValueError, match="drop policy tokens"):
    types.with_reply_columns(t, 2)


def _rollout(rewards, reply_lens, first_id, prompt_width=2, truncated=0):
  """A single-turn Rollout of groups of 2 with the given f32[B] rewards."""
  rewards = np.asarray(rewards, np.float32)
  b = rewards.size
  traj = types.with_outcome(_traj([2] * b, reply_lens, prompt_width, max(reply_lens) + 2,
                                  first_id), rewards)
  names = [f"q{first_id + i}" for i in range(b)]
  return types.Rollout(
      traj=traj, examples=[{"id": n} for n in names], prompts=names,
      completions=[f"c{first_id + i}" for i in range(b)], rewards=rewards,
      components={"part": rewards * 2}, correct=(rewards > 0).astype(np.float32),
      prompts_truncated=truncated)


def test_varied_first_keeps_varied_groups_then_the_first_rounds_tied_ones():
  # Groups of 2. Round 0: tied, varied, tied. Round 1: varied, tied, varied.
  r0 = _rollout([1, 1, 0, 1, 0, 0], [1, 2, 1, 1, 9, 9], first_id=0, truncated=1)
  r1 = _rollout([0, 1, 0, 0, 1, 0], [1, 1, 30, 30, 2, 5], first_id=100, prompt_width=3,
                truncated=2)
  out = groups.varied_first([r0, r1], group_size=2, max_new_tokens=48)
  # The varied groups in sampling order (r0's 1; r1's 0 and 2), up to the 3 groups of a
  # round: r0's tied groups are not needed.
  assert out.prompts == ["q2", "q3", "q100", "q101", "q104", "q105"]
  np.testing.assert_array_equal(out.rewards, [0, 1, 0, 1, 1, 0])
  np.testing.assert_array_equal(out.components["part"], [0, 2, 0, 2, 2, 0])
  np.testing.assert_array_equal(out.correct, [0, 1, 0, 1, 1, 0])
  assert [e["id"] for e in out.examples] == out.prompts
  assert out.completions == ["c2", "c3", "c100", "c101", "c104", "c105"]
  assert out.prompts_truncated == 3
  np.testing.assert_allclose(np.asarray(out.traj.rewards), out.rewards)
  # Prompts padded to the widest round; replies trimmed to the kept rows' longest (5
  # tokens, bucketed to 8), not r1's 30-token group left out.
  assert out.traj.prompt_width == 3
  assert out.traj.tokens.shape[1] == 3 + 8
  for row, (src, i) in enumerate([(r0, 2), (r0, 3), (r1, 0), (r1, 1), (r1, 4), (r1, 5)]):
    assert _real(out.traj, row) == _real(src.traj, i)
  # Too few varied groups: the first round's tied groups top up, in sampling order.
  few = groups.varied_first([r0, _rollout([1] * 6, [1] * 6, first_id=200)], 2, 48)
  assert few.prompts == ["q0", "q1", "q2", "q3", "q4", "q5"]
  # One varied group in each of two rounds: the first round's first tied group tops up, and
  # sits before the second round's varied group in the batch, as sampled.
  mixed = groups.varied_first([r0, _rollout([0, 0, 0, 1, 1, 1], [1] * 6, first_id=200)], 2, 48)
  assert mixed.prompts == ["q0", "q1", "q2", "q3", "q202", "q203"]


def test_resample_until_varied_samples_until_enough_groups_vary():
  rounds = [_rollout([1, 1, 0, 1], [1, 1, 1, 1], first_id=0),   # 1 varied group
            _rollout([0, 0, 1, 1], [1, 1, 1, 1], first_id=100),  # none
            _rollout([1, 0, 0, 1], [1, 1, 1, 1], first_id=200),  # 2
            _rollout([1, 0, 1, 0], [1, 1, 1, 1], first_id=300)]  # never sampled
  calls, batches = [], iter(range(1, 10))

  def collect(params, examples, rng):
    calls.append((examples, rng))
    return rounds[examples], {"reward_timeouts": examples}

  rng = jax.random.key(3)
  kw = dict(need=2, group_size=2, max_new_tokens=16)
  out, extra = groups.resample_until_varied(collect, None, lambda: next(batches), rng,
                                             rounds[0], {"reward_timeouts": 0}, max_rounds=5,
                                             **kw)
  assert [c[0] for c in calls] == [1, 2]  # stopped once 3 groups varied
  for i, (_, key) in enumerate(calls, start=1):
    np.testing.assert_array_equal(jax.random.key_data(key),
                                  jax.random.key_data(jax.random.fold_in(rng, i)))
  assert extra == {"reward_timeouts": 3, "resample_rounds": 2, "varied_groups_sampled": 3}
  assert out.prompts == ["q2", "q3", "q200", "q201"]
  # At most max_rounds more, then what there is.
  calls.clear()
  batches = iter(range(1, 10))
  out, extra = groups.resample_until_varied(collect, None, lambda: next(batches), rng,
                                             rounds[0], {}, max_rounds=1, **kw)
  assert len(calls) == 1 and extra["resample_rounds"] == 1
  assert out.prompts == ["q0", "q1", "q2", "q3"]  # the tied group tops up, in sampling order
  # Enough already: nothing more sampled, the rollout as it was.
  calls.clear()
  out, extra = groups.resample_until_varied(collect, None, lambda: next(batches), rng,
                                             rounds[2], {}, max_rounds=3, **kw)
  assert out is rounds[2] and not calls and extra["resample_rounds"] == 0


@pytest.mark.parametrize("changes, message", [
    (dict(resample_rounds=-1), "must be an int >= 0"),
    (dict(resample_rounds=1, overlap=True), "not supported with config.overlap"),
    (dict(resample_rounds=1, group_size=1, advantage="reinforce_pp"), "use group_size >= 2"),
])
def test_resample_rounds_validation_names_the_problem(changes, message):
  config = grpo_arithmetic.get_config("tiny")
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    grpo.validate(config)


def test_ppo_refuses_resample_rounds():
  config = ppo_arithmetic.get_config("tiny")
  config.resample_rounds = 1
  with pytest.raises(ValueError, match="resample_rounds"):
    ppo.validate(config)


@pytest.mark.slow
def test_tiny_grpo_with_resample_rounds_resumes_exactly(tmp_path, crashed_copy):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.resample_rounds, config.checkpoint_every = 4, 2, 2
  # Replies under 6 characters are rare for the tiny model: most groups' rewards tie.
  config.rewards.short_reply.max_chars = 6
  full = str(tmp_path / "full")
  grpo.train(config, full, progress=False)
  train = _train_records(full)
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  for r in train:
    assert np.isfinite(r["loss"]) and 0 <= r["resample_rounds"] <= 2
    # Another round only while fewer groups than prompts_per_step varied.
    enough = r["varied_groups_sampled"] >= config.prompts_per_step
    assert r["resample_rounds"] == 2 or enough
  assert any(r["resample_rounds"] for r in train)
  # A crash after step 2's checkpoint, resumed: the data read by the extra rounds and their
  # keys come back with it, so the records are the uninterrupted run's.
  part = crashed_copy(full, tmp_path / "part", 2)
  grpo.train(config, part, progress=False)
  assert _untimed(_train_records(part)) == _untimed(train)


def _train_records(workdir):
  return [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["kind"] == "train"]


def _untimed(records):
  timing = ("time", "per_s")
  return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in records]


def test_group_rows_are_each_groups_rows_in_the_groups_order():
  assert groups.group_rows(np.array([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
  assert groups.group_rows(np.array([], int), 4).tolist() == []
