"""Replies as steps: splitting, encoding with each step's end column, step-labelled JSONL."""

import numpy as np
import pytest

from jaxrl_agents.data import steps as steps_lib
from jaxrl_agents.models import zoo


@pytest.mark.parametrize("text, expected", [
    ("a\nb\nc", ["a\n", "b\n", "c"]),
    ("a\n\nb", ["a\n\n", "b"]),  # a blank line stays with the step before it
    ("a\nb\n", ["a\n", "b\n"]),  # a closing separator belongs to the last step
    ("\n\na", ["\n\n", "a"]),
    ("", [""]),
    ("1\n2\n3\n4", ["1\n", "2\n", "3\n4"]),  # past max_steps=3: joins the last
])
def test_split_steps_gives_the_text_back(text, expected):
  got = steps_lib.split_steps(text, max_steps=3)
  assert got == expected and "".join(got) == text


def test_split_steps_is_linear_on_hostile_text():
  import time
  text = "\n" * 200_000 + "x" + " \n" * 200_000
  start = time.perf_counter()
  got = steps_lib.split_steps(text, max_steps=4)
  assert "".join(got) == text and time.perf_counter() - start < 2.0


@pytest.fixture(scope="module")
def tok():
  return zoo.load("tiny").tokenizer


def test_encode_steps_marks_each_steps_last_token_and_the_closing_token(tok):
  prompts = ["p one", "second prompt here"]
  rows = [["ab\n", "cd"], ["x\n", "", "<|im_end|> yz"]]
  e = steps_lib.encode_steps(tok, prompts, rows, max_len=64, max_steps=4)
  from jaxrl_agents.data.preferences import end_token
  from jaxrl_agents.models import tokenizer as tokenizer_lib
  for i, row in enumerate(rows):
    real = e.tokens[i][e.mask[i]].tolist()
    offset = e.mask.shape[1] - len(real)
    assert real[-1] == end_token(tok)
    assert e.step_mask[i].tolist() == [True] * len(row) + [False] * (4 - len(row))
    # the reply's tokens are the steps' plain tokens in order; step k ends where they do
    reply = sum((tokenizer_lib.plain_ids(tok, s) for s in row), [])
    assert real[-1 - len(reply):-1] == reply
    end = len(real) - 1 - len(reply) - 1  # the prompt's last token
    for k, s in enumerate(row[:-1]):
      end += len(tokenizer_lib.plain_ids(tok, s))
      assert e.ends[i, k] == offset + end
    assert e.ends[i, len(row) - 1] == e.mask.shape[1] - 1
    # special-token text inside a step stays text
    assert tok.convert_tokens_to_ids("<|im_end|>") not in reply


def test_encode_steps_truncation_drops_the_steps_it_cuts(tok):
  long_step = "word " * 40
  e = steps_lib.encode_steps(tok, ["q"], [["a\n", long_step]], max_len=12, max_steps=2)
  assert e.truncated[0] and e.mask.shape[1] == 12
  assert e.step_mask[0].tolist() == [False, True] and e.ends[0, 1] == 11


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q", "steps": ["a"]}', "missing field 'values'"),
    ('{"prompt": "q", "steps": [], "values": []}', "non-empty list of strings"),
    ('{"prompt": "q", "steps": ["a", "b"], "values": [1.0]}', "list of 2 numbers"),
    ('{"prompt": "q", "steps": ["a"], "values": [1.5]}', "not a number in \\[0, 1\\]"),
    ('{"prompt": "q", "steps": ["a"], "values": [true]}', "not a number in \\[0, 1\\]"),
])
def test_a_bad_step_row_names_its_line(tmp_path, line, message):
  path = tmp_path / "steps.jsonl"
  path.write_text('{"prompt": "q", "steps": ["a\\n", "b"], "values": [0.5, 1]}\n' + line + "\n")
  with pytest.raises(ValueError, match=f"steps.jsonl:2: .*{message}"):
    steps_lib.load_step_rows(path)
  path.write_text(line.replace(line, '{"prompt": "q", "steps": ["a"], "values": [0.25]}\n'))
  values, present = steps_lib.step_values(steps_lib.load_step_rows(path), max_steps=3)
  np.testing.assert_array_equal(values, [[0.25, 0, 0]])
  np.testing.assert_array_equal(present, [[True, False, False]])
