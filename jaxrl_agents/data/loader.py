"""grain loaders over random-access sources, with checkpointable iterator state.

```
source = data.load_task("arithmetic/mixed", "train")      # or data.load_jsonl(path)
it = data.make_loader(source, batch_size=8, seed=0)
batch = next(it)            # a list of 8 example dicts (strings stay strings)
state = it.get_state()      # a small JSON-able dict, e.g. {"next_index": 1}
...
it = data.make_loader(source, batch_size=8, seed=0)       # after a restart
it.set_state(state)         # continues with exactly the batch that would have come next
```
The pipeline is `MapDataset.source -> shuffle(seed) -> [shard] -> repeat -> batch`.
Since every step is index-based, the iterator's state is only the next batch
index, and restoring it replays nothing. `repeat` reseeds the shuffle each epoch
(a new, deterministic order per epoch), and batches run across epoch boundaries,
so every example is seen equally often whatever the batch size.

Checkpointing the state, either way:
- plain JSON: `it.get_state()` is a JSON-serializable dict; store it anywhere
  (e.g. `orbax.checkpoint.args.JsonSave(it.get_state())`) and `it.set_state(...)`;
- grain's Orbax handler: `grain.checkpoint.CheckpointSave(it)` /
  `grain.checkpoint.CheckpointRestore(it)` as an item of an Orbax
  `CheckpointManager` save/restore `Composite`. It writes one JSON file per process.
The state does not record the source, seed or batch size: restore into a loader
built with the same arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grain

T = TypeVar("T")


def _as_list(examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  # Shallow copies: with an in-memory source (a list from load_jsonl) grain hands
  # out the source's own dicts, and a caller editing a batch must not edit the data.
  return [dict(example) for example in examples]


def make_loader(
    source: Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
    read_options: grain.ReadOptions | None = None,
) -> grain.DatasetIterator:
  """A deterministic, resumable iterator of batches over `source`.

  Args:
    source: random-access examples (`len` and `[i]`), each a dict: a `TaskSource`
      from `load_task`, the list from `load_jsonl`, any grain data source.
    batch_size: examples per batch (per process when sharded).
    seed: shuffle seed; the same seed gives the same batches.
    shuffle: shuffle each epoch (reseeded per epoch); False keeps source order.
    num_epochs: passes over the data; None repeats forever.
    drop_remainder: with finite `num_epochs`, drop a last batch smaller than
      `batch_size` (static batch shapes under jit want this).
    shard_index: this process's shard, in [0, shard_count).
    shard_count: number of processes splitting the data. Each epoch's shuffled
      order is the same on every process (same seed), and process i takes
      positions i, i + shard_count, ...: the shards are disjoint and cover the
      data except for at most shard_count - 1 examples of the tail.
    read_options: grain read threads and buffer. Default: no background threads,
      reading in the calling thread; the prompts decode in microseconds and
      threads would only compete with XLA on a small CPU machine.

  Returns:
    A `grain.DatasetIterator`: `next(it)` is a list of `batch_size` example dicts;
    `it.get_state()` / `it.set_state(state)` save and restore the position.

  Raises:
    ValueError: an empty source or shard, or a bad batch size or shard.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
  if len(source) == 0:
    raise ValueError("the source is empty")
  dataset = grain.MapDataset.source(source)
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  if shard_count > 1:
    # Slicing after the shuffle: all processes cut the same permutation, so no overlap.
    dataset = dataset[shard_index:len(dataset) - len(dataset) % shard_count:shard_count]
    if len(dataset) == 0:
      raise ValueError(f"{len(source)} examples are too few for {shard_count} shards")
  dataset = dataset.repeat(num_epochs)
  dataset = dataset.batch(batch_size, drop_remainder=drop_remainder, batch_fn=_as_list)
  if read_options is None:
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return iter(dataset.to_iter_dataset(read_options))


def padded_batches(items: Sequence[T], batch_size: int) -> Iterator[tuple[int, int, list[T]]]:
  """(start, real rows, batch) over `items` in batches of `batch_size`: the last padded with
  copies of its first item, so every batch has one shape (one compiled program). Callers keep
  the first `real rows` results of each batch."""
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  for start in range(0, len(items), batch_size):
    chunk = list(items[start:start + batch_size])
    yield start, len(chunk), chunk + [chunk[0]] * (batch_size - len(chunk))


def num_batches(items: Sequence[Any], batch_size: int) -> int:
  """How many batches `padded_batches` yields (for a progress bar's total)."""
  return -(-len(items) // batch_size)
