"""Search QA: the documents answer every question by following them, scoring by hand, and
hostile queries and tags."""

import time

import numpy as np
import pytest

from jaxrl_agents import envs
from jaxrl_agents.envs import search_qa


def _between(text, before, after):
  return text.split(before, 1)[1].split(after, 1)[0]


def _solve(ep, task):
  """An agent that follows the documents: company -> founder -> city -> river."""
  q = task["question"]
  if q.startswith("Who founded"):
    found = ep.step(f"<search>makes {_between(q, 'makes ', '?')}</search>")
    return _between(found.obs.splitlines()[0], "founded by ", " in ")
  company = _between(q, "founder of ", " was born") if "was born" in q else \
      _between(q, "founder of ", " born") if "founder of" in q else _between(q, "founded ", "?")
  doc = ep.step(f"<search>{company}</search>").obs.splitlines()[0]
  assert company in doc, (company, doc)
  founder = _between(doc, "founded by ", " in ")
  doc = ep.step(f"<search>{founder} born</search>").obs.splitlines()[0]
  assert founder in doc, (founder, doc)
  if "job" in q:
    return _between(doc, "is a ", " who")
  city = _between(doc, "born in ", ".")
  if "river" not in q:
    return city
  doc = ep.step(f"<search>{city} city river</search>").obs.splitlines()[0]
  return _between(doc, "on the ", " river")


def test_every_question_is_answered_by_following_the_documents():
  env = envs.make("search_qa", None, knowledge_bases=3)
  rng = np.random.default_rng(1)
  tasks = [env.sample_task(rng) for _ in range(40)]
  assert len({t["question"].split(" ")[0] for t in tasks}) >= 3  # the templates vary
  for task in tasks:
    ep = env.episode(task)
    answer = _solve(ep, task)
    done = ep.step(f"So: <answer>The {answer}.</answer>")
    assert done.done and done.reward == 1.0 and done.info["answer_f1"] == 1.0, (task, answer)
  wrong = env.episode(tasks[0]).step("<answer>Nobody</answer>")
  assert wrong.done and wrong.reward == 0.0


def test_scoring_by_hand():
  assert search_qa.normalize("  The  Cobalt-Bay! ") == "cobalt bay"
  np.testing.assert_allclose(search_qa.answer_f1("Cobalt Bay", "Cobalt Hill"), 0.5)
  np.testing.assert_allclose(search_qa.answer_f1("Ada Brindle of Avalon", "Ada Brindle"),
                             2 * (2 / 4) * 1 / (2 / 4 + 1))
  assert search_qa.answer_f1("", "x") == 0.0


def test_knowledge_bases_are_generated_from_their_seed_alone():
  a, b = search_qa.generate_knowledge_base(5), search_qa.generate_knowledge_base(5)
  assert a == b and a != search_qa.generate_knowledge_base(6)
  docs = search_qa.documents(a)
  assert len(docs) == len(a["companies"]) + len(a["people"]) + len(a["cities"])


@pytest.mark.parametrize("reply", [
    "<search>" + "founder " * 5000 + "</search>", "<search>the a an of</search>",
    "<search>" + "<search>" * 5000 + "</search>", "<search><|im_end|></search>",
    "<answer>" * 10000, "</search>" * 10000, "<search></search>", "no tags at all"])
def test_hostile_replies_get_an_answer_in_bounded_time(reply):
  env = envs.make("search_qa", None, knowledge_bases=1)
  ep = env.episode(env.sample_task(np.random.default_rng(0)))
  start = time.monotonic()
  out = ep.step(reply)
  assert time.monotonic() - start < 1.0
  assert not out.done and isinstance(out.obs, str) and out.reward == 0.0
  assert sum(out.info[k] for k in ("search", "invalid")) == 1.0


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="knowledge_bases"):
    envs.make("search_qa", None, knowledge_bases=0)
