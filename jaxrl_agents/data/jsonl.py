"""Prompt files in JSON Lines: one JSON object per line, with a prompt and an answer.

```
{"prompt": "What is 2 + 3?", "answer": "5"}
{"prompt": "Name the capital of France.", "answer": "Paris", "source": "geo"}
```
`load_jsonl` validates every row up front and names the file and line of the
first bad one, so a typo fails at startup rather than hours into a run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


def load_jsonl(path: str | os.PathLike, prompt_field: str = "prompt",
               answer_field: str = "answer") -> list[dict[str, Any]]:
  """Reads a JSONL prompt file into a list of row dicts.

  Blank lines are skipped. Rows keep all their fields, unchanged (callers index
  them with the same `prompt_field` / `answer_field` names).

  Args:
    path: the .jsonl file (UTF-8).
    prompt_field: key every row must hold, with a string value.
    answer_field: key every row must hold, with any non-null value (a string,
      a number, or a list of accepted answers: the reward function decides).

  Returns:
    The rows, in file order; at least one.

  Raises:
    FileNotFoundError: no such file.
    ValueError: the file has no rows, or a line is not UTF-8, not valid JSON, not
      an object, lacks a field or has a non-string prompt; the message names the
      file and the 1-based line number.
  """
  path = os.fspath(path)
  rows: list[dict[str, Any]] = []
  for where, row in read_objects(path):
    for field in (prompt_field, answer_field):
      if row.get(field) is None:
        raise ValueError(f"{where}: missing field {field!r} (fields: {sorted(row)})")
    if not isinstance(row[prompt_field], str):
      raise ValueError(f"{where}: field {prompt_field!r} must be a string, got "
                       f"{type(row[prompt_field]).__name__}")
    rows.append(row)
  if not rows:
    raise ValueError(f"{path}: no rows (the file is empty or blank)")
  return rows


def read_objects(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
  """("FILE:LINE", row) for each non-blank line of a JSONL file, every row a JSON object of
  text (UTF-8, no lone surrogates); a line that is not names its file and line."""
  path = os.fspath(path)
  with open(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      where = f"{path}:{line_number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e})") from e
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
      except (ValueError, RecursionError) as e:  # a 5000-digit integer, 100,000-deep nesting
        raise ValueError(f"{where}: JSON that cannot be read ({type(e).__name__}: "
                         f"{str(e)[:160]})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
      _check_text(row, where)
      yield where, row


def _check_text(value: Any, where: str, field: str = "") -> None:
  """Rejects strings that are not text: a JSON escape like \\ud800 decodes to a lone
  surrogate, which no tokenizer (nor UTF-8) can encode. Iterative: a row nested as deep
  as the JSON parser allows is checked without recursion."""
  stack = [(value, field)]
  while stack:
    value, field = stack.pop()
    if isinstance(value, str):
      try:
        value.encode("utf-8")
      except UnicodeEncodeError as e:
        raise ValueError(f"{where}: field {field or '?'!r} holds {value[e.start:e.end]!r} at "
                         f"character {e.start}, a lone surrogate (not text)") from None
    elif isinstance(value, dict):
      stack.extend((v, f"{field}.{k}" if field else str(k)) for k, v in value.items())
    elif isinstance(value, list):
      stack.extend((v, f"{field}[{i}]") for i, v in enumerate(value))
