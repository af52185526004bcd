"""KL-coefficient controllers as optax-style (init, update) pairs of pure functions.

```
ctrl = adaptive_kl_controller(init_beta=0.1, target=6.0, horizon=10_000)
state = ctrl.init()
state = ctrl.update(state, observed_kl=kl, n_steps=batch_size)   # jittable
loss = pg_loss + state.beta * kl_term
```
The state is a small pytree that goes into the train state and its checkpoint.
A config chooses one by name (registry kind "kl_controller": kl_coef, then the
controller's options as keyword-only arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents import registry


class KLControllerState(NamedTuple):
  beta: jax.Array  # f32[] current KL coefficient


class KLController(NamedTuple):
  init: Callable[[], KLControllerState]
  update: Callable[..., KLControllerState]
  # Whether `update` reads observed_kl (a step that measured no KL must then leave it).
  reads_kl: bool = False


def fixed_kl_controller(beta: float) -> KLController:
  """A constant coefficient; update ignores its inputs."""

  def init():
    return KLControllerState(beta=jnp.asarray(beta, jnp.float32))

  def update(state, observed_kl=None, n_steps=None, accuracy=None):
    del observed_kl, n_steps, accuracy
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_beta: float, target: float, horizon: float) -> KLController:
  """The proportional controller of "Fine-Tuning Language Models from Human Preferences".

    e = clip((KL - target) / target, -0.2, 0.2)
    beta <- beta * (1 + e * n_steps / horizon)
  so beta grows while the observed KL is above the target and shrinks below it,
  by at most 20% per horizon worth of samples.

  Args:
    init_beta: starting coefficient (> 0).
    target: the KL (in nats per sequence, as measured) to track (> 0).
    horizon: samples over which a full correction is applied (> 0).
  """
  for name, v in (("init_beta", init_beta), ("target", target), ("horizon", horizon)):
    if v <= 0:
      raise ValueError(f"{name} must be > 0, got {v}")

  def init():
    return KLControllerState(beta=jnp.asarray(init_beta, jnp.float32))

  def update(state, observed_kl, n_steps, accuracy=None):
    del accuracy
    error = jnp.clip((observed_kl - target) / target, -0.2, 0.2)
    return KLControllerState(beta=state.beta * (1.0 + error * n_steps / horizon))

  return KLController(init, update, reads_kl=True)


def accuracy_conditioned_beta(
    accuracy: jax.Array, beta_min: float, beta_max: float, shape: float = 2.0
) -> jax.Array:
  """AKL: a KL coefficient that rises smoothly with batch accuracy.

  "fg-expo: Frontier-guided exploration-prioritized policy optimization via
  adaptive kl and gaussian curriculum" loosens the KL constraint when the
  policy mostly fails (it must move away from the reference) and tightens it
  when it mostly succeeds. The paper's abstract gives the behaviour, not the
  curve; we use the power curve
    beta(acc) = beta_min + (beta_max - beta_min) * acc^shape,
  monotone increasing in acc for shape > 0, bounded by [beta_min, beta_max];
  shape = 0 is the constant beta_max (fixed-KL GRPO), shape > 1 keeps the
  constraint loose until accuracy is high.

  Args:
    accuracy: f32[] batch mean accuracy in [0, 1] (clipped into it).
    beta_min, beta_max: the range of the coefficient.
    shape: exponent of the curve (>= 0).

  Returns:
    f32[] coefficient.
  """
  if beta_min > beta_max:
    raise ValueError(f"beta_min ({beta_min}) must be <= beta_max ({beta_max})")
  if shape < 0:
    raise ValueError(f"shape must be >= 0, got {shape}")
  acc = jnp.clip(jnp.asarray(accuracy, jnp.float32), 0.0, 1.0)
  return beta_min + (beta_max - beta_min) * acc**shape


def accuracy_conditioned_kl_controller(
    beta_min: float, beta_max: float, shape: float = 2.0, init_accuracy: float = 0.0
) -> KLController:
  """`accuracy_conditioned_beta` as a controller: update(state, accuracy=acc)."""

  def init():
    return KLControllerState(beta=accuracy_conditioned_beta(init_accuracy, beta_min, beta_max,
                                                            shape))

  def update(state, observed_kl=None, n_steps=None, accuracy=None):
    del state, observed_kl, n_steps
    if accuracy is None:
      raise ValueError("the accuracy-conditioned KL controller needs accuracy=")
    return KLControllerState(beta=accuracy_conditioned_beta(accuracy, beta_min, beta_max, shape))

  return KLController(init, update)


# The configs' names (config.kl_controller.name); each takes kl_coef and its options.


@registry.register("kl_controller", "fixed")
def fixed(kl_coef: float) -> KLController:
  """A constant coefficient, kl_coef."""
  return fixed_kl_controller(kl_coef)


@registry.register("kl_controller", "adaptive")
def adaptive(kl_coef: float, *, target: float, horizon: float) -> KLController:
  """Starts at kl_coef and tracks `target` KL over `horizon` samples (Ziegler et al.)."""
  return adaptive_kl_controller(kl_coef, float(target), float(horizon))


@registry.register("kl_controller", "accuracy")
def accuracy(kl_coef: float, *, beta_min: float, shape: float) -> KLController:
  """beta_min + (kl_coef - beta_min) * accuracy^shape (AKL), kl_coef its maximum."""
  if not 0 <= beta_min <= kl_coef:
    raise ValueError(f"kl_controller 'accuracy' needs 0 <= beta_min <= kl_coef (its maximum); "
                     f"got beta_min {beta_min}, kl_coef {kl_coef}")
  if shape < 0:
    raise ValueError(f"kl_controller.shape must be >= 0, got {shape}")
  return accuracy_conditioned_kl_controller(float(beta_min), kl_coef, float(shape))
