"""Reward shaping: potential-based shaping of turn rewards, and PAR's sigmoid win probability
against reference replies."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agents.objectives.credit._common import _check_rows, _check_turns
from jaxrl_agents.objectives.losses._checks import check_rank, check_same_shape


def potential_based_shaping(
  rewards: jax.Array,
  potentials: jax.Array,
  gamma: float,
  turn_mask: jax.Array | None = None,
) -> jax.Array:
  """Potential-based reward shaping: r'_k = r_k + gamma * phi_{k+1} - phi_k.

  "Policy invariance under reward transformations: Theory and application to
  reward shaping" (Ng, Harada and Russell, 1999) shows that adding
  F(s, s') = gamma * phi(s') - phi(s) leaves the optimal policy unchanged
  (Q'(s, a) = Q(s, a) - phi(s)); "Behavior Alignment via Reward Function
  Optimization" learns such shaping terms. phi_k is the potential of the state
  before turn k and phi_K the potential after the last turn; the terminal
  potential is used as given (pass 0 for the textbook episodic form, where
  the shaped return then differs from the true one by -phi_0 only). With
  gamma = 1 the shaped rewards telescope:
  sum_k r'_k = sum_k r_k + phi_K - phi_0.

  Args:
    rewards: f32[B, K].
    potentials: f32[B, K + 1].
    gamma: discount.
    turn_mask: bool[B, K] or None; invalid turns get 0. With a prefix mask of
      length n the last valid turn uses phi_n.

  Returns:
    f32[B, K] shaped rewards.
  """
  tm = _check_turns(rewards, turn_mask, "rewards")
  check_rank("potentials", potentials, 2)
  b, k = rewards.shape
  if potentials.shape != (b, k + 1):
    raise ValueError(
      f"potentials must have shape {(b, k + 1)} (one more than rewards {(b, k)}), "
      f"got {tuple(potentials.shape)}"
    )
  shaped = rewards + gamma * potentials[:, 1:] - potentials[:, :-1]
  return jnp.where(tm, shaped, 0.0)


def par_sigmoid_shaping(
  rewards: jax.Array,
  reference_rewards: jax.Array,
  reference_mask: jax.Array | None = None,
) -> jax.Array:
  """Preference As Reward (PAR): r_RL = (1/M) sum_m sigmoid(r - r_ref_m).

  "Reward Shaping to Mitigate Reward Hacking in RLHF" argues the RL reward
  should be bounded, grow fast at first and then saturate, and be centred on
  a reference; PAR uses the reward model's own preference probability over
  reference responses: with M reference responses y_ref_m to the same prompt
  (sampled from the SFT policy and scored by the same reward model), the
  shaped reward is the mean Bradley-Terry win probability
  (1/M) sum_m sigmoid(r(x, y) - r(x, y_ref_m)) (the form in the authors'
  reference code; the paper reports a single reference already suffices).
  The result lies in (0, 1) and is 0.5 when r equals every reference reward.

  Args:
    rewards: f32[B].
    reference_rewards: f32[B] (one reference) or f32[B, M].
    reference_mask: bool[B, M] or None; rows with no valid reference get 0.5
      (the neutral value) so the output stays bounded.

  Returns:
    f32[B].
  """
  check_rank("rewards", rewards, 1)
  check_rank("reference_rewards", reference_rewards, (1, 2))
  _check_rows("reference_rewards", reference_rewards, rewards.shape[0])
  refs = reference_rewards if reference_rewards.ndim == 2 else reference_rewards[:, None]
  if reference_mask is None:
    m = jnp.ones(refs.shape, rewards.dtype)
  else:
    check_same_shape([("reference_rewards", refs), ("reference_mask", reference_mask)])
    m = reference_mask.astype(rewards.dtype)
  win = jax.nn.sigmoid(rewards[:, None] - refs)
  n = m.sum(axis=1)
  return jnp.where(n > 0, (win * m).sum(axis=1) / jnp.maximum(n, 1.0), 0.5)
