"""A task example's user message: a prompt template formatted with the example's fields."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def format_prompts(examples: Sequence[Mapping[str, Any]], template: str) -> list[str]:
  """The user message of each example: `template` formatted with the example's fields."""
  out = []
  for i, ex in enumerate(examples):
    try:
      out.append(template.format(**ex))
    except KeyError as e:
      raise KeyError(f"prompt template {template!r} needs field {e} missing from example {i} "
                     f"(fields: {sorted(ex)})") from None
  return out
