"""Preference pairs: a prompt, a preferred ("chosen") and a dispreferred ("rejected") response.

From a JSONL file, one pair per line (any other fields are kept):

```
{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
```
or built from sampled responses to verifiable tasks (`pairs_from_groups`): for
each prompt, a response the grader accepts against one it rejects; and
`answer_swap_pairs` adds hard negatives, an accepted response against the same
text with its answer changed; `stated_answer_pairs` states a right and a wrong
answer with no sampling; `trailing_text_pairs` follows such replies with text,
which must not pay.

`encode_texts` / `encode_pairs` turn (prompt, response) texts into the token
sequences reward models and preference losses read.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_agents.data.jsonl import read_objects
from jaxrl_agents.models import tokenizer as tokenizer_lib

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
  if extra is not None and len(extra) != n // group_size:
    raise ValueError(f"extra has {len(extra)} entries for {n // group_size} groups")
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


def swap_answer(response: str, answer: str, wrong: str) -> str | None:
  """`response` with the last standalone occurrence of `answer` (not inside a longer
  number) replaced by `wrong`; None if `answer` does not occur. Linear time."""
  if not answer:
    return None
  last = None
  for match in re.finditer(r"(?<![0-9.])" + re.escape(answer) + r"(?![0-9]|\.[0-9])",
                           response):
    last = match
  if last is None:
    return None
  return response[:last.start()] + wrong + response[last.end():]


# Offsets from the right answer when the group's own wrong replies give no other number.
_NEAR_MISSES = (-10, -2, -1, 1, 2, 10)


def answer_swap_pairs(prompts: Sequence[str], responses: Sequence[str],
                      correct: Sequence[float], examples: Sequence[Mapping[str, Any]],
                      group_size: int, *, per_prompt: int, seed: int,
                      read_answer: Callable[[str], Any], grade: Callable[..., Sequence[float]]
                      ) -> list[dict[str, Any]]:
  """Hard negatives: an accepted response against the same text with a wrong answer.

  Pairs of sampled responses mostly differ in form (a wrong response often
  rambles, a right one states the answer), so a reward model trained on them
  alone can learn the form and ignore the answer; a policy trained on such a
  reward model then states any number in the right form. Here only the answer
  differs. The wrong answer is one the group's rejected responses gave
  (`read_answer`), else the right one plus a near miss (-10, -2, -1, 1, 2, 10).
  A swapped text the grader still accepts is dropped.

  Args:
    prompts, responses, correct: per row, in groups of `group_size` (the
      sampler's layout); correct > 0.5 is accepted.
    examples: per group, with the right "answer".
    per_prompt: the most pairs built from one group.
    seed: the draw's seed.
    read_answer: a response's answer as the grader reads it (a number or None).
    grade: the grader, `grade(responses, examples)` -> verdicts (1 accepts).

  Returns:
    [{"prompt", "chosen", "rejected", "answer", "source": "answer_swap"}].
  """
  n = len(prompts)
  if not (len(responses) == len(correct) == n) or group_size < 1 or n % group_size \
      or len(examples) != n // group_size:
    raise ValueError(f"{n} prompts, {len(responses)} responses, {len(correct)} verdicts and "
                     f"{len(examples)} examples are not groups of {group_size}")
  rng = random.Random(seed)
  candidates, their_examples = [], []
  for g, example in enumerate(examples):
    rows = range(g * group_size, (g + 1) * group_size)
    answer = str(example["answer"])
    good = sorted({responses[i] for i in rows if correct[i] > 0.5})
    if not good:
      continue
    wrong = sorted({_as_text(read_answer(responses[i])) for i in rows if correct[i] <= 0.5}
                   - {None, answer})
    if not wrong and answer.lstrip("-").isdigit():
      wrong = [str(int(answer) + d) for d in _NEAR_MISSES]
    combos = [(c, w) for c in good for w in wrong]
    for chosen, number in rng.sample(combos, min(per_prompt, len(combos))):
      swapped = swap_answer(chosen, answer, number)
      if swapped is not None and swapped != chosen:
        candidates.append({"prompt": prompts[g * group_size], "chosen": chosen,
                           "rejected": swapped, "answer": answer, "source": "answer_swap"})
        their_examples.append(example)
  if not candidates:
    return []
  verdicts = grade([c["rejected"] for c in candidates], their_examples)
  return [c for c, v in zip(candidates, verdicts, strict=True) if float(v) <= 0.5]


def stated_answer_pairs(prompts: Sequence[str], examples: Sequence[Mapping[str, Any]], *,
                        per_prompt: int, seed: int, state: Callable[[Mapping, Any], str],
                        mistake: Callable[[Mapping, random.Random], Any],
                        plain_share: float = 0.2) -> list[dict[str, Any]]:
  """Pairs that need no sampling: the right answer stated against a wrong one.

  Answer swaps (`answer_swap_pairs`) need a right sampled reply, so they are
  few where the model is weak, and a reward model trained on a few hundred of
  them told a right number from a wrong one little better than chance. Here
  every question gives `per_prompt` pairs: `state(example, answer)` (the
  task's reply form, e.g. "37 + 45 = 82") against the same with
  `mistake(example, rng)`, a plausible wrong answer; a `plain_share` of them
  in the form "The answer is N.".

  Returns:
    [{"prompt", "chosen", "rejected", "answer", "source": "stated_answer"}].
  """
  if len(prompts) != len(examples):
    raise ValueError(f"{len(prompts)} prompts for {len(examples)} examples")
  if per_prompt < 0 or not 0.0 <= plain_share <= 1.0:
    raise ValueError(f"per_prompt must be >= 0 and plain_share in [0, 1], got {per_prompt} "
                     f"and {plain_share}")
  rng = random.Random(seed)
  pairs = []
  for prompt, example in zip(prompts, examples, strict=True):
    answer = str(example["answer"])
    for _ in range(per_prompt):
      wrong = str(mistake(example, rng))
      if wrong == answer:
        raise ValueError(f"mistake() gave the right answer {answer} for {prompt!r}")
      if rng.random() < plain_share:
        chosen, rejected = f"The answer is {answer}.", f"The answer is {wrong}."
      else:
        chosen, rejected = state(example, answer), state(example, wrong)
      pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                    "answer": answer, "source": "stated_answer"})
  return pairs


def trailing_text_pairs(pairs: Sequence[Mapping[str, Any]], tails: Sequence[str], *,
                        share: float, seed: int) -> list[dict[str, Any]]:
  """Text after the answer neither rescues a wrong answer nor earns reward.

  A policy trained on a reward model that had seen only one-line statements
  learned to follow its equation with a ramble ("61 - 12 = 18" and a paragraph),
  which that reward model scored above the bare right statement. Here a `share`
  of `pairs` (a right reply over a wrong one, e.g. `stated_answer_pairs`) each
  gives one pair of these kinds, drawn at random, with a tail from `tails` (the
  model's own replies) after a blank line or a space:

    right          over  wrong + tail   a tail does not rescue a wrong answer
    right + tail   over  wrong + tail   the answer decides, tail or not
    right          over  right + tail   the prompt asks for the answer alone

  so right > right + tail > wrong + tail, the order the strict grader agrees
  with (it reads a reply's final statement, which a tail removes).

  Returns:
    [{"prompt", "chosen", "rejected", "answer", "source": "trailing_text"}].
  """
  if not 0.0 <= share <= 1.0:
    raise ValueError(f"share must be in [0, 1], got {share}")
  tails = sorted({t.strip() for t in tails if t.strip()})
  if share and pairs and not tails:
    raise ValueError("no tails to append (every given reply is empty)")
  rng = random.Random(seed)
  out = []
  for pair in pairs:
    if rng.random() >= share:
      continue
    tail = rng.choice(("\n\n", " ")) + rng.choice(tails)
    right, wrong = pair["chosen"], pair["rejected"]
    chosen, rejected = rng.choice(((right, wrong + tail), (right + tail, wrong + tail),
                                   (right, right + tail)))
    out.append({"prompt": pair["prompt"], "chosen": chosen, "rejected": rejected,
                "answer": pair.get("answer"), "source": "trailing_text"})
  return out


def _as_text(number) -> str | None:
  """An integer answer as text; None for no answer or a fraction (not swapped in)."""
  if number is None or getattr(number, "denominator", 1) != 1:
    return None
  return str(int(number))


# ----------------------------------------------------------------------------
# Texts to sequences: the prompt through the chat template, the response as plain text
# (special-token text in it stays text), then the token that closes it.


def response_ids(tok, prompt: str, response: str, *, chat: bool = True,
                 system: str | None = None) -> tuple[list[int], int]:
  """(token ids, prompt length) of one (prompt, response): the chat prompt, the response as
  plain text, and the token that closes the response (`end_token`)."""
  if chat:
    ids = tokenizer_lib.encode_chat(tok, prompt, system)[0]
  else:
    ids = tokenizer_lib.plain_ids(tok, prompt)
  return ids + tokenizer_lib.plain_ids(tok, response) + [end_token(tok)], len(ids)


def end_token(tok) -> int:
  """The token a reply ends with: EOS (an instruct model's end of turn, SmolLM2's
  <|im_end|>), else the first stop token."""
  if tok.eos_token_id is not None:
    return tok.eos_token_id
  stops = tokenizer_lib.stop_token_ids(tok)
  if not stops:
    raise ValueError("the tokenizer has no EOS and no <|endoftext|> token to close a reply with")
  return stops[0]


def bucket_width(length: int, multiple: int = 32) -> int:
  """The padded width of a batch whose longest sequence has `length` tokens: a multiple of
  `multiple`, so a stream of batches compiles a handful of shapes, not one per length."""
  return max(multiple, -(-length // multiple) * multiple)


class Encoded(NamedTuple):
  """(prompt, response) sequences, left-padded to one width W.

  tokens: int32[B, W]; mask: bool[B, W] the real tokens; response: bool[B, W]
  the response's tokens and its closing token; truncated: bool[B] the rows
  that lost their start to `max_len`.
  """
  tokens: np.ndarray
  mask: np.ndarray
  response: np.ndarray
  truncated: np.ndarray


def encode_texts(tok, prompts: Sequence[str], responses: Sequence[str], *, max_len: int,
                 chat: bool = True, system: str | None = None, width: int | None = None
                 ) -> Encoded:
  """(prompt, response) texts as sequences (`response_ids`), left-padded so every row's last
  column is its closing token.

  A sequence longer than `max_len` keeps its last `max_len` tokens (the end
  of the response, which the reward reads) and is flagged as truncated. W is
  `width`, or the bucketed length of the longest row (at most max_len).
  """
  if len(prompts) != len(responses):
    raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
  if max_len < 2:
    raise ValueError(f"max_len must be >= 2 tokens, got {max_len}")
  rows, starts, truncated = [], [], []
  keep = (max_len + 1) * longest_token_chars(tok)
  for p, r in zip(prompts, responses, strict=True):
    # Only the last max_len tokens are kept, and no token spans more than
    # longest_token_chars: the texts' ends are all that is tokenized (a 20 MB reply costs
    # what a reply of the kept length does, not 30 s of tokenizing at every step).
    if len(r) > keep:
      p, r = "", r[-keep:]
    elif len(p) > keep:
      p = p[-keep:]
    ids, prompt_len = response_ids(tok, p, r, chat=chat, system=system)
    cut = max(len(ids) - max_len, 0)
    truncated.append(cut > 0)
    rows.append(ids[cut:])
    starts.append(max(prompt_len - cut, 0))
  if width is None:
    width = min(bucket_width(max(len(r) for r in rows)), max(max_len, 1))
  tokens, mask = tokenizer_lib.pad_left(rows, tok.pad_token_id, width)
  response = np.zeros_like(mask)
  for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
    response[i, width - len(row) + start:] = True
  return Encoded(tokens, mask, response, np.asarray(truncated, bool))


@functools.lru_cache(maxsize=8)
def longest_token_chars(tok) -> int:
  """The most characters any one token of `tok` decodes to (SmolLM2's: 81)."""
  return max(len(tok.decode([i])) for i in range(len(tok)))


def reply_tail(response: np.ndarray, multiple: int = 16) -> np.ndarray:
  """The last R columns of right-aligned reply masks bool[B, W] (`Encoded.response`): R is
  the longest reply, rounded up to `multiple` (at most W), so the trainers compute
  vocabulary logits for R columns, not W (`rollout.scoring.reply_logprobs`)."""
  w = response.shape[1]
  longest = int(response.sum(axis=1).max(initial=0))
  r = min(w, bucket_width(longest, multiple))
  if response[:, :w - r].any():
    raise ValueError("reply masks are not right-aligned (a reply column before the last "
                     f"{r})")
  return response[:, w - r:]


def encode_pairs(tok, pairs: Sequence[Mapping[str, Any]], *, max_len: int, chat: bool = True,
                 system: str | None = None) -> tuple[Encoded, Encoded]:
  """(chosen, rejected) sides of pairs, encoded (`encode_texts`) at one shared width."""
  prompts = [p["prompt"] for p in pairs]
  sides = [[p[k] for p in pairs] for k in ("chosen", "rejected")]
  encoded = [encode_texts(tok, prompts, side, max_len=max_len, chat=chat, system=system)
             for side in sides]
  width = max(e.tokens.shape[1] for e in encoded)
  return tuple(e if e.tokens.shape[1] == width else
               encode_texts(tok, prompts, side, max_len=max_len, chat=chat, system=system,
                            width=width)
               for e, side in zip(encoded, sides, strict=True))
