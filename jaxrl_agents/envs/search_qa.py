"""Multi-hop questions over a generated fictional knowledge base, with a BM25 search tool.

Each knowledge base (one per seed) holds short documents about invented
companies, people and cities: a company's founder and product, a person's job
and birthplace, a city's river. A question needs two or three of them in turn
("In which city was the founder of Zorvex Labs born?"), so the agent must
search, read, and search again. Each turn it either searches or answers:

  <search>words</search>     the tool: the TOP_K best documents by BM25 (bm25s)
  <answer>text</answer>      the final answer; the episode ends

Reward 1 when the answer equals the gold one after normalization (case,
punctuation, articles and surrounding spaces ignored); info records the token
F1 as well. Counted per step in `info`: search, empty_search, invalid (neither
tag), success, answer_f1. The names are invented so that the model cannot know
them: an answer needs the documents.

Model output is hostile input: a query is cut to MAX_QUERY_CHARS characters
before tokenization, tags are found with `base.last_between` (linear), and the
index is only read.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.envs import base

TOP_K = 2
MAX_QUERY_CHARS = 200

_SYLLABLES = ("zor", "vex", "qua", "lin", "dra", "mor", "tel", "kai", "bru", "nex", "osh", "pel",
              "rin", "sab", "tov", "ul", "wex", "yar")
_JOBS = ("engineer", "chemist", "painter", "sailor", "baker", "architect", "pilot", "teacher")
_PRODUCTS = ("glass kettles", "wind clocks", "paper boats", "salt lamps", "copper bells",
             "wool maps", "clay drums", "silk kites", "stone pens", "tin lanterns")
_RIVERS = ("Lune", "Orrin", "Tavis", "Merrow", "Skell", "Quill")


def _word(rng: np.random.Generator, parts: int) -> str:
  return "".join(_SYLLABLES[i] for i in rng.choice(len(_SYLLABLES), parts, replace=False))


def generate_knowledge_base(seed: int) -> dict[str, list[dict]]:
  """Cities, people and companies of knowledge base `seed`, from the seed alone."""
  rng = np.random.default_rng(seed)
  city_names = sorted({_word(rng, 2).capitalize() + " " + ("Bay", "Ford", "Hill")[i % 3]
                       for i in range(12)})
  cities = [{"name": n, "river": _RIVERS[rng.integers(len(_RIVERS))]} for n in city_names]
  names = base.invented_names()
  people = [{"name": names[i], "job": _JOBS[rng.integers(len(_JOBS))],
             "city": city_names[rng.integers(len(city_names))]}
            for i in rng.choice(len(names), 24, replace=False)]
  company_names = sorted({_word(rng, 2).capitalize() + " " + ("Labs", "Works", "Guild")[i % 3]
                          for i in range(len(_PRODUCTS))})
  companies = [{"name": n, "product": _PRODUCTS[i], "founder": people[i]["name"],
                "year": int(rng.integers(1950, 2020))} for i, n in enumerate(company_names)]
  return {"cities": cities, "people": people, "companies": companies}


def documents(kb: dict[str, list[dict]]) -> list[str]:
  """One short document per entity."""
  return ([f"{c['name']} is a company founded by {c['founder']} in {c['year']}. "
           f"It makes {c['product']}." for c in kb["companies"]]
          + [f"{p['name']} is a {p['job']} who was born in {p['city']}." for p in kb["people"]]
          + [f"{c['name']} is a city on the {c['river']} river." for c in kb["cities"]])


def make_question(kb: dict[str, list[dict]], rng: np.random.Generator) -> tuple[str, str]:
  """(question, gold answer) needing two or three documents in turn."""
  company = kb["companies"][rng.integers(len(kb["companies"]))]
  founder = next(p for p in kb["people"] if p["name"] == company["founder"])
  river = next(c["river"] for c in kb["cities"] if c["name"] == founder["city"])
  templates = [
      (f"In which city was the founder of {company['name']} born?", founder["city"]),
      (f"What is the job of the person who founded {company['name']}?", founder["job"]),
      (f"Which river flows through the city where the founder of {company['name']} was born?",
       river),
      (f"Who founded the company that makes {company['product']}?", founder["name"]),
  ]
  return templates[rng.integers(len(templates))]


def normalize(text: str) -> str:
  """Lower case, no punctuation, no articles, single spaces."""
  text = re.sub(r"[^0-9a-z ]+", " ", text.lower())
  return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def answer_f1(predicted: str, gold: str) -> float:
  """Token F1 of two normalized answers."""
  return base.multiset_f1(collections.Counter(normalize(predicted).split()),
                          collections.Counter(normalize(gold).split()))


class Index:
  """A BM25 index of one knowledge base's documents (bm25s), read under a lock."""

  def __init__(self, docs: list[str]):
    # Imported here, not with the module: bm25s runs a JAX computation on import, which
    # would start JAX's backend before `jax.distributed` can be initialized.
    import bm25s

    self.docs = docs
    self.bm25 = bm25s.BM25()
    self.bm25.index(bm25s.tokenize(docs, stopwords="en", show_progress=False),
                    show_progress=False)
    self._lock = threading.Lock()

  def search(self, query: str, k: int = TOP_K) -> list[str]:
    """The best k documents with a positive score (best first)."""
    import bm25s

    tokens = bm25s.tokenize([query[:MAX_QUERY_CHARS]], stopwords="en", show_progress=False)
    if not tokens.vocab:  # nothing but stopwords or punctuation
      return []
    with self._lock:
      found, scores = self.bm25.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
    return [self.docs[int(i)] for i, s in zip(found[0], scores[0], strict=True) if s > 0]


class SearchEpisode:
  """One question over one knowledge base."""

  def __init__(self, index: Index, question: str, gold: str):
    self.index, self.question, self.gold = index, question, gold

  def reset(self) -> str:
    return (f"Question: {self.question}\nYou can search a library of documents: write "
            "<search>your words</search> and I will show the best matches. When you know the "
            "answer, reply <answer>the answer</answer>.")

  def step(self, reply: str) -> base.HostStep:
    info = dict(search=0.0, empty_search=0.0, invalid=0.0, success=0.0, answer_f1=0.0)
    answer = base.last_between(reply, "<answer>", "</answer>")
    if answer is not None:
      info["success"] = float(normalize(answer) == normalize(self.gold))
      info["answer_f1"] = answer_f1(answer, self.gold)
      return base.HostStep("", info["success"], True, info)
    query = base.last_between(reply, "<search>", "</search>")
    if query is None:
      info["invalid"] = 1.0
      return base.HostStep("Write <search>...</search> to search or <answer>...</answer> to "
                           "answer.", 0.0, False, info)
    info["search"] = 1.0
    found = self.index.search(query)
    if not found:
      info["empty_search"] = 1.0
      return base.HostStep("No document matches.", 0.0, False, info)
    return base.HostStep("\n".join(f"[{i + 1}] {d}" for i, d in enumerate(found)), 0.0, False,
                         info)


class SearchQA:
  """The environment: questions over `knowledge_bases` generated ones (a host environment)."""

  host = True

  def __init__(self, tokenizer=None, *, knowledge_bases: int = 8):
    del tokenizer  # observations are text; the loop tokenizes them
    if knowledge_bases < 1:
      raise ValueError(f"search_qa: knowledge_bases must be >= 1, got {knowledge_bases}")
    self.knowledge_bases = knowledge_bases
    self._kbs: dict[int, tuple[dict, Index]] = {}
    self._lock = threading.Lock()

  def knowledge_base(self, seed: int) -> tuple[dict, Index]:
    """(entities, index) of knowledge base `seed`, built on first use."""
    with self._lock:
      if seed not in self._kbs:
        kb = generate_knowledge_base(seed)
        self._kbs[seed] = (kb, Index(documents(kb)))
      return self._kbs[seed]

  def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
    seed = int(rng.integers(self.knowledge_bases))
    question, gold = make_question(self.knowledge_base(seed)[0], rng)
    return {"kb": seed, "question": question, "gold": gold}

  def answer(self, task: dict[str, Any]) -> str:
    """The gold answer as the agent should write it (IGPO's information gain scores it)."""
    return f"<answer>{task['gold']}</answer>"

  def episode(self, task: dict[str, Any]) -> SearchEpisode:
    _, index = self.knowledge_base(int(task["kb"]))
    return SearchEpisode(index, str(task["question"]), str(task["gold"]))


@registry.register("env", "search_qa")
def make(tokenizer, **options) -> SearchQA:
  """Multi-hop questions over a generated knowledge base with BM25 search (host)."""
  return SearchQA(tokenizer, **options)
