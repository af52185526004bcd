"""Orbax checkpoints of a training run: train state + data iterator state + metadata.

A checkpoint step directory holds three items:
  state  the train-state pytree (params, optimizer state, step, ...), Orbax StandardSave
  data   the data iterator's state, JSON
  meta   JSON: the config, the PRNG seed and anything the trainer wants to find again

`restore_latest` walks the finalized steps from newest to oldest and returns
the first that restores cleanly, warning about any it had to skip, so a
corrupt or partial latest checkpoint falls back to the previous one. Saving is
synchronous: when `save` returns, the step is on disk (a SIGKILL right after
loses nothing).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
  """Saves and restores (state, data_state, meta) under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=False, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def steps(self) -> list[int]:
    """Finalized checkpoint steps, oldest first."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Any, meta: dict) -> None:
    """Writes step `step`; overwrites nothing (a step already saved is skipped)."""
    if step in self.steps():
      return
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, Any, dict]:
    """Restores step `step` into the structure (and shardings) of `target`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    return restored["state"], restored["data"], restored["meta"]

  def latest_meta(self) -> tuple[int, dict] | None:
    """(step, meta) of the newest checkpoint whose metadata reads, without touching its state."""
    for step in reversed(self.steps()):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))
      except Exception:  # noqa: BLE001 - restore_latest reports unreadable steps
        continue
      return step, restored["meta"]
    return None

  def restore_latest(self, target: Any) -> tuple[int, Any, Any, dict] | None:
    """(step, state, data_state, meta) of the newest checkpoint that restores, or None."""
    for step in reversed(self.steps()):
      try:
        state, data_state, meta = self.restore(step, target)
      except Exception as e:  # noqa: BLE001 - any failure means "not usable", try older
        aside = self._set_aside(step)
        log.warning("checkpoint step %d in %s is unreadable (%s: %s); moved it to %s and "
                    "trying an older one", step, self.directory, type(e).__name__, e, aside)
        continue
      return step, state, data_state, meta
    return None

  def _set_aside(self, step: int) -> str:
    """Renames an unreadable step out of the way (kept for inspection, never deleted).

    Without this, the resumed run would skip re-saving that step and the next
    resume would hit the same broken directory again.
    """
    src = os.path.join(self.directory, str(step))
    dst = f"{src}.unreadable"
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = f"{src}.unreadable{n}"
    os.rename(src, dst)
    self._manager.reload()
    return dst

  def close(self) -> None:
    self._manager.close()


def _as_lists(tree: Any) -> Any:
  """Dicts keyed "0".."n-1" (how a target-less restore may return lists) back to lists."""
  if isinstance(tree, dict):
    keys = list(tree)
    if keys and all(k.isdigit() for k in keys) and sorted(map(int, keys)) == list(range(len(keys))):
      return [_as_lists(tree[str(i)]) for i in range(len(keys))]
    return {k: _as_lists(v) for k, v in tree.items()}
  if isinstance(tree, list | tuple):
    return [_as_lists(v) for v in tree]
  return tree


def latest_policy_params(workdir: str) -> tuple[Any, dict, int]:
  """(policy params, run metadata, step) from a training run's newest readable checkpoint.

  Works without the experiment's code: the state is restored as plain arrays
  and the policy is `state["params"]` (or its "policy" entry when the params
  also hold a critic).
  """
  ckpt = Checkpointer(workdir)
  try:
    steps = ckpt.steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    for step in reversed(steps):
      try:
        restored = ckpt._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - fall back to an older checkpoint
        log.warning("checkpoint step %d is unreadable (%s); trying an older one", step, e)
        continue
      state = restored["state"]
      params = state["params"]
      if isinstance(params, dict) and "policy" in params:
        params = params["policy"]
      return _as_lists(params), restored["meta"], step
    raise FileNotFoundError(f"no readable checkpoint in {ckpt.directory}")
  finally:
    ckpt.close()
