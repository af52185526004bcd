"""Tokenizer construction, safe padding and chat-template helpers."""

import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.byte_level_tokenizer()


def test_byte_level_round_trip(tok):
  text = "Hi 12+7=19 ünïcode\n\ttab"
  ids = tok.encode(text, add_special_tokens=False)
  assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no merges
  assert tok.decode(ids) == text
  assert len(tok) == 259


def test_chat_prompt_renders_chatml(tok):
  text = tokenizer_lib.chat_prompt(tok, "hello", system="be brief")
  assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                  "<|im_start|>assistant\n")
  ids = tokenizer_lib.encode_prompts(tok, ["hello"])[0]
  assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
  assert tok.convert_tokens_to_ids("<|im_end|>") in ids


def test_pad_token_is_never_a_chat_token(tok):
  assert tok.pad_token == "<|endoftext|>"
  tok2 = tokenizer_lib.byte_level_tokenizer()
  tok2.pad_token = "<|im_end|>"  # what SmolLM2's own files say
  assert tokenizer_lib.ensure_safe_pad_token(tok2).pad_token == "<|endoftext|>"


def test_pad_left(tok):
  tokens, mask = tokenizer_lib.pad_left([[5, 6, 7], [8]], pad_id=0, length=4)
  np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 8]])
  np.testing.assert_array_equal(mask, [[False, True, True, True], [False, False, False, True]])
  with pytest.raises(ValueError, match="does not fit in length 2"):
    tokenizer_lib.pad_left([[1, 2, 3]], pad_id=0, length=2)


def test_stop_tokens(tok):
  assert tokenizer_lib.stop_token_ids(tok) == (0, 2)
