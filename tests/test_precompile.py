"""Ahead-of-time compiles in the background (jaxrl_agents/train/precompile.py): the compiled program
answers calls of its shapes with the jitted function's results, other shapes and failed
compiles fall back to the jitted function, donation holds, and a GRPO run whose first update
was compiled during its first rollout logs what a run without it logs."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import grpo
from experiments.configs import grpo_arithmetic
from jaxrl_agents.train import metrics as metrics_lib
from jaxrl_agents.train import precompile


def _affine(params, x, scale):
  return params["w"] @ x * scale + params["b"]


def test_a_started_compile_answers_its_shapes_and_only_those():
  jitted = jax.jit(_affine)
  f = precompile.Precompiled(jax.jit(_affine), "affine")
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(2)}
  f.start(params, jax.ShapeDtypeStruct((3,), jnp.float32),
          jax.ShapeDtypeStruct((), jnp.float32))
  f.wait()
  x = jnp.array([1.0, -2.0, 0.5])
  np.testing.assert_array_equal(f(params, x, jnp.float32(2.0)),
                                jitted(params, x, jnp.float32(2.0)))
  assert f.hits == 1
  # Another shape, or a weakly typed scalar where the compile saw a float32 one: the jitted
  # function, same results.
  x4 = jnp.ones(4)
  with pytest.raises(TypeError):  # the jitted function's own error for a bad shape
    f(params, x4, jnp.float32(2.0))
  np.testing.assert_array_equal(f(params, x, 2.0), jitted(params, x, 2.0))
  assert f.hits == 1


def test_the_compiled_program_donates_what_the_jitted_function_donates():
  f = precompile.Precompiled(jax.jit(lambda x: x * 2, donate_argnums=0), "double")
  f.start(jax.ShapeDtypeStruct((8,), jnp.float32))
  # Waited for: a call made before the thread takes the compile up withdraws it and
  # compiles on call (as it should), which would test the jitted function's donation.
  f.wait()
  x = jnp.arange(8.0)
  np.testing.assert_array_equal(f(x), np.arange(8.0) * 2)
  assert f.hits == 1 and x.is_deleted()


def test_a_failed_compile_falls_back_and_its_error_is_not_swallowed(caplog):
  def picky(x):
    if x.shape[0] == 3:
      raise ValueError("three rows are refused")
    return x + 1

  f = precompile.Precompiled(jax.jit(picky), "picky")
  f.start(jax.ShapeDtypeStruct((3,), jnp.float32))
  f.wait()  # the compile has failed in the thread (not withdrawn by an early call)
  with pytest.raises(ValueError, match="three rows"):
    f(jnp.ones(3))
  assert "ahead-of-time compile of picky failed" in caplog.text
  np.testing.assert_array_equal(f(jnp.ones(2)), [2.0, 2.0])
  assert f.hits == 0


def test_a_queued_compile_a_call_needs_is_withdrawn_and_compiled_on_call():
  """A guess queued behind another compile does not make a call wait for both: the call
  compiles on its own thread; a later start for shapes already called does nothing."""
  gate = threading.Event()

  def slow(x):  # traced in the compile thread: holds it until the gate opens
    gate.wait(timeout=60)
    return x - 1

  busy = precompile.Precompiled(jax.jit(slow), "slow")
  busy.start(jax.ShapeDtypeStruct((5,), jnp.float32))
  f = precompile.Precompiled(jax.jit(lambda x: x * 3), "triple")
  f.start(jax.ShapeDtypeStruct((4,), jnp.float32))  # queued behind the slow one
  try:
    np.testing.assert_array_equal(f(jnp.ones(4)), [3.0] * 4)
    assert (f.hits, f.withdrawn) == (0, 1)
    f.start(jax.ShapeDtypeStruct((4,), jnp.float32))  # compiled on call already
    assert not f._compiled
  finally:
    gate.set()
  busy.wait()
  np.testing.assert_array_equal(busy(jnp.ones(5)), [0.0] * 5)
  assert busy.hits == 1


_EXIT_DURING_A_COMPILE = """
import time
import jax
import jax.numpy as jnp
from jaxrl_agents.train import precompile

def chain(x):
  for _ in range(200):
    x = jnp.sin(x) @ x
  return x

f = precompile.Precompiled(jax.jit(chain), "chain")
for n in (64, 65, 66):  # the first compiling, two queued
  f.start(jax.ShapeDtypeStruct((n, n), jnp.float32))
time.sleep(0.5)
print("done")
"""


def test_a_process_that_ends_during_a_compile_exits_cleanly():
  """The compile under way is waited for and the queued ones withdrawn: a compile still in
  XLA while the interpreter shuts down aborts the process (exit code 134)."""
  done = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_COMPILE], capture_output=True,
                        text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "done"


def _untimed(workdir):
  timing = {"rollout_time_s", "update_time_s", "step_time_s", "rollout_tokens_per_s",
            "update_tokens_per_s", "compile_time_s", "background_compile_time_s",
            "eval_time_s", "train_time_s"}
  return [{k: v for k, v in r.items() if k not in timing}
          for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def test_a_run_with_its_first_update_precompiled_logs_what_one_without_logs(
    tmp_path, monkeypatch):
  instances = []
  init = precompile.Precompiled.__init__

  def recorded(self, *args, **kwargs):
    init(self, *args, **kwargs)
    instances.append(self)

  monkeypatch.setattr(precompile.Precompiled, "__init__", recorded)
  config = grpo_arithmetic.get_config("tiny")
  # Groups sampled: twice those trained on (the prediction is of the update's batch).
  config.eval_every, config.oversample = 0, 2
  # Padded rows throughout: with packed replies only the first update runs the padded
  # program compiled ahead, and later ones their own (rollout/packing.py Packing.slots).
  config.pack_replies = False
  grpo.train(config, str(tmp_path / "ahead"), progress=False)
  (update,) = instances
  # The tiny random model's replies run to the budget, as `likely_trajectory` predicts:
  # every update ran the program compiled during the first rollout.
  assert update.hits == config.steps
  monkeypatch.setattr(grpo.GRPO, "precompile", lambda *args: None)  # nothing compiled ahead
  grpo.train(config, str(tmp_path / "on_call"), progress=False)
  assert instances[1].hits == 0
  assert _untimed(tmp_path / "ahead") == _untimed(tmp_path / "on_call")
  # The compile time is counted by thread: the first update's compile in the background,
  # within the first step's total; none in the background without the ahead-of-time compile.
  ahead, on_call = ([r for r in metrics_lib.read_jsonl(str(tmp_path / d / "metrics.jsonl"))
                     if r["kind"] == "train"] for d in ("ahead", "on_call"))
  assert 0 < ahead[0]["background_compile_time_s"] < ahead[0]["compile_time_s"]
  assert all(r["background_compile_time_s"] == 0 for r in ahead[1:] + on_call)
