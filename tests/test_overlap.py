"""The overlapped rollout (jaxrl_agents/train/overlap.py) and the off-policy corrections
(jaxrl_agents/objectives/losses/off_policy.py): hand-computed weights, the objective's identities,
the data position a checkpoint saves, and a tiny GRPO run that resumes exactly."""

import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo, ppo
from experiments.configs import grpo_arithmetic, ppo_arithmetic
from jaxrl_agents.objectives import policy_objective as objective_lib
from jaxrl_agents.objectives.losses import off_policy
from jaxrl_agents.train import checkpointing, overlap
from jaxrl_agents.train import metrics as metrics_lib

LOGP = np.log(np.array([[0.5, 0.3, 0.9, 0.3]], np.float32))
BEHAVIOR = np.log(np.array([[0.1, 0.4, 0.9, 0.3]], np.float32))  # rho = 5, 0.75, 1, 1
MASK = np.array([[True, True, True, False]])


def test_weights_by_hand():
  rho = np.array([5.0, 0.75, 1.0])
  w, m, metrics = off_policy.behavior_weights(LOGP, BEHAVIOR, MASK, correction="tis", cap=2.0)
  np.testing.assert_allclose(w, [[2.0, 0.75, 1.0, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(m, MASK)
  assert float(metrics["is_corrected_frac"]) == pytest.approx(1 / 3)
  assert float(metrics["is_weight_mean"]) == pytest.approx(rho.mean(), rel=1e-6)
  # k3 estimate of KL(mu || pi) on tokens drawn from mu: mean of rho - 1 - log rho.
  assert float(metrics["behavior_kl"]) == pytest.approx(np.mean(rho - 1 - np.log(rho)), rel=1e-6)

  w, m, metrics = off_policy.behavior_weights(LOGP, BEHAVIOR, MASK, correction="mis", cap=2.0)
  np.testing.assert_array_equal(m, [[False, True, True, False]])  # 5 is outside [0.5, 2]
  np.testing.assert_allclose(w, [[0.0, 0.75, 1.0, 0.0]], rtol=1e-6)
  assert float(metrics["is_corrected_frac"]) == pytest.approx(1 / 3)

  w, m, _ = off_policy.behavior_weights(LOGP, BEHAVIOR, MASK, correction="none")
  np.testing.assert_array_equal(w, MASK.astype(np.float32))
  np.testing.assert_array_equal(m, MASK)
  with pytest.raises(ValueError, match="must be one of"):
    off_policy.behavior_weights(LOGP, BEHAVIOR, MASK, correction="clip")
  with pytest.raises(ValueError, match="> 1"):
    off_policy.behavior_weights(LOGP, BEHAVIOR, MASK, correction="tis", cap=1.0)


def _objective(correction, logp, behavior, adv):
  hp = objective_lib.PolicyObjective(policy_loss="ppo", off_policy_correction=correction,
                                     loss_kwargs=(("eps_high", 0.28), ("eps_low", 0.2)))
  entropy = jnp.zeros_like(logp)

  def loss(lp):
    return objective_lib.policy_objective(hp, lp, entropy, jax.lax.stop_gradient(lp),
                                          adv, jnp.asarray(MASK), behavior_logp=behavior)
  return jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))


def test_objective_corrections():
  adv = jnp.array([1.5])
  (_, base), g_plain = _objective("none", LOGP, None, adv)
  assert "behavior_kl" not in base
  # The sampling policy equal to the updated one: every correction is the identity.
  for correction in off_policy.CORRECTIONS:
    (_, metrics), g = _objective(correction, LOGP, jnp.asarray(LOGP), adv)
    np.testing.assert_allclose(g, g_plain, rtol=1e-6)
    assert float(metrics["behavior_kl"]) == 0.0
  # On-policy PPO's token-mean gradient is -A / n per token; TIS scales token t by
  # min(rho_t, 2); MIS drops the token with rho 5 from the sum and the count.
  _, g = _objective("tis", LOGP, jnp.asarray(BEHAVIOR), adv)
  np.testing.assert_allclose(g, [[-1.5 * 2 / 3, -1.5 * 0.75 / 3, -1.5 / 3, 0.0]], rtol=1e-5)
  _, g = _objective("mis", LOGP, jnp.asarray(BEHAVIOR), adv)
  np.testing.assert_allclose(g, [[0.0, -1.5 * 0.75 / 2, -1.5 / 2, 0.0]], rtol=1e-5)
  _, g = _objective("none", LOGP, jnp.asarray(BEHAVIOR), adv)
  np.testing.assert_allclose(g, g_plain, rtol=1e-6)


class _Counter:
  def __init__(self):
    self.position = 0

  def __next__(self):
    self.position += 1
    return self.position

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def test_lookahead_reports_the_position_the_updates_used():
  data = overlap.Lookahead(_Counter())
  assert next(data) == 1
  assert data.draw_ahead() == 2
  assert data.get_state() == {"position": 1}  # batch 2 is in flight, not used yet
  data.consumed_ahead()
  assert data.get_state() == {"position": 2}
  data.draw_ahead()
  data.set_state({"position": 2})  # a resume: batch 3 is drawn again
  assert next(data) == 3 and data.get_state() == {"position": 3}


def _tiny_overlap_config(steps, correction="tis"):
  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.checkpoint_every, config.overlap = steps, 3, True
  config.off_policy.correction = correction
  return config


def _untimed(workdir):
  timing = {"rollout_time_s", "update_time_s", "step_time_s", "rollout_tokens_per_s",
            "update_tokens_per_s", "compile_time_s", "background_compile_time_s",
            "eval_time_s", "train_time_s", "rollout_wait_s"}
  return [{k: v for k, v in r.items() if k not in timing}
          for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def test_overlapped_run_resumes_exactly(tmp_path, monkeypatch):
  whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
  grpo.train(_tiny_overlap_config(4), whole, progress=False)
  # SIGTERM during step 2, once step 3's rollout is in flight: the run checkpoints step 2
  # (not a scheduled checkpoint) and exits; the resumed run samples that rollout again.
  start = overlap.Pipeline.start

  def start_then_sigterm(self, step, params):
    start(self, step, params)
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(overlap.Pipeline, "start", start_then_sigterm)
  with pytest.raises(SystemExit) as exited:
    grpo.train(_tiny_overlap_config(4), stopped, progress=False)
  assert exited.value.code == 143
  monkeypatch.undo()
  assert checkpointing.Checkpointer(stopped).steps()[-1] == 2
  grpo.train(_tiny_overlap_config(4), stopped, progress=False)
  assert _untimed(stopped) == _untimed(whole)
  train = [r for r in _untimed(whole) if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert train[0]["behavior_kl"] == pytest.approx(0.0, abs=1e-5)  # sampled by the same policy
  assert all(r["behavior_kl"] > 0 and math.isfinite(r["is_corrected_frac"]) for r in train[1:])
  a, _, _ = checkpointing.latest_policy_params(whole)
  b, _, _ = checkpointing.latest_policy_params(stopped)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  with open(os.path.join(whole, "config.json")) as f:
    assert json.load(f)["overlap"] is True


def test_unsupported_settings_are_refused_before_anything_loads():
  config = _tiny_overlap_config(1)
  with pytest.raises(ValueError, match="one device"):
    overlap.check_supported(config, type("Mesh", (), {"size": 2})())
  config.top_p = 0.9
  with pytest.raises(ValueError, match="untruncated sampling"):
    grpo.validate(config)
  config.top_p, config.policy_loss = 1.0, "gspo"
  with pytest.raises(ValueError, match="per sequence"):
    grpo.validate(config)
  ppo_config = ppo_arithmetic.get_config("tiny")
  ppo_config.overlap = True
  with pytest.raises(ValueError, match="GRPO's"):
    ppo.validate(ppo_config)


def test_a_failed_rollout_in_flight_fails_the_next_step(tmp_path, monkeypatch):
  collect = overlap.Pipeline._timed_collect

  def fail_at_step_2(self, params, examples, step):
    if step == 2:
      raise RuntimeError("reward server down")
    return collect(self, params, examples, step)

  monkeypatch.setattr(overlap.Pipeline, "_timed_collect", fail_at_step_2)
  with pytest.raises(RuntimeError, match="reward server down"):
    grpo.train(_tiny_overlap_config(3), str(tmp_path), progress=False)
  records = metrics_lib.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]  # step 3 never ran
