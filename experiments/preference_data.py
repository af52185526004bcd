"""Preference pairs for the preference trainers (reward model, DPO): from JSONL, or generated.

Generated pairs come from a task with a verifier: the model samples
`generation.group_size` replies per question at `generation.temperature`, and
a reply the grader (`config.grader`, a registered reward with
`config.grader_kwargs`; 1 accepts) accepts is preferred to one it rejects.
With `generation.answer_swaps` > 0, up to that many pairs per question also
prefer an accepted reply to the same reply with a wrong answer swapped in
(`preferences.answer_swap_pairs`; they carry "source": "answer_swap"), so the
answer, not only the form, separates chosen from rejected.
With `generation.stated_answers` > 0 (tasks in `STATED_ANSWER_FORMS`), each of
the first `generation.stated_prompts` train questions (0: all) and each
held-out question also gives that many pairs with no sampling at all: the
right answer stated in the task's reply form against a plausible wrong one
(`preferences.stated_answer_pairs`; "source": "stated_answer").
`generation.train_prompts` may then be 0: no sampled training pairs.
With `generation.trailing_text` (a share in [0, 1]), that share of the stated
pairs each also gives a pair with a rejected reply's text after the answer
(`preferences.trailing_text_pairs`; "source": "trailing_text"), so text after
the answer neither rescues a wrong one nor earns reward; it needs sampled
replies (train_prompts >= 1) for its tails.
`generate_pairs` writes to `pairs_dir` (default <workdir>/pairs), once: a
directory that holds pairs made with other settings is refused, never
overwritten (a run may be training on them):

  train.jsonl        pairs from the first `generation.train_prompts` train questions
  eval.jsonl         pairs from the first `generation.eval_prompts` held-out questions
  candidates.jsonl   each held-out question's replies and verdicts, and its greedy
                     reply: the best-of-N candidates
  generation.json    the settings they were made with, written last (marks them
                     complete)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable

import jax
import numpy as np

from jaxrl_agents import data as data_lib
from jaxrl_agents import registry
from jaxrl_agents.data import arithmetic, preferences
from jaxrl_agents.data.jsonl import read_objects
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.parallel import distributed
from jaxrl_agents.rewards import answers
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import single_turn

log = logging.getLogger(__name__)

# The answer each grader reads, for the reward-weighted vote.
ANSWER_READERS = {"math_strict": answers.strict_answer, "math_lenient": answers.lenient_answer,
                  "last_integer": answers.last_integer}


def validate(config) -> None:
  """Checks the pair-data keys (`experiments/configs/trainer_common.py`) and the batch."""
  if config.minibatches < 1:
    raise ValueError(f"minibatches must be >= 1, got {config.minibatches}")
  if config.pairs_per_step < 1 or config.pairs_per_step % config.minibatches:
    raise ValueError(f"pairs_per_step ({config.pairs_per_step}) must be a positive multiple of "
                     f"minibatches ({config.minibatches})")
  if config.eval_pairs_jsonl and not config.pairs_jsonl:
    raise ValueError("eval_pairs_jsonl is set but pairs_jsonl is not: generated pairs bring "
                     "their own held-out pairs")
  if config.score_batch_size < 1:
    raise ValueError(f"score_batch_size must be >= 1, got {config.score_batch_size}")
  if config.pairs_jsonl:
    return
  grader(config)  # names a mistyped grader
  g = config.generation
  if g.group_size < 2:
    raise ValueError(f"generation.group_size must be >= 2 (a pair needs two replies), got "
                     f"{g.group_size}")
  stated = g.get("stated_answers", 0)
  for key in ("train_prompts", "eval_prompts", "max_pairs_per_prompt", "batch_prompts",
              "max_new_tokens"):
    least = 0 if key == "train_prompts" and stated else 1  # stated pairs alone may train
    if g[key] < least:
      raise ValueError(f"generation.{key} must be >= {least}, got {g[key]}")
  for key in ("answer_swaps", "stated_answers", "stated_prompts"):
    if g.get(key, 0) < 0:
      raise ValueError(f"generation.{key} must be >= 0, got {g[key]}")
  trailing = g.get("trailing_text", 0.0)
  if not 0.0 <= trailing <= 1.0:
    raise ValueError(f"generation.trailing_text must be a share in [0, 1], got {trailing}")
  if trailing and not (stated and g.train_prompts):
    raise ValueError("generation.trailing_text follows stated answers with sampled text: it "
                     f"needs stated_answers >= 1 (got {stated}) and train_prompts >= 1 (got "
                     f"{g.train_prompts})")
  family = config.task.split("/")[0]
  if stated and family not in STATED_ANSWER_FORMS:
    raise ValueError(f"generation.stated_answers needs a task whose answers can be stated "
                     f"({sorted(STATED_ANSWER_FORMS)}), got {config.task!r}")


# Tasks whose right and wrong answers can be stated without sampling
# (generation.stated_answers): task family -> (statement(example, answer), mistake(example,
# rng)).
STATED_ANSWER_FORMS = {"arithmetic": (arithmetic.statement, arithmetic.mistake)}


def grader(config):
  """The registered reward `config.grader` with `config.grader_kwargs` bound: 1 accepts a reply."""
  return functools.partial(registry.get("reward", config.grader), **config.grader_kwargs)


def _generation_settings(config) -> dict:
  return {"model": config.model, "dtype": config.dtype, "task": config.task,
          "eval_split": config.eval_split, "prompt_template": config.prompt_template,
          "system_prompt": config.system_prompt, "chat": config.chat, "grader": config.grader,
          "grader_kwargs": config.grader_kwargs.to_dict(),
          "seed": config.seed, **config.generation.to_dict()}


def sample_replies(model: zoo.Model, examples, *, config, temperature: float, group_size: int,
                   seed: int, desc: str, progress: bool = True, params=None,
                   template: str | None = None) -> tuple[list[str], list[str], np.ndarray]:
  """(formatted prompts per row, replies per row, the grader's verdicts f32[rows]): each
  example's `group_size` replies (generation.max_new_tokens at most), in batches of
  generation.batch_prompts questions, from `params` (default: the model's own)."""
  from tqdm import tqdm

  g = config.generation
  tok = model.tokenizer
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=g.max_new_tokens, temperature=temperature,
      stop_tokens=tokenizer_lib.stop_token_ids(tok), pad_id=tok.pad_token_id)
  grade = grader(config)
  prompts, replies, verdicts = [], [], []
  for start, n, padded in tqdm(data_lib.padded_batches(examples, g.batch_prompts), desc=desc,
                               unit="batch", total=data_lib.num_batches(examples, g.batch_prompts),
                               disable=not progress):
    s = single_turn.sample(model.params if params is None else params, model, padded,
                           jax.random.key(seed + start), group_size=group_size, sampling=sampling,
                           template=template or config.prompt_template, chat=config.chat,
                           system=config.system_prompt or None)
    rows = n * group_size
    prompts += s.prompts[:rows]
    replies += s.completions[:rows]
    verdicts += list(np.asarray(grade(s.completions[:rows], s.examples[:rows]), np.float32))
  return prompts, replies, np.asarray(verdicts, np.float32)


def generate_pairs(config, model: zoo.Model, directory: str, progress: bool = True) -> None:
  """Samples and grades replies, writing train.jsonl, eval.jsonl, candidates.jsonl and
  generation.json (the settings) to `directory`."""
  from jaxrl_agents import data as data_lib

  g = config.generation
  os.makedirs(directory, exist_ok=True)
  train_source = data_lib.load_task(config.task, "train")
  held_source = data_lib.load_task(config.task, config.eval_split)
  train = [train_source[i] for i in range(min(g.train_prompts, len(train_source)))]
  held = [held_source[i] for i in range(min(g.eval_prompts, len(held_source)))]
  n = g.group_size
  train_pairs, replies, ok = [], [], []  # replies, ok: the tails of trailing-text pairs
  if train:
    prompts, replies, ok = sample_replies(model, train, config=config,
                                          temperature=g.temperature, group_size=n,
                                          seed=config.seed, desc="train replies",
                                          progress=progress)
    train_pairs += preferences.pairs_from_groups(
        prompts, replies, ok, n, max_pairs_per_prompt=g.max_pairs_per_prompt, seed=config.seed,
        extra=[{"answer": str(ex["answer"])} for ex in train])
    train_pairs += _answer_swaps(config, prompts, replies, ok, train, seed=config.seed)
  if g.get("stated_answers", 0):
    count = min(g.get("stated_prompts", 0) or len(train_source), len(train_source))
    stated = _stated_answers(config, [train_source[i] for i in range(count)],
                             seed=config.seed)
    train_pairs += stated + _trailing_text(stated, replies, ok, g, seed=config.seed)
  h_prompts, h_replies, h_ok = sample_replies(
      model, held, config=config, temperature=g.temperature, group_size=n,
      seed=config.seed + 10**6, desc="held-out replies", progress=progress)
  eval_pairs = preferences.pairs_from_groups(
      h_prompts, h_replies, h_ok, n, max_pairs_per_prompt=g.max_pairs_per_prompt,
      seed=config.seed + 1, extra=[{"answer": str(ex["answer"])} for ex in held])
  eval_pairs += _answer_swaps(config, h_prompts, h_replies, h_ok, held, seed=config.seed + 1)
  stated = _stated_answers(config, held, seed=config.seed + 1)
  eval_pairs += stated + _trailing_text(stated, h_replies, h_ok, g, seed=config.seed + 1)
  _, greedy, greedy_ok = sample_replies(model, held, config=config, temperature=0.0,
                                        group_size=1, seed=0, desc="greedy replies",
                                        progress=progress)
  if not train_pairs or not eval_pairs:
    raise ValueError(
        f"no {'training' if not train_pairs else 'held-out'} pairs: no question of "
        f"{config.task} got both a reply the grader {config.grader!r} accepts and one it "
        f"rejects in {n} samples at temperature {g.temperature}; raise group_size or the "
        "temperature, or bring pairs as JSONL (pairs_jsonl)")
  candidates = [{"prompt": h_prompts[i * n], "answer": str(ex["answer"]),
                 "replies": h_replies[i * n:(i + 1) * n],
                 "correct": h_ok[i * n:(i + 1) * n].tolist(),
                 "greedy": greedy[i], "greedy_correct": float(greedy_ok[i])}
                for i, ex in enumerate(held)]
  preferences.write_pairs(os.path.join(directory, "train.jsonl"), train_pairs)
  preferences.write_pairs(os.path.join(directory, "eval.jsonl"), eval_pairs)
  preferences.write_pairs(os.path.join(directory, "candidates.jsonl"), candidates)
  with open(os.path.join(directory, "generation.json"), "w") as f:  # last: marks it complete
    json.dump(_generation_settings(config), f, indent=2)
  log.info("generated %d training and %d held-out pairs in %s (reply accuracy %s train, "
           "%.3f held out; greedy %.3f)", len(train_pairs), len(eval_pairs), directory,
           f"{ok.mean():.3f}" if train else "-", h_ok.mean(), greedy_ok.mean())


def _answer_swaps(config, prompts, replies, ok, examples, *, seed: int) -> list[dict]:
  if not config.generation.get("answer_swaps", 0):
    return []
  return preferences.answer_swap_pairs(
      prompts, replies, ok, examples, config.generation.group_size,
      per_prompt=config.generation.answer_swaps, seed=seed,
      read_answer=ANSWER_READERS.get(config.grader, answers.lenient_answer),
      grade=grader(config))


def _stated_answers(config, examples, *, seed: int) -> list[dict]:
  g = config.generation
  if not g.get("stated_answers", 0) or not examples:
    return []
  state, mistake = STATED_ANSWER_FORMS[config.task.split("/")[0]]
  return preferences.stated_answer_pairs(
      single_turn.format_prompts(examples, config.prompt_template), examples,
      per_prompt=g.stated_answers, seed=seed, state=state, mistake=mistake)


def _trailing_text(stated, replies, ok, g, *, seed: int) -> list[dict]:
  """Trailing-text pairs from stated ones; the tails are the replies the grader rejected
  (mostly the model's rambles: the text a policy would learn to append)."""
  if not g.get("trailing_text", 0.0) or not stated:
    return []
  tails = [r for r, v in zip(replies, ok, strict=True) if v <= 0.5]
  if not tails:
    raise ValueError("generation.trailing_text: the grader rejected no sampled reply, so "
                     "there is no text to append; raise train_prompts")
  return preferences.trailing_text_pairs(stated, tails, share=g.trailing_text, seed=seed)


# Settings added after data was generated, and the value that data was made with.
GENERATION_DEFAULTS = {"answer_swaps": 0, "stated_answers": 0, "stated_prompts": 0,
                       "trailing_text": 0.0}


def generate_once(directory: str, settings: dict, generate: Callable[[str], None]) -> None:
  """Runs `generate(directory)` (which writes the directory, generation.json last) unless
  the directory is complete; data made with other `settings` is refused, never replaced (a
  run, or its resume, may be training on it).

  With several processes (`distributed`) every process generates, since sampling on a
  mesh runs on all of them, but only the first writes `directory`: the others write to a
  scratch directory, discarded, and wait for the first to finish."""
  settings_file = os.path.join(directory, "generation.json")
  current = json.loads(json.dumps({**GENERATION_DEFAULTS, **settings}))
  if not os.path.exists(settings_file):
    if distributed.is_main():
      generate(directory)
    else:
      with tempfile.TemporaryDirectory(prefix="generate_once_") as scratch:
        generate(scratch)
    distributed.barrier(f"generated {directory}")
    return
  with open(settings_file) as f:
    saved = {**GENERATION_DEFAULTS, **json.load(f)}
  changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
  if changed:
    details = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed[:6])
    raise ValueError(f"{directory} holds data generated with other settings ({details}); "
                     "use a new workdir or pairs_dir")


def load_data(config, model: zoo.Model, workdir: str, progress: bool = True
              ) -> tuple[list[dict], list[dict], list[dict] | None]:
  """(training pairs, held-out pairs, best-of-N candidates or None); at least
  `pairs_per_step` training pairs."""
  train, held, candidates = _load_data(config, model, workdir, progress)
  if len(train) < config.pairs_per_step:
    raise ValueError(f"{len(train)} training pairs, fewer than pairs_per_step "
                     f"({config.pairs_per_step})")
  return train, held, candidates


def _load_data(config, model: zoo.Model, workdir: str, progress: bool):
  if config.pairs_jsonl:
    train = preferences.load_pairs(config.pairs_jsonl)
    if config.eval_pairs_jsonl:
      held = preferences.load_pairs(config.eval_pairs_jsonl)
    else:
      log.warning("no eval_pairs_jsonl: evaluating on the first %d training pairs (not held "
                  "out)", config.eval_size)
      held = train
    return train, held[: config.eval_size], None
  directory = config.pairs_dir or os.path.join(workdir, "pairs")
  generate_once(directory, _generation_settings(config),
                lambda out: generate_pairs(config, model, out, progress))
  train = preferences.load_pairs(os.path.join(directory, "train.jsonl"))
  held = preferences.load_pairs(os.path.join(directory, "eval.jsonl"))
  candidates = [row for _, row in read_objects(os.path.join(directory, "candidates.jsonl"))]
  # At most eval_size of each kind (the answer swaps come after the sampled pairs).
  by_kind: dict[str, list[dict]] = {}
  for pair in held:
    by_kind.setdefault(pair.get("source", "sampled"), []).append(pair)
  return train, [p for rows in by_kind.values() for p in rows[: config.eval_size]], candidates


def greedy_accuracy(params, model: zoo.Model, candidates, config, progress: bool = False
                    ) -> float:
  """The grader's accuracy on the greedy replies of `params` to the held-out questions."""
  examples = [{"prompt": c["prompt"], "answer": c["answer"]} for c in candidates]
  _, _, ok = sample_replies(model, examples, config=config, temperature=0.0, group_size=1,
                            seed=0, desc="greedy replies", progress=progress, params=params,
                            template="{prompt}")
  return float(ok.mean())
