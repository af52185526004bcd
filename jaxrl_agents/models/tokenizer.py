"""Tokenizers (transformers' fast tokenizers) and chat-template helpers.

A tokenizer comes from a Hugging Face directory's tokenizer.json, from a GGUF
file's metadata (vocab, merges, special tokens, chat template), or, for tests,
from `byte_level_tokenizer` which needs no files at all.

Padding: SmolLM2 ships `<|im_end|>` as its pad token, and that token also ends
every chat turn. A pad id that occurs inside real sequences makes masks built
from it wrong, so tokenizers here always pad with a token the chat template
never writes (`<|endoftext|>` for SmolLM2), and the library builds masks from
lengths, never from the pad id.

Data is never markup: the text of a prompt, a tool output or an observation
may contain "<|im_end|>" or "<|im_start|>assistant", and encoded naively those
become real control tokens that forge chat turns. `encode_prompts` encodes the
chat template's own text with its control tokens and every message's content
with special-token text spelled out as ordinary characters (`plain_ids`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from jaxrl_agents.parallel import distributed

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>", "<unk>")


def _fast_tokenizer(backend, chat_template, bos, eos, unk, pad):
  from transformers import PreTrainedTokenizerFast
  tok = PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad)
  tok.chat_template = chat_template
  tok.padding_side = "left"
  return ensure_safe_pad_token(tok)


def ensure_safe_pad_token(tok):
  """Replaces a pad token that the chat template writes (or that equals EOS)."""
  template = tok.chat_template or ""
  pad = tok.pad_token
  if pad is not None and pad not in template and pad != tok.eos_token:
    return tok
  vocab = tok.get_vocab()
  for candidate in _PAD_CANDIDATES:
    if candidate in vocab and candidate not in template and candidate != tok.eos_token:
      tok.pad_token = candidate
      return tok
  raise ValueError(
      f"no safe pad token: {pad!r} occurs in the chat template or equals EOS, and none of "
      f"{_PAD_CANDIDATES} is in the vocabulary")


# Gemma's chat template: no system role (a system message opens the first user
# turn), the assistant is "model", every turn ends with <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _byte_tokenizer(specials: list[str], chat_template: str, **special_tokens):
  """Specials first (ids 0..), then the 256 bytes; no merges."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {tok: i for i, tok in enumerate(specials)}
  for ch in sorted(alphabet):
    vocab[ch] = len(vocab)
  backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens(specials)
  return _fast_tokenizer(backend, chat_template, **special_tokens)


def byte_level_tokenizer():
  """A tiny byte-level BPE tokenizer (259 tokens) with ChatML special tokens.

  Ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>; ids 3-258 are bytes.
  """
  return _byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML_TEMPLATE,
                         bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>",
                         pad="<|endoftext|>")


def gemma_byte_tokenizer():
  """A byte-level tokenizer (261 tokens) with Gemma's special tokens and chat template.

  Ids 0-4 are <pad>, <eos>, <bos>, <start_of_turn>, <end_of_turn> (Gemma's own
  order for the first three); ids 5-260 are bytes. A reply ends with
  <end_of_turn>, the EOS here as in Gemma's instruct generation config.
  """
  return _byte_tokenizer(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                         GEMMA_TEMPLATE, bos="<bos>", eos="<end_of_turn>", unk="<pad>",
                         pad="<pad>")


def tokenizer_from_gguf(path: str):
  """Builds a fast tokenizer from a GGUF file's `tokenizer.*` metadata (no torch needed)."""
  import gguf

  # An internal transformers module: the transformers range in setup.py is
  # pinned for it, and the parity tests compare the result with transformers'
  # own GGUF tokenizer.
  from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
  )

  reader = gguf.GGUFReader(path)
  meta = {k: f.contents() for k, f in reader.fields.items()
          if k.startswith("tokenizer.") or k == "general.architecture"}
  renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
  tok_dict = {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
              if f"tokenizer.{key}" in meta}
  backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)
  tokens = tok_dict["tokens"]

  def special(key):
    idx = meta.get(f"tokenizer.ggml.{key}")
    return tokens[idx] if idx is not None else None

  tok = _fast_tokenizer(
      backend, meta.get("tokenizer.chat_template"), bos=special("bos_token_id"),
      eos=special("eos_token_id"), unk=special("unknown_token_id"),
      pad=special("padding_token_id"))
  check_template_renders(tok, path)
  return tok


def load_tokenizer(path: str):
  """Loads tokenizer.json (+ tokenizer_config.json) from a directory."""
  from transformers import AutoTokenizer
  if not os.path.isfile(os.path.join(path, "tokenizer.json")):
    raise FileNotFoundError(f"no tokenizer.json in {path!r}")
  try:
    tok = AutoTokenizer.from_pretrained(path)
  except Exception as e:  # noqa: BLE001 - the library's errors do not name the file
    raise ValueError(f"{os.path.join(path, 'tokenizer.json')} (or tokenizer_config.json): "
                     f"cannot be loaded ({type(e).__name__}: {str(e)[:200]})") from None
  tok.padding_side = "left"
  check_template_renders(tok, path)
  return ensure_safe_pad_token(tok)


# A chat template is code (Jinja) from the model directory: one that does not render a
# short conversation within this many seconds is refused when the tokenizer loads.
TEMPLATE_TIME_LIMIT_S = 10.0

# Renders a template as transformers does (Jinja's immutable sandbox, loop controls), in a
# process of its own that can be killed; a template that raises is not this check's concern.
_RENDER_PROBE = """
import json, sys
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
template, messages = json.loads(sys.stdin.read())
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                    extensions=[loopcontrols])
try:
    env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                     bos_token="", eos_token="")
except Exception:
    pass
"""


_RENDERED_IN_TIME: set[str] = set()


def check_template_renders(tok, source: str, time_limit_s: float | None = None) -> None:
  """Renders a short conversation through `tok`'s chat template(s), if any, in a child
  process; raises ValueError naming `source` unless it is done within `time_limit_s`
  (default TEMPLATE_TIME_LIMIT_S; a template with nested loops over Jinja's largest
  range runs for hours). A template that raises (some refuse a role) is left to name
  its error where a prompt is rendered."""
  limit = TEMPLATE_TIME_LIMIT_S if time_limit_s is None else time_limit_s
  templates = tok.chat_template
  if not templates:
    return
  messages = [{"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 4?"}]
  for template in templates.values() if isinstance(templates, dict) else [templates]:
    if template in _RENDERED_IN_TIME:  # a model loaded again: probed once a process
      continue
    try:
      subprocess.run([sys.executable, "-I", "-c", _RENDER_PROBE], check=False,
                     input=json.dumps([template, messages]), text=True, timeout=limit,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
      raise ValueError(f"{source}: the chat template did not render a three-message "
                       f"conversation within {limit:g} s; refused (fix its "
                       "chat_template.jinja or tokenizer_config.json's chat_template)") from None
    _RENDERED_IN_TIME.add(template)


def stop_token_ids(tok) -> tuple[int, ...]:
  """Token ids that end a completion: EOS, plus <|endoftext|> or <eos> (Gemma's end of text,
  its instruct models' EOS being <end_of_turn>) when the vocabulary has them."""
  ids = {tok.eos_token_id}
  vocab = tok.get_vocab()
  ids.update(vocab[name] for name in ("<|endoftext|>", "<eos>") if name in vocab)
  return tuple(sorted(i for i in ids if i is not None))


def chat_prompt(tok, prompt: str | list[dict], system: str | None = None) -> str:
  """Renders a user prompt (or a message list) through the chat template,
  ending with the assistant's generation prompt."""
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  else:
    messages = list(prompt)
  if system is not None:
    messages = [{"role": "system", "content": system}] + messages
  if not tok.chat_template:
    raise ValueError("this tokenizer has no chat template; pass chat=False")
  return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def plain_ids(tok, text: str) -> list[int]:
  """Token ids of `text` in which special-token text is ordinary characters, never control."""
  return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_chat(tok, prompt: str | list[dict], system: str | None = None
                ) -> tuple[list[int], list[tuple[int, int]]]:
  """(token ids, [start, end) token span of each message's content) of a chat prompt.

  The template is rendered with a unique placeholder per message; its text is
  encoded with control tokens, each content with `plain_ids`. For content that
  starts with a non-space character this gives the same ids as encoding the
  rendered string whole (the pieces meet where the template writes a newline);
  content that starts with spaces may split differently at that boundary (the
  same text, a different but valid tokenization).
  """
  messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
  if system is not None:
    messages = [{"role": "system", "content": system}] + messages
  nonce = secrets.token_hex(8)
  marked = [{**m, "content": f"[[content-{nonce}-{i}]]"} for i, m in enumerate(messages)]
  pieces = re.split(rf"\[\[content-{nonce}-(\d+)\]\]", chat_prompt(tok, marked))
  placed = [int(i) for i in pieces[1::2]]
  if sorted(placed) != list(range(len(messages))):
    raise ValueError("the chat template does not write each message's content exactly once "
                     "and unchanged; cannot keep content apart from control tokens")
  ids, spans = [], []
  for j, piece in enumerate(pieces):
    if j % 2 == 0:
      ids += tok.encode(piece, add_special_tokens=False) if piece else []
    else:
      content = plain_ids(tok, str(messages[int(piece)]["content"]))
      spans.append((len(ids), len(ids) + len(content)))
      ids += content
  return ids, spans


def encode_prompts(tok, prompts: Sequence[str], chat: bool = True,
                   system: str | None = None) -> list[list[int]]:
  """Token ids per prompt, through the chat template unless chat=False; data stays plain text."""
  if not chat:
    return [plain_ids(tok, p) for p in prompts]
  return [encode_chat(tok, p, system)[0] for p in prompts]


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to int32[B, length] with a bool[B, length] mask."""
  longest = max((len(s) for s in seqs), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"a sequence of {longest} tokens does not fit in length {length}")
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    if len(s):
      tokens[i, length - len(s):] = s
      mask[i, length - len(s):] = True
  return tokens, mask


def decode_completions(tok, tokens, lengths, stop_tokens: Sequence[int],
                       skip_special_tokens: bool = True) -> list[str]:
  """Texts of completions int[B, N] with `lengths` tokens each, without their stop token
  (and, unless told otherwise, without other special tokens)."""
  texts = []
  for row, n in zip(distributed.to_host(tokens), distributed.to_host(lengths), strict=True):
    ids = [t for t in row[:n].tolist() if t not in stop_tokens]
    texts.append(tok.decode(ids, skip_special_tokens=skip_special_tokens))
  return texts
