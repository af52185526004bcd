"""When an update scores its reply tokens packed, and the update programs to compile ahead.

A batch of G replies per shared prompt can be scored as one stream of its reply
tokens in M slots (`scoring.packed_policy_logits`): the same values as its padded
rows, at the cost of M tokens rather than B x the longest reply. M is static in
the compiled update, so it is rounded up (`shapes.half_octave`) and the programs
for the counts a run is likely to meet next can be compiled in the background
while it trains (`Packing.compile_ahead`, through `precompile.Precompiled`).

```
packing = Packing(model_cfg, enabled=True, below=0.5, width=64, ahead=2,
                  minibatches=1, group_size=G)
slots = packing.slots(traj, state.updates)      # bool[M] or None (score padded rows)
if slots is not None:
  traj, advantages = pad_replies(traj, advantages, packing.width)
...
packing.compile_ahead(update, state, batch, rng)  # after the update
```
A batch here is a NamedTuple with `traj` (a `types.Trajectory`) and `packed_slots`;
`columns` names its other fields that hold one value per trajectory column.
See docs/grpo_iteration.md#packed-replies for what packing saves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import types
from jaxrl_agents.rollout import scoring, shapes, single_turn
from jaxrl_agents.train import precompile


def pad_replies(traj: types.Trajectory, advantages: jax.Array, width: int
                ) -> tuple[types.Trajectory, jax.Array]:
  """`traj` with its reply columns padded to `width` (as they are if already that wide),
  and token-level f32[B, T] advantages with them (f32[B] ones as they are)."""
  traj = types.with_reply_width(traj, width)
  if advantages.ndim == 2:  # token-level: one per column, so the new columns get zeros
    advantages = jnp.pad(advantages, ((0, 0), (0, traj.tokens.shape[1] - advantages.shape[1])))
  return traj, advantages


def with_reply_columns(spec, width: int, columns: tuple[str, ...]):
  """The shapes (`jax.ShapeDtypeStruct`s) of a batch like `spec` with `width` reply columns,
  narrower or wider: its trajectory's column fields and the `columns` fields that are
  [B, T]; a packed batch's slots as they are."""
  keep = spec.traj.prompt_width + width

  def resized(x):
    return jax.ShapeDtypeStruct((x.shape[0], keep), x.dtype)

  traj = spec.traj.replace(**{name: resized(getattr(spec.traj, name))
                              for name in types.COLUMN_FIELDS})
  fields = {name: resized(getattr(spec, name)) for name in columns
            if getattr(spec, name) is not None and getattr(spec, name).ndim == 2}
  return spec._replace(traj=traj, **fields)


def check_options(below: float, ahead) -> None:
  """Refuses a `pack_below` outside (0, 1] or a `pack_compile_ahead` that is not an int >= 0."""
  if not 0.0 < below <= 1.0:  # NaN fails too
    raise ValueError(f"pack_below {below} must be in (0, 1]: the fraction of the padded "
                     "rows' reply columns under which a batch packs (1: always)")
  if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
    raise ValueError(f"pack_compile_ahead {ahead!r} must be an int >= 0: how many packed "
                     "slot counts to compile ahead of need (0: none)")


@dataclasses.dataclass(frozen=True)
class Packing:
  """Packing's rule for one run.

  Attributes:
    model_cfg: the policy's model config (packing needs its shared-prompt scoring).
    enabled: the run packs where packing applies (config.pack_replies with share_prompt).
    below: a batch packs only if its slots are at most this fraction of its padded rows'
      reply columns (config.pack_below).
    width: the reply columns a packed batch is padded to (0: its trimmed width).
    ahead: how many packed slot counts below a batch's to compile after its update
      (config.pack_compile_ahead; 0: each program compiles when a batch first needs it).
      Replies shorten as a run learns, and each new program would otherwise stop the run
      for its compile; not free on a 2-core CPU (the steps beside a compile run slower;
      docs/grpo_iteration.md#packed-replies). The same programs either way, so the same
      results.
    minibatches: the update's minibatches (slots bound each minibatch's tokens).
    group_size: rows per shared prompt in scoring.
    columns: the batch fields with one value per trajectory column (`with_reply_columns`).
  """

  model_cfg: Any
  enabled: bool
  below: float
  width: int
  ahead: int
  minibatches: int
  group_size: int
  columns: tuple[str, ...] = ()

  def applies(self, traj: types.Trajectory) -> bool:
    """Packing is on and applies to `traj` (one reply block per row, shared prompts)."""
    return self.enabled and scoring.can_pack(self.model_cfg, traj, self.group_size)

  def slots(self, traj: types.Trajectory, updates: jax.Array) -> jax.Array | None:
    """bool[M] for a batch's `packed_slots` (None: score padded rows): M bounds every
    minibatch's tokens, rounded by `shapes.half_octave`.

    The run's first update (`updates`, the state's count, is 0) scores padded rows:
    the program `precompile` compiled while the first rollout sampled (a packed one
    compiled longer than that rollout and made the first step slower). A function of
    the batch, the state and the config only, never of what this process compiled
    before: a resumed run packs each step as the uninterrupted one did. A batch whose
    slots would save too little (above `below`) scores padded rows too.
    """
    if not self.applies(traj):
      return None
    if int(updates) == 0:  # read only where packing applies: it waits for the state
      return None
    rows = traj.tokens.shape[0] // self.minibatches
    count = scoring.packed_slots(traj, rows=rows, group_size=self.group_size)
    if count > self.below * rows * (traj.tokens.shape[1] - traj.prompt_width):
      return None  # packing would save too little: the padded rows' program
    return jnp.zeros((count,), bool)

  def padded_width_ahead(self, batch, rows: int) -> int:
    """The nearest trimmed reply width below this batch's at which a batch of as many reply
    tokens would score padded rows (packing would save too little: `slots`) and which
    their mean length fits, or 0. As replies shorten, a run meets that program next: its
    longest reply no longer needs this batch's width, the padded one serves."""
    traj = batch.traj
    lengths = np.asarray(traj.policy_mask)[:, traj.prompt_width:].sum(1)
    width = traj.tokens.shape[1] - traj.prompt_width  # a padded batch's: the rollout's
    if batch.packed_slots is not None:
      # Padded to the budget: the kept rows' longest reply gives the rollout's width (a
      # longer one in a group the step left out would have made it wider).
      width = single_turn.trimmed_width(lengths, width)
    count = (batch.packed_slots.shape[0] if batch.packed_slots is not None  # counted once
             else scoring.packed_slots(traj, rows=rows, group_size=self.group_size))
    narrow = 1 << ((width - 1).bit_length() - 1)  # the power of two below: 48 -> 32 -> 16
    if narrow < single_turn.MIN_REPLY_WIDTH or narrow < lengths.mean():
      return 0
    return narrow if count > self.below * rows * narrow else 0

  def compile_ahead(self, update: precompile.Precompiled, state, batch, rng) -> None:
    """Starts compiling `update(state, batch, rng, progress)` for the batches likely next
    as replies shorten, shaped like these arguments but for the reply columns: first the
    padded rows' program at the nearest narrower width a batch of this one's reply tokens
    would score padded (`padded_width_ahead`), then the packed programs for the
    `ahead` slot counts next below this batch's (below the padded rows' threshold
    where it scored padded rows). One device only (a compiled program's placement is
    fixed). The caller passes the state and batch without parts the update never sees."""
    traj = batch.traj
    if (not self.ahead or not self.applies(traj) or jax.process_count() > 1
        or len(traj.tokens.sharding.device_set) > 1):
      return
    rows = traj.tokens.shape[0] // self.minibatches
    width = traj.tokens.shape[1] - traj.prompt_width
    spec = precompile.spec_of(batch)
    progress = jax.ShapeDtypeStruct((), jnp.float32)
    narrow = self.padded_width_ahead(batch, rows)
    if narrow:
      update.start(state, with_reply_columns(spec, narrow, self.columns)._replace(
          packed_slots=None), rng, progress)
    below = (batch.packed_slots.shape[0] if batch.packed_slots is not None
             else int(self.below * rows * width) + 1)
    packed = with_reply_columns(spec, self.width, self.columns) if self.width else spec
    for count in shapes.half_octaves_below(below, self.ahead, minimum=rows):
      update.start(state, packed._replace(packed_slots=jax.ShapeDtypeStruct((count,), jnp.bool_)),
                   rng, progress)
