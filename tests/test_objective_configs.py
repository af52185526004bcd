"""Every objective of the library selected from a config and run on the tiny preset.

The objective variants run as GRPO's own batch preparation and jitted update on one
rollout of the tiny model (collected once, `_rollout`), not as whole runs; what a whole
run adds (the command line, checkpointing the controller, the harness's stop) keeps one
run each."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common, grpo, ppo
from experiments.configs import grpo_arithmetic, ppo_arithmetic
from jaxrl_agents import registry, types
from jaxrl_agents.models import zoo
from jaxrl_agents.objectives import advantages
from jaxrl_agents.objectives import policy_objective as objective_lib
from jaxrl_agents.rollout import single_turn
from jaxrl_agents.train import checkpointing, harness
from jaxrl_agents.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(steps=2, **overrides):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = steps, 0, steps
  for key, value in overrides.items():
    node = config
    *path, leaf = key.split(".")
    for name in path:
      node = node[name]
    node[leaf] = value
  return config


@pytest.fixture(scope="module")
def tiny_model():
  return zoo.load("tiny")


@pytest.fixture(scope="module")
def rollout(tiny_model):
  """One rollout of the tiny config's collector (3 prompts x 4 replies), with half the
  rows counted correct (an accuracy-conditioned KL reads it)."""
  config = _tiny()
  collect, _, data = common.episodes(config, tiny_model)
  r, _ = collect(tiny_model.params, next(data), jax.random.key(0))
  correct = (np.arange(len(r.correct)) % 2).astype(np.float32)
  return dataclasses.replace(r, correct=correct, rewards=np.asarray(r.rewards) + correct,
                             traj=types.with_outcome(r.traj, np.asarray(r.rewards) + correct))


def _updates(config, model, r, steps=1):
  """`steps` of GRPO's prepare and jitted update on rollout `r`: the metrics of each and the
  KL coefficient each ran with."""
  algorithm = grpo.GRPO(config, model.cfg)
  state = algorithm.init_state(jax.tree.map(jnp.copy, model.params), jax.random.key(0))
  records = []
  for step in range(steps):
    beta = None if state.kl_ctl is None else float(state.kl_ctl.beta)  # before the donation
    batch = algorithm.prepare(state, r, jax.random.key(10 + step))
    state, metrics = algorithm.update(state, batch, jax.random.key(20 + step), step / steps)
    records.append({**{k: float(v) for k, v in jax.device_get(metrics).items()},
                    "beta_before": beta})
  return records


def _train_records(workdir):
  return [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["kind"] == "train"]


def test_each_loss_gets_its_own_hyperparameters():
  s = grpo.settings_from_config(_tiny(policy_loss="gspo"))
  assert s.objective.loss_kwargs == (("eps_high", 4e-4), ("eps_low", 3e-4))
  s = grpo.settings_from_config(_tiny())
  assert dict(s.objective.loss_kwargs) == {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}
  s = grpo.settings_from_config(_tiny(**{"loss_kwargs.ppo.dual_clip": 3.0}))
  assert dict(s.objective.loss_kwargs)["dual_clip"] == 3.0
  assert grpo.settings_from_config(_tiny(policy_loss="reinforce")).objective.loss_kwargs == ()
  with pytest.raises(ValueError, match="does not take"):
    config = _tiny()
    config.loss_kwargs.ppo.eps_typo = 0.1
    grpo.validate(config)


@pytest.mark.parametrize("policy_loss", ["gspo", "reinforce", "cispo"])
def test_other_policy_losses_run_with_the_shipped_config(tiny_model, rollout, policy_loss):
  records = _updates(_tiny(policy_loss=policy_loss), tiny_model, rollout, steps=2)
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
  assert records[0]["grad_norm"] > 0  # the rollout's rewards vary: there is a gradient


def test_dual_clip_from_the_command_line(tmp_path):
  config = os.path.join(REPO, "experiments", "configs", "grpo_arithmetic.py") + ":tiny"
  cmd = [sys.executable, "-m", "experiments.grpo", f"--config={config}",
         f"--workdir={tmp_path}", "--config.steps=1", "--config.eval_every=0",
         "--config.loss_kwargs.ppo.dual_clip=3.0"]
  out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "XLA_FLAGS": ""},
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "dual_clip_frac" in _train_records(str(tmp_path))[0]


@pytest.mark.parametrize("name, frac, metric", [("covariance_clip", 0.25, "dropped_frac"),
                                                ("entropy_gate", 0.5, "kept_frac")])
def test_token_controls_from_the_config(tiny_model, rollout, name, frac, metric):
  config = _tiny(**{"token_control.name": name, "token_control.frac": frac})
  for r in _updates(config, tiny_model, rollout):
    # floor / ceil of frac x the batch's policy tokens: within one token of frac.
    assert abs(r[metric] - frac) < 0.05, r


def test_chunked_log_probs_give_the_update_of_the_whole_logits(tiny_model, rollout):
  """config.logprob_chunk: the same updates, padded (first step) and packed (second), up
  to float rounding; refused with the forward KL, which reads the whole logits."""
  runs = {chunk: _updates(_tiny(pack_below=1.0, kl_coef=0.1, logprob_chunk=chunk), tiny_model,
                          rollout, steps=2) for chunk in (0, 5)}
  assert [r["update_slots"] for r in runs[0]] == [r["update_slots"] for r in runs[5]]
  assert runs[0][0]["update_slots"] == 0 and runs[0][1]["update_slots"] > 0  # padded, packed
  for whole, chunked in zip(runs[0], runs[5], strict=True):
    for key in ("loss", "grad_norm", "entropy", "kl"):
      assert chunked[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
  with pytest.raises(ValueError, match="forward KL"):
    grpo.validate(_tiny(kl_coef=0.1, kl_estimator="forward", logprob_chunk=5))
  with pytest.raises(ValueError, match="logprob_chunk -1 must be an int"):
    grpo.validate(_tiny(logprob_chunk=-1))


def test_ppo_reads_logprob_chunk_and_gives_the_whole_logits_values(tiny_model, rollout,
                                                                   monkeypatch):
  """PPO's forward (policy log-probs, entropy, values) and its loss's gradient with the
  vocabulary logits in chunks of 5 columns equal the whole logits' up to float rounding."""
  from jaxrl_agents.models import heads
  from jaxrl_agents.rollout import scoring
  chunks = []  # the chunk sizes `hidden_logprobs` was traced with
  hidden_logprobs = scoring.hidden_logprobs
  monkeypatch.setattr(scoring, "hidden_logprobs", lambda *a, **k: (
      chunks.append(k["chunk"]), hidden_logprobs(*a, **k))[1])
  settings = ppo.settings_from_config(ppo_arithmetic.get_config("tiny"))
  assert settings.logprob_chunk == 0
  params = {"policy": tiny_model.params, "critic": None,
            "value_head": heads.init_scalar_head(jax.random.key(1), tiny_model.cfg.d_model)}
  traj = rollout.traj

  def run(chunk):
    s = dataclasses.replace(settings, logprob_chunk=chunk)
    fwd = jax.jit(lambda p: ppo.forward(p, traj, cfg=tiny_model.cfg, s=s, with_entropy=True))
    logp_sum = jax.jit(jax.grad(lambda p: jnp.sum(
        ppo.forward(p, traj, cfg=tiny_model.cfg, s=s)[0])))
    return fwd(params), logp_sum(params)
  (whole, g_whole) = run(0)
  assert not chunks
  chunked, g_chunked = run(5)
  assert chunks and set(chunks) == {5}  # the chunked path ran
  for a, b in zip(whole, chunked, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunked), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_forward_kl_starts_at_zero_and_stays_finite(tiny_model, rollout):
  kl = [r["kl"] for r in _updates(_tiny(kl_coef=0.1, kl_estimator="forward"), tiny_model,
                                  rollout, steps=3)]
  assert abs(kl[0]) < 1e-5  # the policy is the reference before the first update
  assert all(np.isfinite(kl)) and kl[-1] > 0


def _controller_config(controller, steps=3):
  return _tiny(steps=steps, kl_coef=0.2, **{"kl_controller.name": controller,
                                            "kl_controller.target": 1e-6,
                                            "kl_controller.horizon": 12.0,
                                            "kl_controller.beta_min": 0.05})


@pytest.mark.parametrize("controller", ["fixed", "adaptive", "accuracy"])
def test_kl_controllers_move_the_coefficient(tiny_model, rollout, controller):
  records = _updates(_controller_config(controller), tiny_model, rollout, steps=3)
  betas = [r["beta_before"] for r in records]
  if controller == "fixed":
    np.testing.assert_allclose(betas, 0.2)
  elif controller == "adaptive":
    # beta <- beta (1 + clip((kl - target) / target, -0.2, 0.2) n / horizon), n = 12 rows.
    assert betas[0] == pytest.approx(0.2)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # on-policy first step: KL 0
    for before, after, r in zip(betas, betas[1:], records, strict=False):
      error = np.clip((r["kl"] - 1e-6) / 1e-6, -0.2, 0.2)
      assert after == pytest.approx(before * (1 + error), rel=1e-5)
    assert betas[1] == pytest.approx(0.16, rel=1e-5)
  else:
    # Starts at beta_min (accuracy 0), then beta_min + (beta_max - beta_min) acc^2, with
    # the batch's accuracy 0.5.
    assert betas[0] == pytest.approx(0.05)
    assert betas[1] == pytest.approx(0.05 + 0.15 * 0.5**2, rel=1e-5)


def test_the_kl_controller_is_checkpointed(tmp_path):
  grpo.train(_controller_config("adaptive", steps=2), str(tmp_path), progress=False)
  betas = [r["kl_coef"] for r in _train_records(str(tmp_path))]
  assert betas[0] == pytest.approx(0.2) and betas[1] == pytest.approx(0.16, rel=1e-5)
  state = checkpointing.Checkpointer(str(tmp_path))._manager.restore(2)["state"]
  assert "kl_ctl" in state and np.isfinite(np.asarray(state["kl_ctl"]["beta"]))


def test_adaptive_controller_needs_a_coefficient_and_a_long_enough_horizon():
  with pytest.raises(ValueError, match="set kl_coef > 0"):
    grpo.validate(_tiny(**{"kl_controller.name": "adaptive"}))
  with pytest.raises(ValueError, match="horizon 5.0 is shorter than the 12 samples"):
    grpo.validate(_tiny(kl_coef=0.1, **{"kl_controller.name": "adaptive",
                                        "kl_controller.horizon": 5.0}))


def test_gdpo_normalizes_each_reward_component_in_its_group(tiny_model, rollout):
  config = _tiny(advantage="gdpo")
  s = grpo.settings_from_config(config)
  assert s.component_weights == (("math_strict", 1.0), ("short_reply", 0.2))
  rng = np.random.default_rng(0)
  b, g = config.prompts_per_step * config.group_size, config.group_size
  components = {"math_strict": rng.integers(0, 2, b).astype(np.float32),
                "short_reply": rng.integers(0, 2, b).astype(np.float32)}
  total = components["math_strict"] + 0.2 * components["short_reply"]
  traj = types.single_turn(jnp.ones((b, 2), jnp.int32), jnp.ones((b, 2), bool),
                           jnp.ones((b, 3), jnp.int32), jnp.ones((b, 3), bool), jnp.zeros((b, 3)))
  r = types.Rollout(traj=traj, examples=[{}] * b, prompts=[""] * b, completions=[""] * b,
                      rewards=total, components=components, correct=np.zeros(b, np.float32))
  _, adv, _ = grpo.group_advantages(s, r)
  stacked = np.stack([components["math_strict"], components["short_reply"]], -1)
  expected = advantages.gdpo_advantages(jnp.asarray(stacked.reshape(-1, g, 2)),
                                        jnp.asarray([1.0, 0.2]))
  np.testing.assert_allclose(adv, np.ravel(expected), rtol=1e-6)
  assert all(np.isfinite(r["loss"]) for r in _updates(config, tiny_model, rollout))


@pytest.mark.parametrize("combinator", ["lexicographic", "gated"])
def test_reward_combinators_from_the_config(combinator):
  config = _tiny(**{"reward_combinator.name": combinator, "reward_combinator.threshold": 1.0})
  config.reward_time_limit_s = 0.0  # scored in this process
  reward_fn, _ = common.make_rewards(config)
  completions = ["7", "The answer is 7, I think, after some thought.", "8", "x" * 50]
  total, parts = reward_fn(completions, [{"answer": "7"}] * len(completions))
  strict, short = parts["math_strict"], parts["short_reply"]
  assert set(strict) == {0.0, 1.0} and set(short) == {0.0, 1.0}  # both vary here
  if combinator == "lexicographic":  # weights 2/3 and 1/3: strict dominates
    expected = (2 * strict + short) / 3
  else:  # short_reply counts only where math_strict passes
    expected = 1.0 * strict + 0.2 * short * (strict >= 1.0)
  np.testing.assert_allclose(total, expected, atol=1e-6)


def test_unknown_combinator_is_named():
  with pytest.raises(ValueError, match="unknown reward_combinator"):
    grpo.validate(_tiny(**{"reward_combinator.name": "product"}))


def test_ppo_critic_learns_at_its_own_rate():
  model = zoo.load("tiny")

  def one_update(critic_rate):
    config = ppo_arithmetic.get_config("tiny")
    config.critic_optimizer.learning_rate = critic_rate
    algorithm = ppo.PPO(config, model.cfg)
    state = algorithm.init_state(jax.tree.map(jnp.copy, model.params), jax.random.key(0))
    b = config.prompts_per_step * config.group_size
    traj = types.with_outcome(types.single_turn(
        jnp.full((b, 4), 5, jnp.int32), jnp.ones((b, 4), bool), jnp.full((b, 3), 7, jnp.int32),
        jnp.ones((b, 3), bool), jnp.zeros((b, 3))), jnp.arange(b, dtype=jnp.float32))
    r = types.Rollout(traj=traj, examples=[{}] * b, prompts=[""] * b, completions=[""] * b,
                        rewards=np.arange(b, dtype=np.float32), components={},
                        correct=np.zeros(b, np.float32))
    batch = algorithm.prepare(state, r, jax.random.key(1))
    state, _ = algorithm.update(state, batch, jax.random.key(2), 0.0)
    return state.params

  slow, fast = one_update(1e-6), one_update(1e-2)
  for a, b in zip(jax.tree.leaves(slow["policy"]), jax.tree.leaves(fast["policy"]), strict=True):
    np.testing.assert_array_equal(a, b)
  head_change = [float(jnp.abs(a - b).max()) for a, b in
                 zip(jax.tree.leaves(slow["value_head"]), jax.tree.leaves(fast["value_head"]),
                     strict=True)]
  assert max(head_change) > 1e-4



def test_par_shaping_by_hand():
  b = 4
  traj = types.single_turn(jnp.ones((b, 2), jnp.int32), jnp.ones((b, 2), bool),
                           jnp.ones((b, 3), jnp.int32), jnp.ones((b, 3), bool), jnp.zeros((b, 3)))
  rewards = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
  r = types.Rollout(traj=traj, examples=[{}] * b, prompts=[""] * b, completions=[""] * b,
                      rewards=rewards, components={"x": rewards}, correct=rewards)
  shaped = single_turn.par_shaped(r, np.array([[0.0, 1.0], [1.0, 1.0]]), group_size=2)
  sig = lambda z: 1 / (1 + np.exp(-z))
  expected = [(sig(1) + sig(0)) / 2, (sig(0) + sig(-1)) / 2, sig(0), sig(0)]
  np.testing.assert_allclose(shaped.rewards, expected, rtol=1e-6)
  np.testing.assert_allclose(shaped.traj.rewards, expected, rtol=1e-6)
  np.testing.assert_array_equal(shaped.components["unshaped"], rewards)


def test_par_from_the_config(tmp_path):
  config = _tiny(**{"reward_shaping.name": "par", "reward_shaping.references": 2})
  config.grader, config.rewards = "short_reply", {"short_reply": 1.0}
  grpo.train(config, str(tmp_path), progress=False)
  for r in _train_records(str(tmp_path)):
    assert "reward/unshaped_mean" in r and 0.0 < r["reward_mean"] < 1.0


def _nan_loss(logp, old_logp, advantages, mask, aggregation="token-mean", normalizer=None):
  del old_logp, advantages, aggregation, normalizer
  loss = jnp.sum(logp * mask) * jnp.nan
  return loss, {"pg_loss": loss}


def test_skipped_steps_leave_the_kl_coefficient_alone(tmp_path):
  """A step whose updates were all non-finite must not move (or NaN) the adaptive beta."""
  config = _tiny(steps=4, kl_coef=0.1, policy_loss="test_nan_loss",
                 **{"kl_controller.name": "adaptive", "kl_controller.horizon": 12.0})
  config.checkpoint_every, config.max_consecutive_nonfinite = 1, 3
  with registry.registered("policy_loss", "test_nan_loss", _nan_loss), \
      pytest.raises(harness.TrainingStopped):
    grpo.train(config, str(tmp_path), progress=False)
  # No checkpoint is written during the streak; the logged coefficient of each step is
  # the controller's beta when it ran.
  train = [r for r in metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
           if r["kind"] == "train"]
  assert len(train) == 3
  assert [r["kl_coef"] for r in train] == pytest.approx([0.1, 0.1, 0.1])


def _tied_rollout(config, rewards):
  """A rollout of the tiny config's shape whose rewards (and accuracy) are `rewards`."""
  b, n = config.prompts_per_step * config.group_size, 6
  lengths = np.arange(b) % n + 1
  traj = types.with_outcome(types.single_turn(
      jnp.ones((b, 4), jnp.int32), jnp.ones((b, 4), bool),
      jnp.asarray(np.arange(b * n).reshape(b, n) % 50 + 3, jnp.int32),
      jnp.asarray(np.arange(n)[None] < lengths[:, None]), jnp.zeros((b, n))), rewards)
  return types.Rollout(traj=traj, examples=[{}] * b, prompts=[""] * b,
                         completions=[""] * b, rewards=rewards,
                         components={"reward": rewards}, correct=rewards)


@pytest.mark.parametrize("controller", ["adaptive", "accuracy"])
def test_a_step_without_policy_tokens_measures_nothing(controller):
  """drop_tied_groups on a step whose groups all tie: no policy token is left, so the
  step's token statistics are NaN (not a KL of 0 that an adaptive controller would act
  on), the loss is a finite 0, and only the accuracy controller moves beta."""
  config = _tiny(kl_coef=0.2, drop_tied_groups=True, minibatches=3,
                 **{"kl_controller.name": controller, "kl_controller.target": 1e-6,
                    "kl_controller.horizon": 12.0, "kl_controller.beta_min": 0.05})
  model = zoo.load("tiny")
  algorithm = grpo.GRPO(config, model.cfg)
  b = config.prompts_per_step * config.group_size
  results = {}
  for name, rewards in (("tied", np.ones(b, np.float32)),
                        ("one group varies", (np.arange(b) < 2).astype(np.float32))):
    # A copy each time: the update donates the state, parameters and all.
    state = algorithm.init_state(jax.tree.map(jnp.copy, model.params), jax.random.key(0))
    batch = algorithm.prepare(state, _tied_rollout(config, rewards), jax.random.key(1))
    before = float(state.kl_ctl.beta)  # read first: the update donates the state
    after, metrics = algorithm.update(state, batch, jax.random.key(2), 0.5)
    results[name] = (before, float(after.kl_ctl.beta), metrics)
  before, after, metrics = results["tied"]
  assert np.isfinite(metrics["loss"]) and metrics["loss"] == 0.0
  assert np.isnan(metrics["kl"]) and np.isnan(metrics["entropy"])
  if controller == "adaptive":
    assert after == before == pytest.approx(0.2)
  else:  # accuracy 1: beta_max
    assert before == pytest.approx(0.05) and after == pytest.approx(0.2)
  # One varied group in one of three minibatches: the two empty minibatches are skipped
  # by the step's mean, so the logged figures are the varied one's, and finite.
  _, after, metrics = results["one group varies"]
  assert np.isfinite(metrics["kl"]) and np.isfinite(metrics["entropy"])
  assert metrics["entropy"] > 0
  if controller == "adaptive":  # on-policy, one update per minibatch: a KL below target
    assert after < 0.2


def test_the_objective_of_an_empty_mask_is_a_finite_zero_with_nan_statistics():
  hp = grpo.settings_from_config(_tiny(kl_coef=0.1)).objective
  logp = -jnp.arange(1.0, 7.0).reshape(2, 3) / 4
  entropy = jnp.full((2, 3), 0.5)
  for mask, measured in ((jnp.zeros((2, 3), bool), False), (jnp.eye(2, 3, dtype=bool), True)):
    loss, metrics = objective_lib.policy_objective(
        hp, logp, entropy, logp + 0.1, jnp.array([1.0, -1.0]), mask, beta=0.1,
        ref_logp=logp - 0.2)
    assert np.isfinite(loss) and (measured or loss == 0.0)
    for key in ("kl", "entropy", "clip_frac"):
      assert np.isfinite(metrics[key]) == measured, key
    for key in ("kl_coef", "pg_loss", "loss"):  # values, not per-token statistics
      assert np.isfinite(metrics[key]), key
    assert metrics["kl_coef"] == pytest.approx(0.1)
  assert metrics["entropy"] == pytest.approx(0.5)


def test_config_mistakes_are_named_before_anything_loads():
  config = ppo_arithmetic.get_config("tiny")
  config.kl_controller.name = "adaptive"
  with pytest.raises(ValueError, match="PPO's KL is a reward penalty"):
    ppo.validate(config)
  with pytest.raises(ValueError, match="beta_min <= kl_coef"):
    grpo.validate(_tiny(kl_coef=0.1, **{"kl_controller.name": "accuracy",
                                        "kl_controller.beta_min": 0.5}))
  config = _tiny()
  config.advantage_kwargs = {"std_normalise": False}
  with pytest.raises(ValueError, match="std_normalise"):
    grpo.validate(config)
  with pytest.raises(ValueError, match="reads the reward components"):
    grpo.validate(_tiny(advantage="gdpo", **{"reward_shaping.name": "par"}))
