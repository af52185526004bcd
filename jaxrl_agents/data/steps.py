"""Replies as reasoning steps, for process reward models.

A reply's steps are its lines (`split_steps`): each step keeps the separator
that ends it, blank lines stay with the step before them, and the steps joined
give the reply back exactly. `encode_steps` turns (prompt, steps) into one
left-padded token sequence per reply and the column where each step ends: a
process reward model's score for step k is read there (the last step's at the
token that closes the reply).

Step-labelled rows, from JSONL or generated (`experiments/step_data.py`):

```
{"prompt": "What is 2 + 3 * 4?", "steps": ["3 * 4 = 12\\n", "2 + 12 = 14"], "values": [1.0, 1.0]}
```
`values[k]` in [0, 1] is the probability that a reply continuing from steps
0..k reaches the right answer (a hard 0/1 label is its special case).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_agents.data.jsonl import read_objects
from jaxrl_agents.data.preferences import bucket_width, end_token
from jaxrl_agents.models import tokenizer as tokenizer_lib


def split_steps(text: str, separator: str = "\n", max_steps: int = 8) -> list[str]:
  """The steps of `text`: pieces ending in `separator` (a run of separators, e.g. a blank
  line, stays with the piece before it) and the rest; steps past `max_steps` join the
  last. `"".join(split_steps(text)) == text`; an empty text is one empty step. Linear time."""
  if not separator:
    raise ValueError("the step separator must not be empty")
  if max_steps < 1:
    raise ValueError(f"max_steps must be >= 1, got {max_steps}")
  steps, start, i = [], 0, 0
  content_end = len(text.rstrip())  # past it only whitespace remains
  while True:
    found = text.find(separator, i)
    if found < 0:
      break
    i = found + len(separator)
    while text.startswith(separator, i):  # a run of separators ends one step
      i += len(separator)
    if i < content_end:  # a separator with nothing after it belongs to the last step
      steps.append(text[start:i])
      start = i
  steps.append(text[start:])
  if len(steps) > max_steps:
    steps[max_steps - 1:] = ["".join(steps[max_steps - 1:])]
  return steps


class EncodedSteps(NamedTuple):
  """(prompt, steps) rows as left-padded sequences of one width W, with K step slots.

  tokens: int32[B, W]; mask: bool[B, W] the real tokens; ends: int32[B, K] the
  column of each step's end (its last token; the last step's is the closing
  token), 0 in an empty slot; step_mask: bool[B, K] the slots that hold a step
  still in the sequence; truncated: bool[B] the rows that lost their start to
  `max_len` (a step cut off entirely leaves the step mask).
  """
  tokens: np.ndarray
  mask: np.ndarray
  ends: np.ndarray
  step_mask: np.ndarray
  truncated: np.ndarray


def encode_steps(tok, prompts: Sequence[str], steps: Sequence[Sequence[str]], *, max_len: int,
                 max_steps: int, chat: bool = True, system: str | None = None,
                 width: int | None = None) -> EncodedSteps:
  """Each row: the chat prompt, each step as plain text (special-token text stays text),
  then the closing token (`preferences.end_token`). A row longer than `max_len` keeps its
  last `max_len` tokens. W is `width`, or the bucketed longest row (at most max_len)."""
  if len(prompts) != len(steps):
    raise ValueError(f"{len(prompts)} prompts but {len(steps)} step lists")
  if max_len < 2:
    raise ValueError(f"max_len must be >= 2 tokens, got {max_len}")
  close = end_token(tok)
  rows, row_ends, truncated = [], [], []
  for i, (prompt, row_steps) in enumerate(zip(prompts, steps, strict=True)):
    if not 1 <= len(row_steps) <= max_steps:
      raise ValueError(f"row {i} has {len(row_steps)} steps; expected 1 to {max_steps}")
    ids = (tokenizer_lib.encode_chat(tok, prompt, system)[0] if chat
           else tokenizer_lib.plain_ids(tok, prompt))
    ends = []
    for step in row_steps:
      ids = ids + tokenizer_lib.plain_ids(tok, step)
      ends.append(len(ids) - 1)
    ids.append(close)
    ends[-1] = len(ids) - 1  # the last step is read at the closing token
    cut = max(len(ids) - max_len, 0)
    truncated.append(cut > 0)
    rows.append(ids[cut:])
    row_ends.append([e - cut for e in ends])
  if width is None:
    width = min(bucket_width(max(len(r) for r in rows)), max_len)
  tokens, mask = tokenizer_lib.pad_left(rows, tok.pad_token_id, width)
  ends = np.zeros((len(rows), max_steps), np.int32)
  step_mask = np.zeros((len(rows), max_steps), bool)
  for i, (row, row_end) in enumerate(zip(rows, row_ends, strict=True)):
    for k, e in enumerate(row_end):
      if e >= 0:  # an empty step ends where the one before it did: still a real column
        ends[i, k] = width - len(row) + e
        step_mask[i, k] = True
  return EncodedSteps(tokens, mask, ends, step_mask, np.asarray(truncated, bool))


def load_step_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The step-labelled rows of a JSONL file, each checked; a bad row names its file and line.

  Raises:
    FileNotFoundError: no such file.
    ValueError: no rows; or a row that lacks "prompt", "steps" or "values", whose
      steps are not a non-empty list of strings, or whose values are not one number
      in [0, 1] per step.
  """
  rows = []
  for where, row in read_objects(path):
    for field in ("prompt", "steps", "values"):
      if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (fields: {sorted(row)})")
    if not isinstance(row["prompt"], str):
      raise ValueError(f"{where}: field 'prompt' must be a string")
    s, v = row["steps"], row["values"]
    if not isinstance(s, list) or not s or not all(isinstance(x, str) for x in s):
      raise ValueError(f"{where}: field 'steps' must be a non-empty list of strings")
    if not isinstance(v, list) or len(v) != len(s):
      raise ValueError(f"{where}: field 'values' must be a list of {len(s)} numbers (one "
                       "per step)")
    for x in v:
      if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{where}: step value {x!r} is not a number in [0, 1]")
    rows.append(row)
  if not rows:
    raise ValueError(f"{os.fspath(path)}: no rows (the file is empty or blank)")
  return rows


def step_values(rows: Sequence[Mapping[str, Any]], max_steps: int) -> tuple[np.ndarray,
                                                                           np.ndarray]:
  """(f32[B, K] values, bool[B, K] which slots hold a step) of step-labelled rows."""
  values = np.zeros((len(rows), max_steps), np.float32)
  present = np.zeros((len(rows), max_steps), bool)
  for i, row in enumerate(rows):
    n = len(row["values"])
    if n > max_steps:
      raise ValueError(f"row {i} has {n} steps; at most {max_steps}")
    values[i, :n] = row["values"]
    present[i, :n] = True
  return values, present
