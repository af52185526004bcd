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

Orbax catches structural damage (a missing or truncated file) but not changed
bytes: a flipped bit inside a data file restores as a wrong number. So `meta`
also holds a SHA-256 of every state array and of the data state, taken from
the arrays in memory before the save; a restore recomputes them and treats a
mismatch like any other damage (set aside, fall back), and export refuses it.
Hashing runs at about 1.8 GB/s here: a second per save of the 135M model's
params and Adam moments. Digests are of whole arrays, so a checkpoint written
by several processes (`distributed`) verifies when one process restores it and
the reverse; with several processes each array is gathered to every host to be
hashed (one array at a time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_agents.models import lora
from jaxrl_agents.parallel import distributed

log = logging.getLogger(__name__)


class CorruptCheckpoint(ValueError):
  """A checkpoint's contents differ from the digests recorded when it was saved."""


class BaseModelMismatch(ValueError):
  """A checkpoint of LoRA adapters whose base weights differ from the model loaded now."""


# No trained language model's weight comes near this (their largest are in the tens to
# hundreds); a run whose learning rate blew up does, long before float32 overflows.
ABSURD_WEIGHT = 1e6


def absurd_weight(tree: Any, skip: str = "opt_state") -> tuple[str, float] | None:
  """(path, value) of the first floating array (outside paths containing `skip`: the
  optimizer's moments) that is not finite or holds a magnitude above ABSURD_WEIGHT."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(path)
    if skip in name or not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating) \
        or not leaf.size:
      continue
    biggest = float(jnp.max(jnp.abs(leaf)))
    if not biggest <= ABSURD_WEIGHT:  # NaN included
      return name, biggest
  return None


def base_digest(base: Any) -> str:
  """One SHA-256 over the digests of a frozen base's arrays (`state_digests`)."""
  return _json_digest(sorted(state_digests(base).items()))


def _key_name(entry) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def state_digests(tree: Any) -> dict[str, str]:
  """{"a/b/0": sha256 hex} of every array leaf, keyed so a target-less restore matches.

  Paths join dict keys, sequence indices and dataclass field names alike, since
  a restore without the original structure returns lists and dataclasses as
  dicts. The digest covers dtype and shape as well as the bytes.
  """
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    arr = np.ascontiguousarray(distributed.to_host(leaf))  # whole, from every process
    h = hashlib.sha256(f"{arr.dtype.name}{arr.shape}".encode())
    h.update(arr.reshape(-1).view(np.uint8).data)  # bytes view: bfloat16 has no buffer format
    out["/".join(_key_name(e) for e in path)] = h.hexdigest()
  return out


def _json_digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def verify_digests(tree: Any, expected: dict[str, str], what: str, prefix: str = "") -> None:
  """Raises CorruptCheckpoint when a leaf of `tree` under `prefix` differs from `expected`.

  Every expected entry under `prefix` must be present (a missing array is damage too).
  """
  got = state_digests(tree)
  wanted = {k: v for k, v in expected.items() if k.startswith(prefix)}
  bad = sorted(k for k, v in wanted.items() if got.get(k) != v)
  if bad:
    raise CorruptCheckpoint(f"{what}: {len(bad)} of {len(wanted)} arrays differ from the "
                            f"digests recorded at save time (first: {bad[0]})")


class Checkpointer:
  """Saves and restores (state, data_state, meta) under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=False, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._base_digests = {}

  def steps(self) -> list[int]:
    """Finalized checkpoint steps, oldest first."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: Any, meta: dict) -> None:
    """Writes step `step`; overwrites nothing (a step already saved is skipped).

    LoRA params (`models/lora.py`) are saved without their frozen base: the checkpoint
    holds the adapters and the base's digest, which a restore compares."""
    if step in self.steps():
      return
    state, bases = lora.without_base(state)
    if bases:
      meta = {**meta, "base_digests": [self._base_digest(b) for b in bases]}
    meta = {**meta, "digests": {"state": state_digests(state), "data": _json_digest(data_state),
                                "meta": _json_digest(meta)}}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, Any, dict]:
    """Restores step `step` into the structure (and shardings) of `target`, verified.

    Raises CorruptCheckpoint when the contents differ from the save-time digests
    (checkpoints written before digests existed restore unverified, with a warning).
    """
    target, bases = lora.without_base(target)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    state, data, meta = restored["state"], restored["data"], dict(restored["meta"])
    digests = meta.pop("digests", None)
    if digests is None:
      log.warning("checkpoint step %d has no digests (written by an older version): "
                  "restored unverified", step)
    else:
      verify_digests(state, digests["state"], f"checkpoint step {step} state")
      for name, value in (("data-iterator state", data), ("metadata", meta)):
        key = "data" if name.startswith("data") else "meta"
        if key in digests and _json_digest(value) != digests[key]:
          raise CorruptCheckpoint(f"checkpoint step {step}: its {name} differs from its digest")
    saved_bases = meta.pop("base_digests", [])
    if saved_bases != [self._base_digest(b) for b in bases]:
      raise BaseModelMismatch(
          f"checkpoint step {step} in {self.directory} holds LoRA adapters trained on a base "
          f"model whose weights differ from the model loaded now (config.model "
          f"{meta.get('config', {}).get('model')!r}): load the model the run was trained on")
    return lora.with_base(state, bases), data, meta

  def _base_digest(self, base: Any) -> str:
    """`base_digest`, computed once per base (its arrays never change during a run)."""
    key = tuple(id(x) for x in jax.tree.leaves(base))
    if key not in self._base_digests:
      self._base_digests[key] = (base, base_digest(base))  # keeps the arrays (and ids) alive
    return self._base_digests[key][1]

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
      except BaseModelMismatch:
        raise  # not damage: the run is refused, its checkpoints kept
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
    if distributed.is_main():
      os.rename(src, dst)
    distributed.barrier(f"set aside {step}")
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


def _restore_anywhere() -> ocp.args.StandardRestore:
  """A target-less restore that works from any topology: arrays saved over devices this
  process does not have (a run on several devices or processes, read by a one-device
  export, evaluation or reward model) come back whole on this process's first device."""
  return ocp.args.StandardRestore(
      fallback_sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def latest_policy_params(workdir: str, step: int | None = None, merge_adapters: bool = True
                         ) -> tuple[Any, dict, int]:
  """(policy params, run metadata, step) from a training run's newest readable checkpoint,
  or from checkpoint `step` when given.

  Works without the experiment's code: the state is restored as plain arrays
  and the policy is `state["params"]` (or its "policy" entry when the params
  also hold a critic), or `state["ema_params"]` where the run kept the moving average
  that it evaluated, inside `state["train"]` for an overlapped run
  (`overlap.OverlapState`). A LoRA run's policy is its adapters merged into the base
  model its config names (checked against the digest the run recorded), or with
  `merge_adapters=False` its LoRA params as saved: {"base": None, "lora": adapters}.
  """
  ckpt = Checkpointer(workdir)
  try:
    steps = ckpt.steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {ckpt.directory} (it has "
                                f"{steps})")
      steps = [step]
    for step in reversed(steps):
      try:
        restored = ckpt._manager.restore(step, args=ocp.args.Composite(
            state=_restore_anywhere(), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - fall back to an older checkpoint
        log.warning("checkpoint step %d is unreadable (%s); trying an older one", step, e)
        continue
      state, meta = restored["state"], restored["meta"]
      root = ""
      if "params" not in state and "train" in state:  # an overlapped run's OverlapState
        state, root = state["train"], "train/"
      # The evaluated policy: the moving average of the policy's parameters where the run
      # kept one (GRPO's ema_decay), else the policy.
      field = "ema_params" if state.get("ema_params") else "params"
      params, prefix = state[field], f"{root}{field}/"
      if isinstance(params, dict) and "policy" in params:
        params, prefix = params["policy"], prefix + "policy/"
      if "digests" in meta:  # export must never ship damaged weights
        tree = {"train": {field: state[field]}} if root else {field: state[field]}
        verify_digests(tree, meta["digests"]["state"],
                       f"checkpoint step {step} in {ckpt.directory}", prefix=prefix)
      else:
        log.warning("checkpoint step %d has no digests (older version): exported unverified",
                    step)
      params = _as_lists(params)
      if merge_adapters:  # LoRA: the policy's adapters, or a reward model backbone's, merged
        params = _merge_every_adapter(params, meta, f"checkpoint step {step} in {workdir}")
      return params, meta, step
    raise FileNotFoundError(f"no readable checkpoint in {ckpt.directory}")
  finally:
    ckpt.close()


def _merge_every_adapter(params: Any, meta: dict, source: str) -> Any:
  """`params` with each LoRA node ({"base": None, "lora": ...}) its merged weights."""
  return jax.tree.map(lambda node: _merged_adapters(node["lora"], meta, source)
                      if lora.is_lora_params(node) else node, params,
                      is_leaf=lora.is_lora_params)


def _merged_adapters(adapters: Any, meta: dict, source: str) -> Any:
  """A LoRA run's policy: its adapters merged into the base model its config names, that
  base checked against the digest the checkpoint recorded."""
  from jaxrl_agents.models import zoo  # here: loading a model is this path's alone

  config = meta["config"]
  base = zoo.load(config["model"], dtype=config.get("dtype", "float32"),
                  param_dtype=config["lora"].get("base_dtype") or None).params
  base = lora.laid_out_like(base, adapters)
  saved = meta.get("base_digests", [])
  if saved and saved[0] != base_digest(base):
    raise BaseModelMismatch(f"{source}: its adapters were trained on a base model whose "
                            f"weights differ from {config['model']!r} as it loads now")
  return lora.merge(base, adapters, lora.spec_from_config(config["lora"]))


def plain_state(workdir: str, step: int) -> Any:
  """Checkpoint `step`'s train state as plain arrays (nested dicts and lists), read without
  the experiment's code: for notebooks and checks of what a run saved."""
  ckpt = Checkpointer(workdir)
  try:
    if step not in ckpt.steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {ckpt.directory} (it has "
                              f"{ckpt.steps()})")
    return ckpt._manager.restore(step, args=ocp.args.Composite(
        state=_restore_anywhere()))["state"]
  finally:
    ckpt.close()
