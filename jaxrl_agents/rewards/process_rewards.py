"""Step-level (process) rewards: Monte-Carlo step values, and the transforms that keep a
process reward from paying for repeated steps.

Arrays are per reply and step: `step_mask` bool[B, K] marks a reply's real
steps (its first n_b columns); rewards and values are f32[B, K].

  mc_step_values   a step's value label: the fraction of M continuations sampled
                   from the reply's prefix up to and including that step that reach
                   the right answer ("ReST-MCTS*: LLM Self-Training via Process
                   Reward Guided Tree Search"; the soft label of Math-Shepherd).
  clip_rewards     min(r_k - threshold, 0): every step costs, so a step added
                   (or repeated) never raises the sum.
  delta_rewards    r_k - r_{k+1}, and the last step keeps r_K: the sum over steps
                   k.. is r_k, so the total is the first step's reward however
                   many steps follow.

  aggregate        one reward per reply from its step rewards: "min" (a reply is as
                   good as its worst step), "last", or "clip" (the sum of
                   clip_rewards), for rewards that score whole replies (GRPO's).

Both transforms are from "On Designing Effective RL Reward at Training Time for
LLM Reasoning" (Gao et al.), which found that summing raw process rewards
teaches a policy to pad its reasoning with steps a process reward model likes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(name: str, x: jax.Array, step_mask: jax.Array, ndim: int = 2) -> None:
  if x.ndim != ndim or x.shape[:2] != step_mask.shape or step_mask.ndim != 2:
    want = "[B, K, M]" if ndim == 3 else "[B, K]"
    raise ValueError(f"{name} has shape {x.shape}, step_mask {step_mask.shape}: expected "
                     f"{want} and [B, K]")


def mc_step_values(successes: jax.Array, step_mask: jax.Array) -> jax.Array:
  """f32[B, K]: the fraction of each step's continuations that succeeded (0 off the mask).

  Args:
    successes: bool or {0, 1}[B, K, M], whether continuation m from the prefix
      ending at step k reached the right answer.
    step_mask: bool[B, K].
  """
  _check("successes", successes, step_mask, ndim=3)
  return jnp.where(step_mask, successes.astype(jnp.float32).mean(axis=-1), 0.0)


def clip_rewards(step_rewards: jax.Array, step_mask: jax.Array, threshold: float = 0.0
                 ) -> jax.Array:
  """f32[B, K]: min(r - threshold, 0) on the real steps, 0 elsewhere (the Clip mechanism)."""
  _check("step_rewards", step_rewards, step_mask)
  return jnp.where(step_mask, jnp.minimum(step_rewards - threshold, 0.0), 0.0)


def delta_rewards(step_rewards: jax.Array, step_mask: jax.Array) -> jax.Array:
  """f32[B, K]: r_k - r_{k+1} on the real steps but the last, which keeps r_k (the Delta
  mechanism); 0 off the mask. Steps are the first columns of each row."""
  _check("step_rewards", step_rewards, step_mask)
  r = jnp.where(step_mask, step_rewards, 0.0)
  following = jnp.pad(r[:, 1:], ((0, 0), (0, 1)))
  return jnp.where(step_mask, r - following, 0.0)


AGGREGATIONS = ("min", "last", "clip")


def aggregate(step_rewards: jax.Array, step_mask: jax.Array, how: str = "min",
              threshold: float = 0.5) -> jax.Array:
  """f32[B]: one reward per reply from its real steps (every row needs one): "min", "last"
  (its last real step's), or "clip" (the sum of `clip_rewards` at `threshold`).

  Delta is not offered here: summed over a reply it is the first step's reward
  alone; it serves per-step credit, not a reply-level reward.
  """
  _check("step_rewards", step_rewards, step_mask)
  if how not in AGGREGATIONS:
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
  if how == "min":
    return jnp.where(step_mask, step_rewards, jnp.inf).min(axis=1)
  if how == "last":
    k = step_mask.shape[1]
    last = k - 1 - jnp.argmax(step_mask[:, ::-1], axis=1)
    return jnp.take_along_axis(step_rewards, last[:, None], axis=1)[:, 0]
  return clip_rewards(step_rewards, step_mask, threshold).sum(axis=1)
