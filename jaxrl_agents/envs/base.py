"""What an environment is, and the token tools JAX-native environments build on.

A JAX-native environment is pure and works on one episode; the rollout vmaps
it over the batch and runs it inside `lax.scan` (rollout/multiturn.py):

  sample_task(key)            -> task          a pytree of arrays (what a group shares)
  reset(key, task)            -> (state, obs)  obs: the first user message's content
  step(state, action)         -> EnvStep(state, obs, reward, done, info)

`action` and every `obs` are `Tokens`: a fixed-width int32 row and its bool
mask (real tokens first); every step's obs has width `obs_width`, the reset's
its own. Observations are produced as token ids inside jit, from pieces
tokenized once when the environment is made (`piece_table`), so nothing is
ever re-tokenized during an episode. The rollout wraps each observation in the
chat template's user turn; an environment writes content only. Special-token
text in a piece is spelled out as text (`tokenizer.plain_ids`), never a
control token.

`info` is a dict of scalar arrays with the same keys on every step (e.g.
"invalid", "success"); the rollout sums them per episode for the metrics.

Optional methods serve turn-level credit (`experiments/grpo.py`'s
`turn_credit`, `potential_shaping`):

  state_key(state) -> int32[]   equal keys are the same state (GiGPO's step groups)
  potential(state) -> f32[]     a state's potential (potential-based shaping)

and one IGPO's information gain reads (turn_credit "igpo"):

  answer(task) -> Tokens        the gold answer's content tokens (real tokens first)

A two-player game for self-play (`rollout.self_play`, one policy on both
sides) has `num_players = 2` and, instead of reset's observation and step's
single reward, `to_move(state)` (whose reply `step` takes), `observe(state)`
(that player's next message) and `step` returning a `GameStep` (a reward per
player).

Either kind may have a `preamble`: a worked example episode as chat messages
({"role": "user" | "assistant", "content": str}, starting with the user and
ending with the assistant) that the rollout puts before every episode's first
message, the way one shows a small model a format it would not find alone. It
is part of the prompt, never of the loss (`check_preamble`).

A host environment (`HostEnv`: tools, databases, anything in Python) works on
strings and is stepped by `rollout.host_loop` in a thread pool with a time limit:

  sample_task(rng: np.random.Generator) -> task
  episode(task) -> an object with
    reset() -> str                        the first user message
    step(reply: str) -> HostStep(obs: str, reward, done, info: {name: float})
  answer(task) -> str                     optional: the gold answer as the agent would
                                          write it (IGPO's information gain)

Its observations are tokenized as plain text by the loop; the reply it gets is
the decoded text of what the policy sampled (hostile input: parse it in linear
time, never eval it).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.models import tokenizer as tokenizer_lib


class Tokens(NamedTuple):
  """A fixed-width block of tokens: int32[..., W] ids and bool[..., W] real-token mask."""

  ids: jax.Array
  mask: jax.Array


class EnvStep(NamedTuple):
  """What `step` returns for one episode."""

  state: Any
  obs: Tokens
  reward: jax.Array  # f32[]
  done: jax.Array  # bool[]
  info: dict[str, jax.Array]


class GameStep(NamedTuple):
  """What a two-player game's `step` returns for one game (`rollout.self_play`)."""

  state: Any
  rewards: jax.Array  # f32[2] each player's reward for this move (the outcome when it ends)
  done: jax.Array  # bool[]
  info: dict[str, jax.Array]  # f32[2] each player's


class HostStep(NamedTuple):
  """What a host environment's `step` returns."""

  obs: str
  reward: float
  done: bool
  info: dict[str, float]


class HostEnv(Protocol):
  """A host environment (see the module docstring); `host` is True."""

  host: bool

  def sample_task(self, rng: np.random.Generator) -> Any: ...
  def episode(self, task: Any) -> Any: ...


class Env(Protocol):
  """A JAX-native environment (see the module docstring)."""

  obs_width: int  # W of every observation

  def sample_task(self, key: jax.Array) -> Any: ...
  def reset(self, key: jax.Array, task: Any) -> tuple[Any, Tokens]: ...
  def step(self, state: Any, action: Tokens) -> EnvStep: ...


def check_preamble(tokenizer, preamble: Sequence[dict[str, str]]) -> None:
  """Refuses a preamble that is not alternating user/assistant messages, starting with the
  user and ending with the assistant, or whose text holds a special token's text (the chat
  template's rendering would turn it into a control token)."""
  # Added tokens count too: `encode` parses them even when they are not marked special.
  special = {t for t in getattr(tokenizer, "all_special_tokens", []) if t}
  special |= set(getattr(tokenizer, "get_added_vocab", dict)())
  for i, message in enumerate(preamble):
    role = "user" if i % 2 == 0 else "assistant"
    if not isinstance(message, dict) or set(message) != {"role", "content"} \
        or message["role"] != role or not isinstance(message["content"], str):
      raise ValueError(f"preamble message {i} must be {{'role': {role!r}, 'content': str}}, "
                       f"got {message!r}")
    for token in special:
      if token in message["content"]:
        raise ValueError(f"preamble message {i} holds the special token text {token!r}")
  if len(preamble) % 2:
    raise ValueError("a preamble ends with the assistant's message (an even number of them)")


def piece_table(tokenizer, texts: Sequence[str], width: int | None = None) -> Tokens:
  """Texts tokenized once as plain text, left-aligned in int32[n, W] with masks.

  Raises ValueError when a text needs more than `width` tokens.
  """
  ids = [tokenizer_lib.plain_ids(tokenizer, t) for t in texts]
  longest = max((len(i) for i in ids), default=0)
  width = longest if width is None else width
  if longest > width:
    raise ValueError(f"a piece of {longest} tokens does not fit width {width}: "
                     f"{texts[int(np.argmax([len(i) for i in ids]))]!r}")
  return token_rows(ids, width)


def token_rows(rows: Sequence[Sequence[int]], width: int) -> Tokens:
  """Token id lists (each at most `width` long) left-aligned in int32[n, width] with masks."""
  table = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for r, row in enumerate(rows):
    table[r, :len(row)] = row
    mask[r, :len(row)] = True
  return Tokens(jnp.asarray(table), jnp.asarray(mask))


def row(table: Tokens, index) -> Tokens:
  """Row `index` (traced or not) of a piece table."""
  return Tokens(table.ids[index], table.mask[index])


def concat(*blocks: Tokens) -> Tokens:
  """Blocks side by side, then compacted: real tokens keep their order, padding goes right."""
  ids = jnp.concatenate([b.ids for b in blocks], axis=-1)
  mask = jnp.concatenate([b.mask for b in blocks], axis=-1)
  return pack(Tokens(ids, mask), side="right")


def pack(block: Tokens, side: str) -> Tokens:
  """The block's real tokens moved together, in order, to its `side` ("left" or "right")."""
  key = ~block.mask if side == "right" else block.mask
  order = jnp.argsort(key, axis=-1, stable=True)
  take = lambda a: jnp.take_along_axis(a, order, axis=-1)
  return Tokens(take(block.ids), take(block.mask))


class NumberReader(NamedTuple):
  """Per-token tables to read ASCII integers out of token ids inside jit.

  value[t]: the integer a token's text spells when it is only ASCII digits
  (after one optional leading space), else -1; digits[t]: how many digits;
  fresh[t]: the token starts with a space (a new number, not a continuation);
  minus[t]: the token's text ends with "-" (a number right after it is negative).
  """

  value: jax.Array
  digits: jax.Array
  fresh: jax.Array
  minus: jax.Array | None = None  # None: no token is a minus sign


# Large enough for any game here; reading saturates at it (see `last_number`).
NUMBER_CAP = 1_000_000


def number_reader(tokenizer) -> NumberReader:
  """The NumberReader of a tokenizer's vocabulary (built once, on the host)."""
  vocab = tokenizer.get_vocab()
  size = max(vocab.values()) + 1
  value = np.full(size, -1, np.int32)
  digits = np.zeros(size, np.int32)
  fresh = np.zeros(size, bool)
  minus = np.zeros(size, bool)
  for token_id in range(size):
    text = tokenizer.decode([token_id])
    body = text[1:] if text.startswith(" ") else text
    if 0 < len(body) <= 6 and body.isascii() and body.isdigit():
      value[token_id], digits[token_id], fresh[token_id] = int(body), len(body), text != body
    minus[token_id] = text.endswith("-")
  return NumberReader(jnp.asarray(value), jnp.asarray(digits), jnp.asarray(fresh),
                      jnp.asarray(minus))


def last_number(reader: NumberReader, action: Tokens) -> tuple[jax.Array, jax.Array]:
  """(int32 value, bool found) of the last run of digit tokens in one action row.

  A run right after a token ending in "-" (no space between) is negative: "-1" reads -1,
  which no square, guess or count here accepts. Magnitudes are capped at NUMBER_CAP (a
  longer number reads as NUMBER_CAP, which no game here accepts). Linear in the row's
  width.
  """
  ids = jnp.clip(action.ids, 0, reader.value.shape[0] - 1)
  value, digits, fresh = reader.value[ids], reader.digits[ids], reader.fresh[ids]
  minus = (reader.minus[ids] if reader.minus is not None else jnp.zeros_like(fresh)) \
      & action.mask
  is_digit = action.mask & (value >= 0)

  def scan(carry, x):
    current, in_number, negative, after_minus, last, found = carry
    v, d, f, is_d, m = x
    scale = 10 ** jnp.minimum(d, 6)
    # Saturate before multiplying: current * scale can leave int32 (1e6 * 1e6).
    extended = jnp.where(current > (NUMBER_CAP - v) // scale, NUMBER_CAP, current * scale + v)
    start = ~in_number | f
    new_current = jnp.where(is_d, jnp.where(start, v, extended), current)
    new_negative = jnp.where(is_d & start, after_minus & ~f, negative)
    closes = in_number & (~is_d | f)
    last = jnp.where(closes, jnp.where(negative, -current, current), last)
    found = found | closes
    return (new_current, is_d, new_negative, m & ~is_d, last, found), None

  init = (jnp.int32(0), jnp.bool_(False), jnp.bool_(False), jnp.bool_(False), jnp.int32(0),
          jnp.bool_(False))
  (current, in_number, negative, _, last, found), _ = jax.lax.scan(
      scan, init, (value, digits, fresh, is_digit, minus))
  return jnp.where(in_number, jnp.where(negative, -current, current), last), found | in_number


class KeywordReader(NamedTuple):
  """Token sequences of keywords, to find them in an action inside jit.

  seqs: int32[V, M] the variants' token ids (padded with -1), lengths: int32[V],
  word: int32[V] which keyword each variant spells.
  """

  seqs: jax.Array
  lengths: jax.Array
  word: jax.Array


def keyword_reader(tokenizer, words: Sequence[str]) -> KeywordReader:
  """The KeywordReader of `words` (lower case, as written, capitalized and upper case; with
  and without a leading space), tokenized once on the host."""
  variants = sorted({(i, tuple(tokenizer_lib.plain_ids(tokenizer, space + form)))
                     for i, w in enumerate(words) for space in ("", " ")
                     for form in (w, w.lower(), w.capitalize(), w.upper())})
  width = max(len(ids) for _, ids in variants)
  seqs = np.full((len(variants), width), -1, np.int32)
  for v, (_, ids) in enumerate(variants):
    seqs[v, :len(ids)] = ids
  return KeywordReader(jnp.asarray(seqs), jnp.asarray([len(ids) for _, ids in variants]),
                       jnp.asarray([i for i, _ in variants], jnp.int32))


def last_keyword(reader: KeywordReader, action: Tokens) -> tuple[jax.Array, jax.Array]:
  """(int32 index into the words, bool found) of the keyword that ends last in one action
  row (the longest variant on a tie). A keyword inside a longer word counts too.
  Linear in the row's width (times the variants' count and length)."""
  t = action.ids.shape[-1]
  m = reader.seqs.shape[1]
  ids = jnp.concatenate([jnp.where(action.mask, action.ids, -2), jnp.full((m,), -2)])
  windows = jnp.stack([ids[j:j + t] for j in range(m)], axis=1)  # [T, M]
  wanted = jnp.arange(m)[None, :] < reader.lengths[:, None]  # [V, M]
  same = (windows[None] == reader.seqs[:, None, :]) | ~wanted[:, None, :]  # [V, T, M]
  matched = same.all(-1)
  end = jnp.arange(t)[None, :] + reader.lengths[:, None]
  score = jnp.where(matched, end * (m + 1) + reader.lengths[:, None], -1)
  best = jnp.argmax(score.reshape(-1))
  return reader.word[best // t], score.reshape(-1)[best] >= 0


def last_between(text: str, opening: str, closing: str) -> str | None:
  """The text inside the last complete `opening`...`closing` pair of `text`, else None.

  Two `str.rfind` passes: linear in the text whatever it holds (unclosed or
  nested tags included).
  """
  end = text.rfind(closing)
  if end < 0:
    return None
  start = text.rfind(opening, 0, end)
  return None if start < 0 else text[start + len(opening):end]


def grid(cells: Tokens, kinds: jax.Array, rows: int, line_end: Tokens) -> Tokens:
  """A text grid from pieces: `kinds` int[rows * cols] picks each square's piece of
  `cells` (row-major), and every row ends with `line_end`'s one piece. One flat
  block of tokens, padding inside (`concat` packs it)."""
  squares = row(cells, kinds)  # [rows * cols, W]
  ends = jax.tree.map(lambda x: jnp.broadcast_to(x, (rows,) + x.shape[1:]), line_end)
  lines = Tokens(*(jnp.concatenate([sq.reshape(rows, -1), end], axis=1)
                   for sq, end in zip(squares, ends, strict=True)))
  return Tokens(lines.ids.reshape(-1), lines.mask.reshape(-1))


def multiset_f1(predicted: collections.Counter, gold: collections.Counter) -> float:
  """F1 of two multisets (1 when both are empty)."""
  overlap = sum((predicted & gold).values())
  if not overlap:
    return float(not predicted and not gold)
  precision, recall = overlap / sum(predicted.values()), overlap / sum(gold.values())
  return 2 * precision * recall / (precision + recall)


_FIRST_NAMES = ("Ada", "Bram", "Cleo", "Dov", "Esme", "Fenn", "Gala", "Hugo", "Ines", "Jory",
                "Kaia", "Lior", "Mira", "Nils", "Orla", "Pim", "Quin", "Rhea", "Soren", "Tova")
_LAST_NAMES = ("Ashdown", "Brindle", "Corrow", "Dunmere", "Elwick", "Farrow", "Gantry",
               "Holloway", "Ivers", "Jessop", "Kestrel", "Lowther")


def invented_names() -> list[str]:
  """240 invented full names, for the generated worlds of host environments."""
  return [f"{a} {b}" for a in _FIRST_NAMES for b in _LAST_NAMES]
