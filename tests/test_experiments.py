"""GRPO and PPO end to end on the tiny preset: artifacts, resume, failures, export, learning."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, grpo, ppo
from experiments.configs import (
  grpo_arithmetic,
  grpo_frozen_lake,
  grpo_tic_tac_toe_self_play,
  ppo_arithmetic,
)
from jaxrl_agents import registry, types
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import groups, packing, sampler, scoring, shapes, single_turn
from jaxrl_agents.train import checkpointing, harness
from jaxrl_agents.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_TINY = os.path.join(REPO, "experiments", "configs", "grpo_arithmetic.py") + ":tiny"

TRAIN_KEYS = {
    "reward_mean", "reward_std", "reward/math_strict_mean", "reward/short_reply_std",
    "accuracy", "approx_kl", "entropy", "clip_frac", "grad_norm", "response_length",
    "rollout_tokens_per_s", "update_tokens_per_s", "step_time_s", "compile_time_s",
    "background_compile_time_s", "skipped_updates", "learning_rate", "reward_timeouts",
    "prompts_truncated"}
# Wall-clock measurements differ between any two runs; everything else must not.
TIMING_KEYS = {"rollout_time_s", "update_time_s", "step_time_s", "rollout_tokens_per_s",
               "update_tokens_per_s", "compile_time_s", "background_compile_time_s",
               "eval_time_s", "train_time_s"}


def _records(workdir, kind=None):
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return [r for r in records if kind is None or r["kind"] == kind]


def _untimed(records):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _check_artifacts(workdir, steps, extra_keys=()):
  assert sorted(checkpointing.Checkpointer(workdir).steps())[-1] == steps
  train = _records(workdir, "train")
  assert [r["step"] for r in train] == list(range(1, steps + 1))
  for r in train:
    missing = (TRAIN_KEYS | set(extra_keys)) - set(r)
    assert not missing, f"step {r['step']} lacks {sorted(missing)}"
    assert np.isfinite(r["reward_mean"]) and r["step_time_s"] > 0
  assert train[0]["compile_time_s"] > 0  # the first step compiles
  evals = _records(workdir, "eval")
  assert evals[0]["step"] == 0 and evals[-1]["step"] == steps
  assert 0.0 <= evals[-1]["accuracy"] <= 1.0
  samples = metrics_lib.read_jsonl(os.path.join(workdir, "samples.jsonl"))
  assert {s["kind"] for s in samples} == {"train", "eval"}
  for s in samples:
    assert {"prompt", "completion", "answer", "reward", "correct", "reward/math_strict"} <= set(s)
  assert any(f.startswith("events.out.tfevents")
             for f in os.listdir(os.path.join(workdir, "tensorboard")))
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["steps"] == steps


def test_tiny_grpo_writes_every_artifact(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  last_eval = grpo.train(config, str(tmp_path), progress=False)
  _check_artifacts(str(tmp_path), config.steps)
  assert last_eval["num_examples"] == config.eval_size


def test_tiny_ppo_writes_every_artifact_and_fits_its_critic(tmp_path):
  config = ppo_arithmetic.get_config("tiny")
  ppo.train(config, str(tmp_path), progress=False)
  _check_artifacts(str(tmp_path), config.steps,
                   extra_keys={"value_loss", "value_mean", "value_clip_frac"})


def test_tiny_grpo_with_kl_epochs_and_minibatches(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.kl_coef, config.epochs, config.minibatches = 2, 0.05, 2, 2
  config.prompts_per_step, config.group_size = 2, 4
  grpo.train(config, str(tmp_path), progress=False)
  train = _records(str(tmp_path), "train")
  assert all("kl" in r and np.isfinite(r["kl"]) for r in train)
  # Four optimizer updates per rollout: the step counter in the state counts them.
  params, meta, step = checkpointing.latest_policy_params(str(tmp_path))
  assert step == 2 and meta["step"] == 2


def test_the_moving_average_of_the_policy_is_evaluated_and_exported(tmp_path):
  """config.ema_decay: each checkpoint's average is the previous one moved toward that
  step's policy by the warmed-up decay (hand recursion from the saved policies), evaluation
  reports it with the policy's own figures under online/, and export reads it."""
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.ema_decay = 3, 0.2
  config.checkpoint_every, config.keep_checkpoints = 1, 3
  workdir = str(tmp_path)
  grpo.train(config, workdir, progress=False)
  average = zoo.load("tiny").params
  for step in (1, 2, 3):
    state = checkpointing.plain_state(workdir, step)
    assert int(state["updates"]) == step
    decay = min(0.2, (1 + step) / (10 + step))  # 0.18, then 0.2
    average = jax.tree.map(lambda a, p, d=decay: d * np.asarray(a) + (1 - d) * np.asarray(p),
                           average, state["params"])
    for want, got in zip(jax.tree.leaves(average), jax.tree.leaves(state["ema_params"]),
                         strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  policy = jax.tree.leaves(state["params"])
  gap = max(float(np.abs(np.asarray(a) - np.asarray(p)).max())
            for a, p in zip(jax.tree.leaves(average), policy, strict=True))
  assert gap > 1e-5  # the average is not the policy
  for record in _records(workdir, "eval"):
    assert 0 <= record["accuracy"] <= 1 and 0 <= record["online/accuracy"] <= 1
  exported = checkpointing.latest_policy_params(workdir)[0]
  for want, got in zip(jax.tree.leaves(state["ema_params"]), jax.tree.leaves(exported),
                       strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_evaluation_reads_the_average_and_reports_the_policy_beside_it():
  def evaluate(params):
    return {"accuracy": params}, [{"params": params}]

  state = grpo.GRPOState(params=0.25, opt_state=None, ref_params=None, updates=None,
                         kl_ctl=None, ema_params=0.75)
  result, samples = grpo.evaluate_policy(evaluate, state)
  assert result == {"accuracy": 0.75, "online/accuracy": 0.25}
  assert samples == [{"params": 0.75}]
  state = state._replace(ema_params=None)  # a run that keeps no average
  assert grpo.evaluate_policy(evaluate, state) == ({"accuracy": 0.25}, [{"params": 0.25}])


@pytest.mark.parametrize("epochs, minibatches", [(1, 1), (2, 2)])
def test_packed_replies_train_as_the_padded_rows(tmp_path, monkeypatch, epochs, minibatches):
  """config.pack_replies scores only the reply tokens, packed: the same run up to float
  rounding (metrics and final policy), with the reference's logits in the loss (forward
  KL), an entropy bonus reading the entropies, and shuffled minibatches of whole groups.
  (The tiny model's replies run to the budget, so its slots are the padded width: short
  replies are tests/test_scoring.py's.)"""
  slot_counts = []
  packed_hidden = scoring.packed_policy_hidden

  def counting(*args, slots, **kwargs):
    slot_counts.append(slots)
    return packed_hidden(*args, slots=slots, **kwargs)
  monkeypatch.setattr(scoring, "packed_policy_hidden", counting)
  runs = {}
  for pack in (False, True):
    config = grpo_arithmetic.get_config("tiny")
    config.steps, config.kl_coef, config.kl_estimator = 3, 0.05, "forward"
    config.entropy_coef, config.pack_replies = 0.01, pack
    config.pack_below = 1.0  # every batch packs, however full its rows are
    config.prompts_per_step, config.epochs, config.minibatches = 4, epochs, minibatches
    workdir = str(tmp_path / str(pack))
    grpo.train(config, workdir, progress=False)
    if not pack:
      assert not slot_counts
    runs[pack] = (_untimed(_records(workdir, "train")),
                  checkpointing.latest_policy_params(workdir)[0])
  # The packed path ran (from the second update): traced once per compiled program.
  rows = config.prompts_per_step * config.group_size // minibatches
  assert slot_counts and max(slot_counts) <= rows * config.max_new_tokens, slot_counts
  (want, want_params), (got, got_params) = runs[False], runs[True]
  assert [r["step"] for r in got] == [1, 2, 3]
  # The record names the program: padded rows (0 slots) throughout, or from the second step.
  assert [r["update_slots"] for r in want] == [0, 0, 0]
  assert got[0]["update_slots"] == 0 and all(r["update_slots"] > 0 for r in got[1:])
  assert all(0 < r["update_width"] <= config.max_new_tokens for r in got)
  for a, b in zip(want, got, strict=True):
    assert set(a) == set(b)
    for key in set(a) - {"update_slots"}:
      if isinstance(a[key], float):
        np.testing.assert_allclose(b[key], a[key], rtol=2e-3, atol=1e-5, err_msg=key)
      else:
        assert a[key] == b[key], key
  for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree.leaves(want_params), jax.tree.leaves(zoo.load("tiny").params), strict=True))
  assert moved > 1e-4  # the runs trained


def test_packed_replies_engage_where_they_apply():
  """The packed slots come with a batch of one-reply rows and shared prompts; none where
  packing is off or the prompts are not shared."""
  config = grpo_arithmetic.get_config("tiny")
  config.pack_replies = True
  model = zoo.load("tiny")
  algorithm = grpo.GRPO(config, model.cfg)
  b, n = config.prompts_per_step * config.group_size, 16
  lengths = np.arange(b) % n + 1
  traj = types.single_turn(jnp.ones((b, 8), jnp.int32), jnp.ones((b, 8), bool),
                           jnp.ones((b, n), jnp.int32),
                           jnp.asarray(np.arange(n)[None] < lengths[:, None]), jnp.zeros((b, n)))
  later, first = jnp.int32(3), jnp.int32(0)  # the state's update count
  slots = algorithm.packing.slots(traj, later)
  assert slots is not None and lengths.sum() <= slots.shape[0] < b * n
  assert slots.shape == (96,)  # 78 tokens, rounded up to a half octave
  # The run's first update scores padded rows: the program compiled ahead of its rollout.
  assert algorithm.packing.slots(traj, first) is None
  # pack_below: packing only where the slots are at most that fraction of the padded
  # rows' 12 x 16 = 192 reply columns (96 / 192 = 0.5).
  config.pack_below = 0.5
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later).shape == (96,)
  config.pack_below = 0.45
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later) is None
  # Per minibatch: 3 minibatches of one group (4 rows x 16 = 64 columns); the fullest
  # group holds 42 tokens -> 48 slots (48 / 64 = 0.75).
  config.minibatches, config.pack_below = 3, 0.75
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later).shape == (48,)
  config.pack_below = 0.7
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later) is None
  config.minibatches, config.pack_below = 1, 1.0
  for bad in (0.0, 1.5, float("nan")):
    config.pack_below = bad
    with pytest.raises(ValueError, match="pack_below"):
      grpo.validate(config)
  config.pack_below = 1.0
  config.pack_replies = False
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later) is None
  config.pack_replies, config.share_prompt = True, False  # packing follows a shared prompt
  assert grpo.GRPO(config, model.cfg).packing.slots(traj, later) is None


def _one_reply_rollout(b: int, n: int, longest: int, rewards=None,
                       tokens=None, lengths=None) -> types.Rollout:
  """b rows of 8 prompt tokens and replies of 1..longest tokens (or `lengths`; of n
  columns); rewards alternating 0/1 unless given (every group's rewards vary)."""
  lengths = np.arange(b) % longest + 1 if lengths is None else np.asarray(lengths)
  rewards = (np.arange(b) % 2).astype(np.float32) if rewards is None else rewards
  tokens = jnp.full((b, n), 3, jnp.int32) if tokens is None else tokens
  traj = types.with_outcome(types.single_turn(
      jnp.ones((b, 8), jnp.int32), jnp.ones((b, 8), bool), tokens,
      jnp.asarray(np.arange(n)[None] < lengths[:, None]), jnp.zeros((b, n))), rewards)
  return types.Rollout(traj=traj, examples=[{}] * b, prompts=[""] * b,
                         completions=[""] * b, rewards=rewards,
                         components={"reward": rewards}, correct=rewards)


def test_packed_programs_compiled_ahead_answer_the_next_batches():
  """config.pack_compile_ahead: after an update, the programs for the next slot counts
  below compile in the background; a later batch of one of them runs that program, and the
  updates are those of compiling on call (the same programs)."""
  runs = {}
  for ahead in (0, 2):
    config = grpo_arithmetic.get_config("tiny")
    config.pack_replies, config.pack_below, config.pack_compile_ahead = True, 1.0, ahead
    b, n = config.prompts_per_step * config.group_size, config.max_new_tokens
    algorithm = grpo.GRPO(config, zoo.load("tiny").cfg)
    state = algorithm.init_state(zoo.load("tiny").params, jax.random.key(0))
    state, slots = state._replace(updates=jnp.int32(3)), []
    for i, longest in enumerate((n, 7, 7)):  # replies shorten: 96 slots, then 48
      batch = algorithm.prepare(state, _one_reply_rollout(b, n, longest), jax.random.key(1))
      state, metrics = algorithm.update(state, batch, jax.random.key(2 + i), 0.1)
      algorithm._update.wait()
      slots.append(metrics["update_slots"])
    runs[ahead] = (slots, state.params, algorithm._update.hits)
  (want_slots, want, none), (got_slots, got, hits) = runs[0], runs[2]
  assert want_slots == got_slots == [96, 48, 48]
  # Compiled ahead after the first update (64 and 48 slots): both 48-slot updates ran it.
  assert (none, hits) == (0, 2)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)
  config.pack_compile_ahead = -1
  with pytest.raises(ValueError, match="pack_compile_ahead"):
    grpo.validate(config)


def test_the_padded_program_a_shorter_batch_needs_is_compiled_ahead():
  """After a packed batch at 16 reply columns whose tokens would fill 8 columns too fully to
  pack, the padded rows' program at 8 columns compiles in the background; the next batch,
  whose replies fit 8 columns, runs it, and the updates are those of compiling on call."""
  runs = {}
  for ahead in (0, 1):
    config = grpo_arithmetic.get_config("tiny")
    config.pack_replies, config.pack_compile_ahead = True, ahead
    b, n = config.prompts_per_step * config.group_size, config.max_new_tokens
    algorithm = grpo.GRPO(config, zoo.load("tiny").cfg)
    state = algorithm.init_state(zoo.load("tiny").params, jax.random.key(0))
    state, programs = state._replace(updates=jnp.int32(3)), []
    # Replies of 5 tokens and one of 9 (16 columns: packed), then of 6 (8 columns, too
    # full to pack); the rollouts trimmed to those widths.
    for i, (lengths, width) in enumerate((([9] + [5] * (b - 1), 16), ([6] * b, 8))):
      batch = algorithm.prepare(state, _one_reply_rollout(b, width, 0, lengths=lengths),
                                jax.random.key(1))
      state, metrics = algorithm.update(state, batch, jax.random.key(2 + i), 0.1)
      algorithm._update.wait()
      programs.append((metrics["update_slots"] > 0, metrics["update_width"]))
    runs[ahead] = (programs, state.params, algorithm._update.hits)
  (want_programs, want, none), (got_programs, got, hits) = runs[0], runs[1]
  assert want_programs == got_programs == [(True, n), (False, 8)]  # packed, then padded
  assert (none, hits) == (0, 1)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_packed_batch_runs_at_the_reply_budgets_width():
  """A packed batch is padded to max_new_tokens reply columns, so one program per slot
  count serves every trimmed width; a padded-rows batch keeps its trimmed width."""
  config = grpo_arithmetic.get_config("tiny")
  config.pack_replies, config.pack_below = True, 1.0
  model = zoo.load("tiny")
  b, n = config.prompts_per_step * config.group_size, 8
  assert n < config.max_new_tokens
  rollout = _one_reply_rollout(b, n, n)
  traj = rollout.traj
  widths = {}
  for pack_below in (1.0, 0.1):  # packs; saves too little to pack
    config.pack_below = pack_below
    algorithm = grpo.GRPO(config, model.cfg)
    state = algorithm.init_state(model.params, jax.random.key(0))._replace(updates=jnp.int32(3))
    batch = algorithm.prepare(state, rollout, jax.random.key(1))
    widths[pack_below] = (batch.traj.tokens.shape[1] - 8, batch.packed_slots is not None)
    assert batch.old_logp.shape == batch.traj.tokens.shape
    np.testing.assert_array_equal(batch.traj.policy_mask[:, :8 + n], traj.policy_mask)
  assert widths == {1.0: (config.max_new_tokens, True), 0.1: (n, False)}
  # Token-level advantages (a turn credit's f32[B, T]) follow the columns, zeros on the new.
  wide, advantages = packing.pad_replies(traj, jnp.ones((b, 8 + n)), config.max_new_tokens)
  assert advantages.shape == wide.tokens.shape == (b, 8 + config.max_new_tokens)
  assert np.all(np.asarray(advantages)[:, 8 + n:] == 0) and np.all(advantages[:, :8 + n] == 1)


def _rollout_with_a_tied_group(g: int, b: int, n: int, tie: float) -> types.Rollout:
  """b rows in groups of g with replies of 1..n tokens; rewards alternate 0/1, but the
  second group's all equal `tie`."""
  rewards = (np.arange(b) % 2).astype(np.float32)
  rewards[g:2 * g] = tie
  return _one_reply_rollout(b, n, n, rewards,
                            jnp.asarray(np.arange(b * n).reshape(b, n) % 50 + 3, jnp.int32))


def test_tied_groups_leave_the_update_and_its_token_mean():
  """drop_tied_groups: a group whose rewards tie keeps its rows but loses its policy
  tokens, so the token-mean gradient is the kept groups' own (the full batch's times
  all tokens / the varied groups' tokens) and a packed update holds fewer slots."""
  config = grpo_arithmetic.get_config("tiny")
  config.pack_replies, config.pack_below = True, 1.0
  model = zoo.load("tiny")
  g, n = config.group_size, 8
  b = config.prompts_per_step * g
  rollout = _rollout_with_a_tied_group(g, b, n, tie=1.0)
  traj = rollout.traj
  batches, grads = {}, {}
  for drop in (False, True):
    config.drop_tied_groups = drop
    algorithm = grpo.GRPO(config, model.cfg)
    state = algorithm.init_state(model.params, jax.random.key(0))._replace(updates=jnp.int32(3))
    batches[drop] = batch = algorithm.prepare(state, rollout, jax.random.key(1))
    loss = functools.partial(grpo.grpo_loss, cfg=model.cfg, s=algorithm.settings,
                             slots=batch.packed_slots.shape[0])
    # Jitted: an eager gradient compiles each op of the forward and backward on its own.
    grads[drop] = jax.jit(jax.grad(lambda p, batch=batch, loss=loss: loss(p, batch)[0]))(
        model.params)
  kept, dropped = (np.asarray(batches[d].traj.policy_mask) for d in (False, True))
  tied = np.zeros(b, bool)
  tied[g:2 * g] = True
  assert kept[tied].any() and not dropped[tied].any()
  np.testing.assert_array_equal(dropped[~tied], kept[~tied])
  np.testing.assert_array_equal(batches[True].advantages, batches[False].advantages)
  assert batches[True].packed_slots.shape[0] < batches[False].packed_slots.shape[0]
  scale = kept.sum() / dropped.sum()
  assert scale > 1.2  # the tied group held a real share of the tokens
  for a, c in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True]), strict=True):
    np.testing.assert_allclose(c, scale * np.asarray(a), rtol=2e-3, atol=1e-7)
  assert max(float(np.abs(a).max()) for a in jax.tree.leaves(grads[True])) > 0
  # Ties come from the rewards: eight rewards of 1.2 tie, whatever an estimator's rounding
  # leaves of their advantages.
  tied_rewards = np.full((config.prompts_per_step, g), 1.2, np.float32)
  tied_rewards[0, 0] = 0.2
  masked = np.asarray(groups.without_tied_groups(traj, tied_rewards, g).policy_mask)
  assert masked[:g].any() and not masked[g:].any()
  with pytest.raises(ValueError, match="one row of"):
    groups.without_tied_groups(traj, tied_rewards[:, :-1], g)
  turn = grpo_frozen_lake.get_config("tiny")
  turn.turn_credit.name = "turn"
  grpo.validate(turn)  # valid as it is
  for bad, message in ((turn, "turn_credit 'episode'"),
                       (grpo_tic_tac_toe_self_play.get_config("tiny"), "has no groups")):
    bad.drop_tied_groups = True
    with pytest.raises(ValueError, match=message):
      grpo.validate(bad)
  bad = ppo_arithmetic.get_config("tiny")
  bad.drop_tied_groups = True
  with pytest.raises(ValueError, match="drop_tied_groups"):
    ppo.validate(bad)



@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm"])
def test_rows_without_advantage_skipped_give_the_same_update(aggregation):
  """skip_zero_advantage_rows: the tied group's rows leave the packed update, and the
  scaled loss has the gradient of the batch that kept them (to float rounding)."""
  config = grpo_arithmetic.get_config("tiny")
  config.pack_replies, config.pack_below = True, 1.0
  config.aggregation = aggregation
  model = zoo.load("tiny")
  g, n = config.group_size, 8
  b = config.prompts_per_step * g
  rollout = _rollout_with_a_tied_group(g, b, n, tie=0.2)  # float32 cannot hold 0.2
  batches, grads, losses = {}, {}, {}
  for skip in (False, True):
    config.skip_zero_advantage_rows = skip
    grpo.validate(config)
    algorithm = grpo.GRPO(config, model.cfg)
    state = algorithm.init_state(model.params, jax.random.key(0))._replace(updates=jnp.int32(3))
    batches[skip] = batch = algorithm.prepare(state, rollout, jax.random.key(1))
    # A perturbed policy, so the ratio (and the clip) is not 1 everywhere.
    batch = batch._replace(old_logp=batch.old_logp + 0.05 * jnp.sin(
        jnp.arange(batch.old_logp.size).reshape(batch.old_logp.shape)))
    loss = functools.partial(grpo.grpo_loss, cfg=model.cfg, s=algorithm.settings,
                             slots=batch.packed_slots.shape[0], loss_scale=batch.loss_scale)
    (losses[skip], _), grads[skip] = jax.jit(jax.value_and_grad(
        lambda p, batch=batch, loss=loss: loss(p, batch), has_aux=True))(model.params)
  full, kept = (np.asarray(batches[k].traj.policy_mask) for k in (False, True))
  assert batches[False].loss_scale is None
  tied = np.zeros(b, bool)
  tied[g:2 * g] = True
  np.testing.assert_array_equal(batches[True].advantages[tied], 0.0)
  assert full[tied].any() and not kept[tied].any()
  np.testing.assert_array_equal(kept[~tied], full[~tied])
  assert batches[True].packed_slots.shape[0] < batches[False].packed_slots.shape[0]
  expected = {"token-mean": kept.sum() / full.sum(),
              "seq-mean-token-mean": (b - g) / b, "seq-mean-token-sum-norm": 1.0}[aggregation]
  assert float(batches[True].loss_scale) == pytest.approx(expected)
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5, atol=1e-8)
  for a, c in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True]), strict=True):
    np.testing.assert_allclose(c, a, rtol=2e-3, atol=1e-7)
  assert max(float(np.abs(a).max()) for a in jax.tree.leaves(grads[True])) > 0


def test_skipping_rows_without_advantage_is_refused_where_they_have_a_gradient():
  config = grpo_arithmetic.get_config("tiny")
  config.skip_zero_advantage_rows = True
  grpo.validate(config)
  for key, value, message in (("kl_coef", 0.1, "kl_coef"), ("entropy_coef", 0.01, "entropy"),
                              ("minibatches", 2, "minibatches"),
                              ("drop_tied_groups", True, "drop_tied_groups")):
    bad = grpo_arithmetic.get_config("tiny")
    bad.skip_zero_advantage_rows = True
    bad[key] = value
    with pytest.raises(ValueError, match=message):
      grpo.validate(bad)
  gated = grpo_arithmetic.get_config()  # the main job's entropy gate
  gated.skip_zero_advantage_rows = True
  with pytest.raises(ValueError, match="token_control 'entropy_gate'"):
    grpo.validate(gated)
  bad = ppo_arithmetic.get_config("tiny")
  bad.skip_zero_advantage_rows = True
  with pytest.raises(ValueError, match="skip_zero_advantage_rows"):
    ppo.validate(bad)


def _cli(workdir, *flags, **popen):
  cmd = [sys.executable, "-m", "experiments.grpo", f"--config={GRPO_TINY}",
         f"--workdir={workdir}", *flags]
  env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device in every process compared
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc, timeout=300):
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _wait_for_checkpoint(workdir, step, proc, timeout=300):
  path = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.monotonic() + timeout
  while not os.path.exists(os.path.join(path, "commit_success.txt")):
    assert proc.poll() is None, f"run exited early: {proc.communicate()[1][-2000:]}"
    assert time.monotonic() < deadline, "no checkpoint in time"
    time.sleep(0.02)


def test_sigkill_then_resume_matches_an_uninterrupted_run_bitwise(tmp_path):
  steps = ["--config.steps=6", "--config.checkpoint_every=1"]
  whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
  code, _, err = _finish(_cli(whole, *steps))
  assert code == 0, err[-3000:]

  proc = _cli(killed, *steps)
  _wait_for_checkpoint(killed, 3, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  interrupted_at = checkpointing.Checkpointer(killed).steps()[-1]
  assert interrupted_at < 6, "the run finished before it was killed"
  code, _, err = _finish(_cli(killed, *steps))
  assert code == 0, err[-3000:]
  assert f"resumed from step {interrupted_at}" in err

  assert _untimed(_records(killed)) == _untimed(_records(whole))
  a, _, _ = checkpointing.latest_policy_params(whole)
  b, _, _ = checkpointing.latest_policy_params(killed)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  samples = lambda d: metrics_lib.read_jsonl(os.path.join(d, "samples.jsonl"))  # noqa: E731
  assert samples(killed) == samples(whole)


def test_sigterm_checkpoints_then_exits(tmp_path):
  workdir = str(tmp_path)
  proc = _cli(workdir, "--config.steps=500", "--config.checkpoint_every=100",
              "--config.eval_every=0")
  deadline = time.monotonic() + 300
  while not _records(workdir, "train"):
    assert proc.poll() is None and time.monotonic() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  code, _, err = _finish(proc)
  assert code == 143, err[-3000:]
  last = _records(workdir, "train")[-1]["step"]
  assert 1 <= last < 100  # stopped early, between scheduled checkpoints
  assert checkpointing.Checkpointer(workdir).steps() == [last]
  assert "checkpointed step" in err


@pytest.mark.parametrize("flag, message", [
    ("--config.stepz=1", "stepz"),
    ("--config.steps=three", "steps"),
    ("--config.advantage=grpoo", "grpoo"),
])
def test_bad_config_fails_before_anything_runs(tmp_path, flag, message):
  workdir = str(tmp_path / "run")
  start = time.monotonic()
  code, _, err = _finish(_cli(workdir, flag))
  assert code != 0 and message in err
  assert not os.path.exists(workdir)  # nothing was written, nothing compiled
  assert "Compiling" not in err
  assert time.monotonic() - start < 60


def test_kept_groups_keep_groups_with_reward_variance_first():
  """Oversampling's selection (`groups.kept_groups`, the rows by `group_rows`), as
  `grpo.group_advantages` applies it."""
  rewards = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.2], [0.5, 0.5]], np.float32)
  kept = groups.kept_groups(rewards, keep=2)
  np.testing.assert_array_equal(kept, [1, 3])
  np.testing.assert_array_equal(groups.group_rows(kept, 2), [2, 3, 6, 7])
  # Too few groups vary: tied ones top up, in sampling order, and order is kept.
  kept = groups.kept_groups(rewards, keep=3)
  np.testing.assert_array_equal(groups.group_rows(kept, 2), [0, 1, 2, 3, 6, 7])
  np.testing.assert_array_equal(groups.kept_groups(rewards, keep=5), np.arange(5))
  with pytest.raises(ValueError, match="cannot keep 6 groups of 5"):
    groups.kept_groups(rewards, keep=6)


def test_split_for_sampling_keeps_every_prompt():
  tok = zoo.load("tiny").tokenizer
  prompts = ["What is 12 plus 30?", "What is 7 times 8?", "What is 99 minus 1?"]
  tokens, mask, _ = single_turn.encode(tok, prompts, chat=True, system=None)
  prefix, suffix, suffix_mask = single_turn.split_for_sampling(tokens, mask, tok.pad_token_id)
  assert prefix is not None and len(prefix) % 8 == 0 and len(prefix) >= 8
  assert suffix.shape[1] % 16 == 0 and suffix.shape[1] < tokens.shape[1]
  for row, m, srow, sm in zip(tokens, mask, suffix, suffix_mask, strict=True):
    assert prefix.tolist() + srow[sm].tolist() == row[m].tolist()
  one = single_turn.split_for_sampling(tokens[:1], mask[:1], tok.pad_token_id)
  assert one[0] is None  # a single prompt shares nothing: sampled whole
  np.testing.assert_array_equal(one[1], tokens[:1])


def test_min_prompt_width_gives_one_shape_and_the_same_replies(tiny_model):
  """`min_prompt_width`: prompts of different lengths pad to one width (the sampler's suffixes
  to that width less the shared prefix), longer prompts still fit, and greedy replies are
  those of the batch's own width."""
  tok = tiny_model.tokenizer
  short = ["What is 1 plus 2?", "Is 5 odd?"]
  long = ["What is 12 plus 30, and then 7 times 8, " * 3, "Then 9 minus 4, and 6 plus 6? " * 4]
  system = "You are a careful calculator."  # a shared prefix the sampler prefills once
  widths = {single_turn.encode(tok, p, chat=True, system=system)[0].shape[1]
            for p in (short, long)}
  assert len(widths) == 2  # without it, two programs
  wide = max(widths)
  for prompts in (short, long):
    tokens, mask, _ = single_turn.encode(tok, prompts, chat=True, system=system, min_width=wide)
    assert tokens.shape[1] == wide
    prefix, suffix, _ = single_turn.split_for_sampling(tokens, mask, tok.pad_token_id, wide)
    assert prefix is not None and len(prefix) >= 8
    assert suffix.shape[1] == shapes.prompt_width(wide - len(prefix))  # whatever the prompts
  tokens, _, _ = single_turn.encode(tok, long, chat=True, system=system, min_width=wide - 16)
  assert tokens.shape[1] == wide  # a minimum, not a limit
  examples = [{"question": q, "answer": "3"} for q in ("What is 1 plus 2?", "What is 9 minus 3?")]
  sampling = sampler.SamplingConfig(
      max_new_tokens=8, temperature=0.0, stop_tokens=(tok.eos_token_id,),
      pad_id=tok.pad_token_id)
  kw = dict(group_size=1, sampling=sampling, template="{question}", chat=True, system=system)
  plain = single_turn.sample(tiny_model.params, tiny_model, examples, jax.random.key(0), **kw)
  padded = single_turn.sample(tiny_model.params, tiny_model, examples, jax.random.key(0),
                              min_prompt_width=wide + 32, **kw)
  assert padded.traj.tokens.shape[1] > plain.traj.tokens.shape[1]
  assert padded.completions == plain.completions


def test_periodic_evaluation_adds_the_harness_sampled_metrics(tmp_path):
  """config.eval_sampling.k: each evaluation record carries the harness's pass@1, pass@k and
  mean@k (with SEs) on the held-out questions, equal to `harness.evaluate` run by hand on
  the same policy with the same settings."""
  from jaxrl_agents.evaluation import harness as eval_harness

  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every = 1, 1
  config.grader = "test_first_char_parity"  # the tiny random model's replies: half pass
  config.eval_sampling.update(k=3, temperature=1.0)
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    grpo.train(config, str(tmp_path), progress=False)
  evals = _records(str(tmp_path), "eval")
  assert [r["step"] for r in evals] == [0, 1]
  for r in evals:
    assert 0 <= r["pass@1"] <= r["pass@3"] <= 1 and r["mean@3"] >= r["pass@1"]
    assert r["pass@3_se"] >= 0 and r["sampled_eval_time_s"] > 0
  model = zoo.load("tiny")
  _, eval_examples = common.task_examples(config)
  fmt = eval_harness.TaskFormat(config.prompt_template, ("test_first_char_parity",),
                                chat=config.chat)
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    by_hand, _ = eval_harness.evaluate(
        model.params, model, eval_examples, fmt,
        eval_harness.EvalSettings(greedy=False, k=3, temperature=1.0,
                                  max_new_tokens=config.max_new_tokens,
                                  batch_size=config.eval_batch_size, seed=config.seed),
        progress=False)
  by_hand = by_hand["graders"]["test_first_char_parity"]
  assert 0 < by_hand["pass@1"]["mean"] < 1  # verdicts that vary: not a trivial check
  for name, key in (("pass@1", "pass@1"), ("pass@3", "pass@k"), ("mean@3", "mean@k")):
    assert evals[0][name] == pytest.approx(by_hand[key]["mean"])
  config.grader, config.eval_sampling.k = "math_strict", -1
  with pytest.raises(ValueError, match="eval_sampling.k must be 0"):
    grpo.validate(config)


def test_eval_task_holds_out_another_tasks_questions(tmp_path):
  """config.eval_task: arithmetic trains, GSM8K's test questions are the held-out ones (the
  samples log shows them), and a task built from GSM8K's test set is refused beside it."""
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every, config.eval_size = 1, 1, 4
  config.eval_task = "gsm8k"
  config.prompt_template = "{question}"
  grpo.train(config, str(tmp_path), progress=False)
  from jaxrl_agents import data as data_lib

  gsm8k = {r["question"] for r in data_lib.load_task("gsm8k", "test")[:4]}
  evals = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  asked = {r["prompt"] for r in evals if r["kind"] == "eval"}
  assert asked and asked <= gsm8k
  assert [r["num_examples"] for r in _records(str(tmp_path), "eval")] == [4, 4]
  config.task = "reasoning_gym/gsm_symbolic"
  with pytest.raises(ValueError, match="templates are GSM8K test questions"):
    grpo.validate(config)


def test_tiny_grpo_with_oversampling(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.oversample = 2, 3
  grpo.train(config, str(tmp_path), progress=False)
  train = _records(str(tmp_path), "train")
  assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)
  _, meta, _ = checkpointing.latest_policy_params(str(tmp_path))
  assert meta["step"] == 2


def test_validation_names_the_problem():
  config = grpo_arithmetic.get_config("tiny")
  config.minibatches = 5
  with pytest.raises(ValueError, match="not divisible by minibatches = 5"):
    grpo.validate(config)
  config = grpo_arithmetic.get_config("tiny")
  config.oversample = 0
  with pytest.raises(ValueError, match="oversample must be >= 1"):
    grpo.validate(config)
  config = ppo_arithmetic.get_config("tiny")
  config.oversample = 2
  with pytest.raises(ValueError, match="PPO trains on every sample"):
    ppo.validate(config)
  config = grpo_arithmetic.get_config("tiny")
  config.rewards = {"math_strictt": 1.0}
  with pytest.raises(KeyError, match="math_strictt"):
    grpo.validate(config)


def _always_nan(logp, old_logp, advantages, mask, aggregation="token-mean", normalizer=None):
  del old_logp, advantages, aggregation, normalizer
  loss = jnp.sum(logp * mask) * jnp.nan
  return loss, {"pg_loss": loss}


def _first_char_parity(completions, examples):
  del examples
  return np.array([ord(c[0]) % 2 if c else 0 for c in completions], np.float32)


def test_nonfinite_updates_are_skipped_then_stop_the_run(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.policy_loss, config.loss_kwargs = "test_always_nan", {}
  config.max_consecutive_nonfinite, config.steps, config.eval_every = 3, 10, 0
  with registry.registered("policy_loss", "test_always_nan", _always_nan), \
      pytest.raises(harness.TrainingStopped,
                    match="3 consecutive updates had a non-finite.*no checkpoint was written"):
    grpo.train(config, str(tmp_path), progress=False)
  train = _records(str(tmp_path), "train")
  assert [r["skipped_updates"] for r in train] == [1, 2, 3]
  # Every update was skipped: no checkpoint is written during a streak.
  assert checkpointing.Checkpointer(str(tmp_path)).steps() == []


def test_corrupt_latest_checkpoint_resumes_from_the_previous(tmp_path, caplog):
  config = grpo_arithmetic.get_config("tiny")
  grpo.train(config, str(tmp_path), progress=False)
  before = _untimed(_records(str(tmp_path)))
  state_dir = os.path.join(tmp_path, "checkpoints", "3", "state")
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), "w") as f:
        f.write("garbage")
  with caplog.at_level("WARNING"):
    grpo.train(config, str(tmp_path), progress=False)
  assert "checkpoint step 3" in caplog.text and "unreadable" in caplog.text
  assert _untimed(_records(str(tmp_path))) == before  # step 3 redone identically
  assert checkpointing.Checkpointer(str(tmp_path)).steps()[-1] == 3


def test_export_workdir_writes_the_trained_policy(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every = 2, 0
  config.optimizer.learning_rate = 1e-2
  config.rewards = {"test_first_char_parity": 1.0}  # rewards that vary, so the params move
  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  with registry.registered("reward", "test_first_char_parity", _first_char_parity):
    grpo.train(config, workdir, progress=False)
  trained, _, _ = checkpointing.latest_policy_params(workdir)
  code = subprocess.run([sys.executable, "-m", "jaxrl_agents.tools.export", "--workdir", workdir,
                         "--out", out], cwd=REPO, capture_output=True, text=True)
  assert code.returncode == 0, code.stderr[-3000:]
  exported = zoo.load(out)
  initial = zoo.load("tiny").params
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y)),
               exported.params, trained)
  moved = jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()),
                                       exported.params, initial))
  assert max(moved) > 0  # the export is the trained policy, not the preset


def test_tiny_model_learns_a_tiny_task(tmp_path):
  """Copy a digit: the random model starts at 0; GRPO must reach >= 0.9 in well under 2 min.

  Every digit is in every batch (10 prompts x 32 rollouts) and an entropy bonus
  keeps exploring: without it, a digit whose group never samples the right
  answer gets no gradient and the run can plateau at 8/10.
  """
  path = tmp_path / "copy.jsonl"
  with open(path, "w") as f:
    for d in range(10):
      f.write(json.dumps({"prompt": str(d), "answer": str(d)}) + "\n")
  config = grpo_arithmetic.get_config("tiny")
  config.task, config.jsonl_path = "", str(path)
  config.prompt_template, config.chat = "{prompt}", False
  config.rewards, config.grader = {"last_integer": 1.0}, "last_integer"
  config.prompts_per_step, config.group_size, config.max_new_tokens = 10, 32, 1
  config.temperature, config.entropy_coef = 1.0, 0.1
  config.steps, config.eval_every, config.eval_size = 100, 50, 10
  config.checkpoint_every, config.sample_every = 1000, 0
  config.optimizer.learning_rate = 3e-3
  start = time.monotonic()
  last_eval = grpo.train(config, str(tmp_path / "run"), progress=False)
  elapsed = time.monotonic() - start
  evals = _records(str(tmp_path / "run"), "eval")
  train = _records(str(tmp_path / "run"), "train")
  assert evals[0]["accuracy"] <= 0.2, evals[0]  # chance: one byte in 259 is the digit
  assert np.mean([r["reward_mean"] for r in train[:5]]) <= 0.2
  assert last_eval["accuracy"] >= 0.9 and last_eval["reward_mean"] >= 0.9, evals
  assert elapsed < 120


def test_resume_with_a_changed_config_is_refused(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every = 1, 0
  grpo.train(config, str(tmp_path), progress=False)
  changed = grpo_arithmetic.get_config("tiny")
  changed.steps, changed.eval_every = 2, 0
  changed.optimizer.learning_rate = 5e-4
  with pytest.raises(ValueError, match=r"different config \(optimizer.learning_rate: 0.001 -> "
                                       r"0.0005\).*new workdir"):
    grpo.train(changed, str(tmp_path), progress=False)
  assert checkpointing.Checkpointer(str(tmp_path)).steps() == [1]  # nothing set aside
  # Longer runs and logging changes are fine (constant learning rate).
  longer = grpo_arithmetic.get_config("tiny")
  longer.steps, longer.eval_every, longer.sample_every = 2, 0, 0
  grpo.train(longer, str(tmp_path), progress=False)
  assert [r["step"] for r in _records(str(tmp_path), "train")] == [1, 2]


def test_grpo_rejects_estimators_it_cannot_feed():
  config = grpo_arithmetic.get_config("tiny")
  config.advantage = "gae"
  with pytest.raises(ValueError, match="'gae' is not a group estimator"):
    grpo.validate(config)
  config = grpo_arithmetic.get_config("tiny")
  config.temperature = 0.0
  with pytest.raises(ValueError, match="temperature must be > 0"):
    grpo.validate(config)


def test_time_budget_stops_and_timed_evaluations(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 50, 1000, 100
  config.time_budget_s = 1e-6  # any step exceeds it: stop after step 1
  grpo.train(config, str(tmp_path), progress=False)
  train, evals = _records(str(tmp_path), "train"), _records(str(tmp_path), "eval")
  assert [r["step"] for r in train] == [1] and [r["step"] for r in evals] == [0, 1]
  spent = train[0]["train_time_s"]
  assert spent == train[0]["step_time_s"] > 0 and evals[1]["train_time_s"] == spent
  _, meta, step = checkpointing.latest_policy_params(str(tmp_path))
  assert step == 1 and meta["train_time_s"] == spent
  # Resuming with a larger budget carries the spent time over: one more step.
  config.time_budget_s = spent + 1e-6
  grpo.train(config, str(tmp_path), progress=False)
  train = _records(str(tmp_path), "train")
  assert [r["step"] for r in train] == [1, 2]
  assert train[1]["train_time_s"] == pytest.approx(spent + train[1]["step_time_s"])


@pytest.mark.parametrize("decay_over", [1.0, 0.5])
def test_learning_rate_decays_over_the_time_budget(tmp_path, decay_over):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 4, 0, 100
  config.time_budget_s = 600.0
  config.optimizer.update(decay="linear", clock="train_time", end_fraction=0.25,
                          decay_over=decay_over)
  grpo.train(config, str(tmp_path), progress=False)
  train = _records(str(tmp_path), "train")
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  peak = config.optimizer.learning_rate
  for r in train:  # the rate of a step is set by the training time spent before it
    progress = (r["train_time_s"] - r["step_time_s"]) / config.time_budget_s
    assert r["learning_rate"] == pytest.approx(peak * (1 - 0.75 * progress / decay_over),
                                               rel=1e-5)
  assert train[0]["learning_rate"] == pytest.approx(peak)
  assert train[-1]["learning_rate"] < train[1]["learning_rate"] < peak
  config.optimizer.decay_over = 0.0
  with pytest.raises(ValueError, match="config.optimizer.decay_over .*got 0.0"):
    grpo.validate(config)
  config.optimizer.decay_over = decay_over
  config.time_budget_s = 0.0
  with pytest.raises(ValueError, match="set config.time_budget_s > 0"):
    grpo.validate(config)


def test_evaluations_every_so_many_seconds(tmp_path):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every = 3, 0
  config.eval_every_s = 1e-6  # every step crosses a mark
  grpo.train(config, str(tmp_path), progress=False)
  evals = _records(str(tmp_path), "eval")
  assert [r["step"] for r in evals] == [0, 1, 2, 3]
  assert [r["train_time_s"] for r in evals] == sorted(r["train_time_s"] for r in evals)


@pytest.mark.parametrize("module, variant", [
    ("grpo_arithmetic", None), ("grpo_arithmetic", "tiny"), ("grpo_arithmetic", "lora"),
    ("ppo_arithmetic", None),
    ("ppo_arithmetic", "tiny"), ("grpo_countdown", None), ("grpo_race", None),
    ("grpo_race", "tiny"), ("grpo_guess_number", None), ("grpo_guess_number", "tiny"),
    ("grpo_calculator", None), ("grpo_calculator", "tiny"), ("grpo_frozen_lake", None),
    ("grpo_frozen_lake", "tiny"), ("grpo_text_to_sql", None), ("grpo_text_to_sql", "tiny"),
    ("grpo_search_qa", None), ("grpo_search_qa", "tiny"), ("ppo_frozen_lake", None),
    ("ppo_frozen_lake", "tiny"), ("grpo_tic_tac_toe", None), ("grpo_tic_tac_toe", "tiny"),
    ("grpo_sokoban", None), ("grpo_sokoban", "tiny"), ("grpo_tic_tac_toe_self_play", None),
    ("grpo_tic_tac_toe_self_play", "tiny"), ("grpo_reasoning_gym", None),
    ("grpo_reasoning_gym", "tiny")])
def test_every_shipped_config_validates(module, variant):
  import importlib

  config = importlib.import_module(f"experiments.configs.{module}").get_config(variant)
  (ppo if module.startswith("ppo") else grpo).validate(config)
  config.time_budget_s = -1.0
  with pytest.raises(ValueError, match="time_budget_s must be >= 0"):
    (ppo if module.startswith("ppo") else grpo).validate(config)


def test_the_stacked_layout_runs_the_tiny_grpo_and_reward_model_experiments_alike(tmp_path):
  """config.layout="stacked" (one lax.scan over layers, rematerialized) logs what the
  per-layer list logs, for GRPO and for a reward model with frozen layers; a stacked
  run exports the same Hugging Face weights layout."""
  from experiments import grpo
  from experiments import reward_model as rm_experiment
  from experiments.configs import grpo_arithmetic, reward_model_arithmetic
  from jaxrl_agents.train import metrics as metrics_lib

  def train_records(workdir):
    return [r for r in metrics_lib.read_jsonl(workdir / "metrics.jsonl") if r["kind"] == "train"]

  for name, module, config in (("grpo", grpo, grpo_arithmetic.get_config("tiny")),
                               ("rm", rm_experiment, reward_model_arithmetic.get_config("tiny"))):
    config.optimizer.eps = 1e-4  # Adam's first step is a smooth function of the gradient
    config.eval_every = 0  # the train records are compared
    module.train(config, str(tmp_path / f"{name}_list"), progress=False)
    config.layout, config.remat = "stacked", "full"
    if name == "rm":
      config.pairs_dir = str(tmp_path / "rm_list" / "pairs")
    module.train(config, str(tmp_path / f"{name}_stacked"), progress=False)
    for a, b in zip(train_records(tmp_path / f"{name}_list"),
                    train_records(tmp_path / f"{name}_stacked"), strict=True):
      assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6), (name, a["step"])
  config = grpo_arithmetic.get_config("tiny")
  config.remat = "full"
  with pytest.raises(ValueError, match="applies to the stacked layout"):
    grpo.train(config, str(tmp_path / "bad"), progress=False)
  from jaxrl_agents.tools import export
  export.main(["--workdir", str(tmp_path / "grpo_stacked"), "--out", str(tmp_path / "hf")])
  assert (tmp_path / "hf" / "model.safetensors").exists()
