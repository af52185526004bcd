"""`load_task`: the project's TFDS tasks as random-access sequences of plain dicts.

```
from jaxrl_agents import data

train = data.load_task("arithmetic/add2", "train")
len(train)   # 7600
train[0]     # {'a': 93, 'answer': '152', 'b': 59, 'operation': 'add',
             #  'question': 'What is 93 + 59?'}
```
The first call prepares the dataset (array_record files, a second or so) under
`<cache_dir()>/tensorflow_datasets` (cache_dir() is $JAXRL_AGENTS_CACHE or
~/.cache/jaxrl_agents); later calls only open the files. Preparation holds a file
lock, so processes sharing a filesystem (several hosts, or pytest workers)
prepare a dataset once. TensorFlow is not used.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_agents.data import suites
from jaxrl_agents.data.arithmetic import Arithmetic
from jaxrl_agents.data.countdown import Countdown

BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "arithmetic": Arithmetic,
    "countdown": Countdown,
}


def task_names() -> list[str]:
  """Every valid `load_task` name: "builder/config" for each config, then the suites'."""
  return sorted(f"{name}/{config.name}" for name, builder in BUILDERS.items()
                for config in builder.BUILDER_CONFIGS) + suites.suite_names()


def default_data_dir() -> str:
  """`<cache_dir()>/tensorflow_datasets`, where `load_task` prepares datasets by default."""
  # Imported here: zoo pulls in jax and the model code, which reading data does not need.
  from jaxrl_agents.models.zoo import cache_dir
  return os.path.join(cache_dir(), "tensorflow_datasets")


def _to_python(value: Any) -> Any:
  """Decoded TFDS values -> str / int / float / list, so batches need no numpy or bytes."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    return [_to_python(v) for v in value.tolist()] if value.ndim else _to_python(value.item())
  if isinstance(value, np.generic):
    return _to_python(value.item())
  if isinstance(value, list | tuple):
    return [_to_python(v) for v in value]
  if isinstance(value, Mapping):
    return {k: _to_python(v) for k, v in value.items()}
  return value


class TaskSource(Sequence[dict[str, Any]]):
  """Random access to a prepared split, yielding dicts of plain Python values.

  Wraps a TFDS data source (an array_record reader): text features come back as
  str, integers as int, sequences as lists. Each read returns a fresh dict.
  grain's `MapDataset.source` accepts it directly.
  """

  def __init__(self, source: Sequence[Any], name: str, split: str,
               convert: Callable[[Any], Any] = _to_python):
    self._source = source
    self.name = name
    self.split = split
    # How a stored example becomes the returned one. A suite's examples are Python
    # already and keep their types (reasoning-gym's scorers compare tuples in their
    # metadata): they are deep-copied, not converted.
    self._convert = convert

  def __len__(self) -> int:
    return len(self._source)

  def _check(self, index: int) -> int:
    index = int(index)
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(f"index {index} out of range for {self!r}")
    return index

  def __getitem__(self, index):  # int -> dict, slice -> list of dicts
    if isinstance(index, slice):
      return self.__getitems__(range(*index.indices(len(self))))
    return self._convert(self._source[self._check(index)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Several examples in one read (grain uses this when present)."""
    indices = [self._check(i) for i in indices]
    if not indices:
      return []
    read = getattr(self._source, "__getitems__", None)  # a list (a suite's) has none
    rows = read(indices) if read else [self._source[i] for i in indices]
    return [self._convert(e) for e in rows]

  def __iter__(self) -> Iterator[dict[str, Any]]:
    chunk = 512  # batched reads are faster than one record at a time
    for start in range(0, len(self), chunk):
      yield from self.__getitems__(range(start, min(start + chunk, len(self))))

  def __repr__(self) -> str:
    return f"TaskSource({self.name!r}, split={self.split!r}, len={len(self)})"


@contextlib.contextmanager
def _lock(path: str) -> Iterator[None]:
  """An exclusive advisory lock on `path` (created if missing) for the block's duration."""
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare(name: str, data_dir: str | None = None) -> tfds.core.GeneratorBasedBuilder:
  """Prepares task `name` (array_record files) if needed and returns its builder.

  Args:
    name: "builder" or "builder/config", e.g. "countdown" or "arithmetic/mixed";
      see `task_names()`. A bare builder name means its default config.
    data_dir: TFDS data directory; default `default_data_dir()`.

  Returns:
    The prepared builder (`builder.as_data_source(split)` reads it).

  Raises:
    KeyError: unknown builder or config; the message lists the valid names.
  """
  builder_name, _, config_name = name.partition("/")
  if builder_name not in BUILDERS:
    raise KeyError(f"unknown task {name!r}; known: {task_names()}")
  cls = BUILDERS[builder_name]
  config_name = config_name or cls.DEFAULT_BUILDER_CONFIG_NAME
  if config_name not in {c.name for c in cls.BUILDER_CONFIGS}:
    raise KeyError(f"unknown task {name!r}; known: {task_names()}")
  data_dir = os.fspath(data_dir) if data_dir is not None else default_data_dir()
  os.makedirs(data_dir, exist_ok=True)
  lock_path = os.path.join(data_dir, f".{builder_name}.{config_name}.lock")
  # Build under the lock, so a builder made after another process finished reads its files.
  with _lock(lock_path):
    builder = cls(config=config_name, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
      # TFDS prints its progress notes to stdout; keep stdout for the caller's own output.
      with contextlib.redirect_stdout(sys.stderr):
        builder.download_and_prepare()
  return builder


def load_task(name: str, split: str, data_dir: str | None = None, **options) -> TaskSource:
  """A random-access split of a task, prepared on first use.

  Args:
    name: "arithmetic/<config>" (add1, sub1, add2, sub2, mul_table, mixed),
      "countdown[/<config>]" (n3, n4, mixed), or a third-party suite's (`data/suites.py`:
      "gsm8k", "aime2025", "gpqa_diamond", "reasoning_gym/<task>[,<task>...]"); see
      `task_names()`.
    split: "train", "test", or (the TFDS tasks) a slice such as "train[:100]".
    data_dir: TFDS data directory; default `<cache_dir()>/tensorflow_datasets`.
    **options: a suite's options (reasoning-gym: size, seed, weights, configs, ...).

  Returns:
    A `TaskSource`: `len()` and `[i]` give dicts of str / int / list values.
  """
  if suites.is_suite(name):
    return TaskSource(suites.load(name, split, **options), name=name, split=split,
                      convert=copy.deepcopy)
  if options:
    raise ValueError(f"task {name!r} takes no options, got {sorted(options)}")
  builder = prepare(name, data_dir)
  return TaskSource(builder.as_data_source(split=split), name=name, split=split)
