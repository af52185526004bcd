"""The pytrees that cross module boundaries, with the shape of every field.

`Trajectory` is what every rollout produces and what scoring, advantage
estimators and losses read: one token stream per episode (the prompt, then
each turn's policy tokens and environment tokens in order) with masks that
say which columns are real (`valid`, for attention) and which the policy
sampled (`policy_mask`, for the loss). A single-turn rollout is the K = 1 case:
prompt, then one completion.

B: rows (episodes), T: stream columns, K: turns (at most), Lp: the prompt's
columns (`prompt_width`, static).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_agents.parallel import distributed

# The Trajectory's fields with one entry per column, [B, T].
COLUMN_FIELDS = ("tokens", "valid", "policy_mask", "turn_id", "sampling_logprobs")
# What a padding column holds in each: no token anyone sees, samples or is scored on.
_PADDING = dict(tokens=0, valid=False, policy_mask=False, turn_id=-1, sampling_logprobs=0.0)


@struct.dataclass
class Trajectory:
  """A batch of episodes as token streams.

  Columns [0, prompt_width) hold the left-padded prompt: rows of one group
  share it, and it holds no policy tokens (scoring runs it once per group and
  computes vocabulary logits only for the columns after it). After it come
  the turns, in fixed-width blocks whose unused columns are invalid.

  Attributes:
    tokens: int32[B, T] the stream.
    valid: bool[B, T] real tokens (attention sees exactly these).
    policy_mask: bool[B, T] tokens the policy sampled, and only those (the loss
      mask); a subset of `valid`, False on the prompt and environment tokens.
    turn_id: int32[B, T] the turn of each policy token, -1 elsewhere.
    sampling_logprobs: f32[B, T] log-probability each policy token was drawn
      with (the sampler's distribution); 0 elsewhere.
    turn_rewards: f32[B, K] the reward of each turn (single-turn: the outcome).
    turn_mask: bool[B, K] turns that happened.
    prompt_width: Lp, static (`pytree_node=False`: it is a shape, and slicing
      rows keeps it).
    reply_spans: static (start column, width) of each turn's reply block when
      the turns sit in fixed-width blocks (multi-turn); every policy token lies
      in one, so scoring computes vocabulary logits for these columns only.
      Empty: every column after the prompt may hold policy tokens.
  """

  tokens: jax.Array
  valid: jax.Array
  policy_mask: jax.Array
  turn_id: jax.Array
  sampling_logprobs: jax.Array
  turn_rewards: jax.Array
  turn_mask: jax.Array
  prompt_width: int = struct.field(pytree_node=False, default=0)
  reply_spans: tuple[tuple[int, int], ...] = struct.field(pytree_node=False, default=())

  @property
  def rewards(self) -> jax.Array:
    """f32[B] the episode's return: the sum of its turns' rewards."""
    return jnp.sum(jnp.where(self.turn_mask, self.turn_rewards, 0.0), axis=-1)

  @property
  def num_turns(self) -> int:
    return self.turn_rewards.shape[1]

  def check(self) -> Trajectory:
    """Raises ValueError naming the field when shapes or masks disagree; returns self."""
    b, t = self.tokens.shape
    for name in COLUMN_FIELDS[1:]:
      if getattr(self, name).shape != (b, t):
        raise ValueError(f"Trajectory.{name} has shape {getattr(self, name).shape}, "
                         f"tokens {(b, t)}")
    if self.turn_rewards.shape != self.turn_mask.shape or self.turn_rewards.shape[0] != b:
      raise ValueError(f"Trajectory.turn_rewards {self.turn_rewards.shape} and turn_mask "
                       f"{self.turn_mask.shape} must both be [B={b}, K]")
    if not 0 < self.prompt_width < t:
      raise ValueError(f"Trajectory.prompt_width {self.prompt_width} must be in (0, {t})")
    policy = distributed.to_host(self.policy_mask)  # whole, on a mesh of several hosts
    if policy[:, :self.prompt_width].any():
      raise ValueError("Trajectory.policy_mask marks prompt columns")
    if (policy & ~distributed.to_host(self.valid)).any():
      raise ValueError("Trajectory.policy_mask marks tokens that are not valid")
    if self.reply_spans:
      inside = np.zeros(t, bool)
      for start, width in self.reply_spans:
        inside[start:start + width] = True
      if policy[:, ~inside].any():
        raise ValueError("Trajectory.policy_mask marks tokens outside its reply_spans")
    return self


def single_turn(prompt_tokens, prompt_mask, completion_tokens, completion_mask,
                sampling_logprobs, rewards=None) -> Trajectory:
  """The K = 1 Trajectory of left-padded prompts [B, Lp] and right-padded completions [B, N].

  `rewards` f32[B] (default zeros: sampling comes before rewarding; see
  `with_outcome`).
  """
  b = prompt_tokens.shape[0]
  no_policy = jnp.zeros(prompt_tokens.shape, bool)
  completion_mask = jnp.asarray(completion_mask, bool)
  return Trajectory(
      tokens=jnp.concatenate([prompt_tokens, completion_tokens], axis=1).astype(jnp.int32),
      valid=jnp.concatenate([jnp.asarray(prompt_mask, bool), completion_mask], axis=1),
      policy_mask=jnp.concatenate([no_policy, completion_mask], axis=1),
      turn_id=jnp.concatenate([jnp.full(prompt_tokens.shape, -1, jnp.int32),
                               jnp.where(completion_mask, 0, -1).astype(jnp.int32)], axis=1),
      sampling_logprobs=jnp.concatenate(
          [jnp.zeros(prompt_tokens.shape, jnp.float32),
           jnp.where(completion_mask, sampling_logprobs, 0.0).astype(jnp.float32)], axis=1),
      turn_rewards=(jnp.zeros((b, 1), jnp.float32) if rewards is None
                    else jnp.asarray(rewards, jnp.float32).reshape(b, 1)),
      turn_mask=jnp.ones((b, 1), bool),
      prompt_width=prompt_tokens.shape[1])


def with_reply_width(traj: Trajectory, width: int) -> Trajectory:
  """The trajectory with `width` columns after the prompt: right-padded with invalid,
  non-policy columns (the same episodes, another shape). As it is when its replies
  are that wide or wider, or their columns sit in turn blocks (`reply_spans`)."""
  extra = traj.prompt_width + width - traj.tokens.shape[1]
  if extra <= 0 or traj.reply_spans:
    return traj
  return traj.replace(**{name: jnp.pad(getattr(traj, name), ((0, 0), (0, extra)),
                                       constant_values=_PADDING[name]) for name in COLUMN_FIELDS})


def with_reply_columns(traj: Trajectory, width: int) -> Trajectory:
  """The trajectory with exactly `width` columns after the prompt: right-padded
  (`with_reply_width`) or cut. Cutting a policy token is an error; single-block replies
  only."""
  if traj.reply_spans:
    raise ValueError("with_reply_columns takes single-turn trajectories (no reply_spans)")
  keep = traj.prompt_width + width
  if keep >= traj.tokens.shape[1]:
    return with_reply_width(traj, width)
  if distributed.to_host(traj.policy_mask)[:, keep:].any():
    raise ValueError(f"cutting the replies to {width} columns would drop policy tokens")
  return traj.replace(**{name: getattr(traj, name)[:, :keep] for name in COLUMN_FIELDS})


def with_prompt_width(traj: Trajectory, width: int) -> Trajectory:
  """The trajectory with a `width`-column prompt: left-padded with invalid, non-policy
  columns (the same episodes: positions come from `valid`). As it is when its prompt
  is that wide; a narrower width is an error."""
  extra = width - traj.prompt_width
  if extra < 0:
    raise ValueError(f"prompt width {width} is narrower than the trajectory's "
                     f"{traj.prompt_width}")
  if extra == 0:
    return traj
  spans = tuple((start + extra, w) for start, w in traj.reply_spans)
  return traj.replace(prompt_width=width, reply_spans=spans,
                      **{name: jnp.pad(getattr(traj, name), ((0, 0), (extra, 0)),
                                       constant_values=_PADDING[name]) for name in COLUMN_FIELDS})


def concatenate_rows(trajs: Sequence[Trajectory]) -> Trajectory:
  """One trajectory of the rows of `trajs`, in order: prompts left-padded and replies
  right-padded to the widest (`with_prompt_width`, `with_reply_width`). Single-block
  replies only (no `reply_spans`): turn blocks of different widths do not line up."""
  if any(t.reply_spans for t in trajs):
    raise ValueError("concatenate_rows takes single-turn trajectories (no reply_spans)")
  prompt = max(t.prompt_width for t in trajs)
  reply = max(t.tokens.shape[1] - t.prompt_width for t in trajs)
  padded = [with_reply_width(with_prompt_width(t, prompt), reply) for t in trajs]
  return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *padded)


def with_outcome(traj: Trajectory, rewards) -> Trajectory:
  """The trajectory with f32[B] outcome rewards as its last (single-turn: only) turn's reward."""
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.shape != (traj.tokens.shape[0],):
    raise ValueError(f"rewards must be f32[B={traj.tokens.shape[0]}], got {rewards.shape}")
  return traj.replace(turn_rewards=traj.turn_rewards.at[:, -1].set(rewards))


def last_policy_token(policy_mask: jax.Array) -> jax.Array:
  """bool[B, T]: True at each row's last policy token (where an outcome reward lands)."""
  t = policy_mask.shape[1]
  columns = jnp.arange(t)[None, :]
  last = jnp.max(jnp.where(policy_mask, columns, -1), axis=1, keepdims=True)
  return policy_mask & (columns == last)


# ----------------------------------------------------------------------------
# What a train step's collector returns (the experiments' steps, rollout/).


@dataclasses.dataclass
class Rollout:
  """One batch of sampled episodes with their rewards (host and device arrays).

  Attributes:
    traj: the Trajectory (device arrays), B = P * G rows, prompt-major, its
      outcome rewards set.
    examples: the B task examples (each prompt's repeated G times).
    prompts: the B prompt strings.
    completions: the B decoded completions.
    rewards: f32[B] total reward.
    components: per-component f32[B] rewards.
    correct: f32[B] the grader's verdict (accuracy).
    prompts_truncated: prompts shortened to fit the context (config.prompt_overflow).
    details: optional per-episode fields for samples.jsonl (a multi-turn episode's
      turns, token ids and masks).
    turn_keys: optional int32[B, K], the environment state each turn was taken
      from (-1: none), for turn-level credit.
    roles: optional int32[B], self-play: the player each row played (-1: nothing
      to credit), for role-conditioned advantages.
  """

  traj: Trajectory
  examples: list[Mapping[str, Any]]
  prompts: list[str]
  completions: list[str]
  rewards: np.ndarray
  components: dict[str, np.ndarray]
  correct: np.ndarray
  prompts_truncated: int = 0
  details: list[dict] | None = None
  turn_keys: np.ndarray | None = None
  roles: np.ndarray | None = None


class RewardFn(Protocol):
  """Rewards of decoded completions: (total f32[B], {component name: f32[B]})."""

  def __call__(self, completions: Sequence[str], examples: Sequence[Mapping]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


class Collect(Protocol):
  """A train step's episodes: (params, the data's next batch, rng) -> (Rollout, extra scalars).

  Optional attribute: likely_trajectory(examples) -> the Trajectory's most likely shapes
  (`jax.ShapeDtypeStruct`s) before sampling, so an experiment can compile its first update
  while the first rollout samples (experiments/grpo.py).
  """

  def __call__(self, params, examples: Any, rng: jax.Array
               ) -> tuple[Rollout, dict[str, float]]: ...
