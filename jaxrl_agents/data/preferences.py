"""Preference pairs: a prompt, a preferred ("chosen") and a dispreferred ("rejected") response.

From a JSONL file, one pair per line (any other fields are kept):

```
{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
```
or built from sampled responses to verifiable tasks (`pairs_from_groups`): for
each prompt, a response the grader accepts against one it rejects.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_agents.data.jsonl import read_objects

FIELDS = ("prompt", "chosen", "rejected")


def load_pairs(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The pairs of a JSONL file, each checked; a bad row names its file and line.

  Raises:
    FileNotFoundError: no such file.
    ValueError: no rows; or a row that is not a JSON object, lacks one of
      `FIELDS`, holds a non-string or empty one, or prefers a response to itself.
  """
  rows = []
  for where, row in read_objects(path):
    for field in FIELDS:
      if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (fields: {sorted(row)})")
      if not isinstance(row[field], str):
        raise ValueError(f"{where}: field {field!r} must be a string, got "
                         f"{type(row[field]).__name__}")
      if field != "prompt" and not row[field].strip():
        raise ValueError(f"{where}: field {field!r} is empty")
    if row["chosen"] == row["rejected"]:
      raise ValueError(f"{where}: 'chosen' and 'rejected' are the same response")
    rows.append(row)
  if not rows:
    raise ValueError(f"{os.fspath(path)}: no rows (the file is empty or blank)")
  return rows


def write_pairs(path: str | os.PathLike, pairs: Sequence[Mapping[str, Any]]) -> None:
  """Writes pairs as JSONL (atomically: a crash leaves the old file or none)."""
  tmp = f"{os.fspath(path)}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for pair in pairs:
      f.write(json.dumps(dict(pair), ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def pairs_from_groups(prompts: Sequence[str], responses: Sequence[str],
                      correct: Sequence[float], group_size: int, *, max_pairs_per_prompt: int,
                      seed: int, extra: Sequence[Mapping[str, Any]] | None = None
                      ) -> list[dict[str, Any]]:
  """Pairs (accepted response, rejected response) to the same prompt.

  Rows come in groups of `group_size` responses to one prompt (the sampler's
  layout). In each group with both kinds, up to `max_pairs_per_prompt`
  distinct (accepted, rejected) combinations are drawn without replacement;
  identical texts are counted once, so no pair prefers a response to itself.

  Args:
    prompts, responses, correct: per row; correct > 0.5 is accepted.
    group_size: G, responses per prompt.
    max_pairs_per_prompt: the most pairs taken from one group.
    seed: the draw's seed.
    extra: optional per-group fields copied into its pairs (e.g. the answer).

  Returns:
    [{"prompt", "chosen", "rejected", **extra}], group by group.
  """
  n = len(prompts)
  if not (len(responses) == len(correct) == n) or group_size < 1 or n % group_size:
    raise ValueError(f"{n} prompts, {len(responses)} responses and {len(correct)} verdicts "
                     f"are not groups of {group_size}")
  rng = random.Random(seed)
  pairs = []
  for g in range(n // group_size):
    rows = range(g * group_size, (g + 1) * group_size)
    good = sorted({responses[i] for i in rows if correct[i] > 0.5})
    bad = sorted({responses[i] for i in rows if correct[i] <= 0.5} - set(good))
    combos = [(c, r) for c in good for r in bad]
    for chosen, rejected in rng.sample(combos, min(max_pairs_per_prompt, len(combos))):
      pairs.append({"prompt": prompts[g * group_size], "chosen": chosen, "rejected": rejected,
                    **(dict(extra[g]) if extra is not None else {})})
  return pairs
