"""Step-labelled replies for process reward models: from JSONL, or labelled by Monte Carlo.

Generated rows come from a task with a verifier. The model samples
`generation.group_size` replies per question; each reply is split into steps
(`data.steps.split_steps` at `step_separator`, at most `max_steps`), and step k
is labelled with the fraction of `generation.continuations` replies, sampled
from the prompt and the reply's steps 0..k, that the grader accepts (Math-
Shepherd's soft label; `process_rewards.mc_step_values`). The last step's label
is the reply's own verdict: nothing follows it.

`generate_steps` writes to `steps_dir` (default <workdir>/steps), once
(`preference_data.generate_once`):

  train.jsonl        {"prompt", "steps", "values", "answer", "correct"} per reply
  eval.jsonl         the same for the held-out questions
  candidates.jsonl   each held-out question's replies, verdicts and greedy reply (best-of-N)
  generation.json    the settings, written last
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import preference_data
from jaxrl_agents import data as data_lib
from jaxrl_agents.data import preferences
from jaxrl_agents.data import steps as steps_lib
from jaxrl_agents.data.jsonl import read_objects
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rewards import process_rewards
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.rollout import single_turn

log = logging.getLogger(__name__)

# continue_fn(prompts, prefixes) -> for each, its continuation texts (M of them).
ContinueFn = Callable[[Sequence[str], Sequence[str]], list[list[str]]]


def label_steps(prompts: Sequence[str], replies: Sequence[str], verdicts: Sequence[float],
                examples: Sequence[Mapping[str, Any]], *, continue_fn: ContinueFn,
                grade: Callable[..., Sequence[float]], separator: str, max_steps: int
                ) -> list[dict[str, Any]]:
  """Rows {"prompt", "steps", "values", "answer", "correct"}, one per reply.

  Args:
    prompts, replies, verdicts, examples: per reply (the prompt as the model saw
      it, the reply, the grader's verdict, the task example).
    continue_fn: samples the continuations of each (prompt, reply prefix).
    grade: the grader, `grade(texts, examples)` -> verdicts (1 accepts).
    separator, max_steps: how replies split into steps.
  """
  split = [steps_lib.split_steps(r, separator, max_steps) for r in replies]
  # Every step but the last needs continuations; one flat batch for all of them.
  owners = [(i, k) for i, s in enumerate(split) for k in range(len(s) - 1)]
  prefixes = ["".join(split[i][:k + 1]) for i, k in owners]
  continued = continue_fn([prompts[i] for i, _ in owners], prefixes) if owners else []
  if len(continued) != len(owners):
    raise ValueError(f"continue_fn gave {len(continued)} continuation lists for "
                     f"{len(owners)} prefixes")
  m = len(continued[0]) if continued else 1
  texts = [p + c for p, cs in zip(prefixes, continued, strict=True) for c in cs]
  ok = np.asarray(grade(texts, [examples[i] for i, _ in owners for _ in range(m)]),
                  np.float32).reshape(len(owners), m) if owners else np.zeros((0, m))
  k_max = max(len(s) for s in split)
  successes = np.zeros((len(split), k_max, m), bool)
  step_mask = np.zeros((len(split), k_max), bool)
  for (i, k), row in zip(owners, ok, strict=True):
    successes[i, k] = row > 0.5
  for i, s in enumerate(split):
    step_mask[i, :len(s)] = True
    successes[i, len(s) - 1] = verdicts[i] > 0.5  # the whole reply: its own verdict
  values = np.asarray(process_rewards.mc_step_values(jnp.asarray(successes),
                                                     jnp.asarray(step_mask)))
  return [{"prompt": prompts[i], "steps": s, "values": values[i, :len(s)].tolist(),
           "answer": str(examples[i]["answer"]), "correct": float(verdicts[i])}
          for i, s in enumerate(split)]


def sampler_continuations(model: zoo.Model, config, *, seed: int, desc: str,
                          progress: bool = True) -> ContinueFn:
  """A `continue_fn` sampling `generation.continuations` replies per prefix from the model
  (the prefix after the chat prompt, as plain text), `generation.batch_prompts` prefixes
  per call. Batch keys are fold_in(key(seed), start): a stream apart from the replies'
  key(seed + start). Each step is tokenized apart from the next when the reward model
  reads it (`steps.encode_steps`), but the prefix here as one text: the policy continues
  the tokens it would have produced itself."""
  from tqdm import tqdm

  g, tok = config.generation, model.tokenizer
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=g.max_new_tokens, temperature=g.temperature,
      stop_tokens=tokenizer_lib.stop_token_ids(tok), pad_id=tok.pad_token_id)
  limit = single_turn.context_limit(model, g.max_new_tokens)

  def continue_fn(prompts, prefixes):
    out = []
    pairs = list(zip(prompts, prefixes, strict=True))
    for start, n, batch in tqdm(data_lib.padded_batches(pairs, g.batch_prompts), desc=desc,
                                unit="batch", total=data_lib.num_batches(pairs, g.batch_prompts),
                                disable=not progress):
      rows = []
      for p, x in batch:  # one compiled batch size: the last batch padded
        ids = (tokenizer_lib.encode_chat(tok, p, config.system_prompt or None)[0]
               if config.chat else tokenizer_lib.plain_ids(tok, p))
        rows.append((ids + tokenizer_lib.plain_ids(tok, x))[-limit:])
      width = preferences.bucket_width(max(len(r) for r in rows))
      tokens, mask = tokenizer_lib.pad_left(rows, tok.pad_token_id, width)
      s = sampler_lib.generate(model.params, model.cfg, jnp.asarray(tokens), jnp.asarray(mask),
                               jax.random.fold_in(jax.random.key(seed), start), sampling,
                               samples_per_prompt=g.continuations)
      texts = tokenizer_lib.decode_completions(tok, np.asarray(s.tokens), np.asarray(s.lengths),
                                               sampling.stop_tokens)
      out += [texts[i * g.continuations:(i + 1) * g.continuations] for i in range(n)]
    return out

  return continue_fn


def _settings(config) -> dict:
  return {"model": config.model, "dtype": config.dtype, "task": config.task,
          "eval_split": config.eval_split, "prompt_template": config.prompt_template,
          "system_prompt": config.system_prompt, "chat": config.chat, "grader": config.grader,
          "grader_kwargs": config.grader_kwargs.to_dict(), "seed": config.seed,
          "step_separator": config.step_separator, "max_steps": config.max_steps,
          **config.generation.to_dict()}


def generate_steps(config, model: zoo.Model, directory: str, progress: bool = True) -> None:
  """Samples, splits and labels replies; writes train.jsonl, eval.jsonl, candidates.jsonl
  and generation.json (the settings, last) to `directory`."""
  from jaxrl_agents import data as data_lib

  g = config.generation
  os.makedirs(directory, exist_ok=True)
  grade = preference_data.grader(config)
  n = g.group_size
  files = {}
  for name, split, count, seed in (("train", "train", g.train_prompts, config.seed),
                                   ("eval", config.eval_split, g.eval_prompts,
                                    config.seed + 10**6)):
    source = data_lib.load_task(config.task, split)
    examples = [source[i] for i in range(min(count, len(source)))]
    prompts, replies, ok = preference_data.sample_replies(
        model, examples, config=config, temperature=g.temperature, group_size=n, seed=seed,
        desc=f"{name} replies", progress=progress)
    rows = label_steps(prompts, replies, ok, [ex for ex in examples for _ in range(n)],
                       continue_fn=sampler_continuations(model, config, seed=seed,
                                                         desc=f"{name} continuations",
                                                         progress=progress),
                       grade=grade, separator=config.step_separator, max_steps=config.max_steps)
    files[name] = rows
    if name == "eval":
      _, greedy, greedy_ok = preference_data.sample_replies(
          model, examples, config=config, temperature=0.0, group_size=1, seed=0,
          desc="greedy replies", progress=progress)
      files["candidates"] = [
          {"prompt": prompts[i * n], "answer": str(ex["answer"]),
           "replies": replies[i * n:(i + 1) * n], "correct": ok[i * n:(i + 1) * n].tolist(),
           "greedy": greedy[i], "greedy_correct": float(greedy_ok[i])}
          for i, ex in enumerate(examples)]
  for name, rows in files.items():
    preferences.write_pairs(os.path.join(directory, f"{name}.jsonl"), rows)
  with open(os.path.join(directory, "generation.json"), "w") as f:  # last: marks it complete
    json.dump(_settings(config), f, indent=2)
  steps = [len(r["steps"]) for r in files["train"]]
  log.info("labelled %d training replies (%.2f steps each) and %d held-out replies in %s",
           len(steps), np.mean(steps), len(files["eval"]), directory)


def load_data(config, model: zoo.Model, workdir: str, progress: bool = True
              ) -> tuple[list[dict], list[dict], list[dict] | None]:
  """(training rows, held-out rows, best-of-N candidates or None)."""
  if config.steps_jsonl:
    train = steps_lib.load_step_rows(config.steps_jsonl)
    held = steps_lib.load_step_rows(config.eval_steps_jsonl) if config.eval_steps_jsonl \
        else train
    if not config.eval_steps_jsonl:
      log.warning("no eval_steps_jsonl: evaluating on the first %d training rows (not held "
                  "out)", config.eval_size)
    candidates = None
  else:
    directory = config.steps_dir or os.path.join(workdir, "steps")
    preference_data.generate_once(directory, _settings(config),
                                  lambda out: generate_steps(config, model, out, progress))
    train = steps_lib.load_step_rows(os.path.join(directory, "train.jsonl"))
    held = steps_lib.load_step_rows(os.path.join(directory, "eval.jsonl"))
    candidates = [row for _, row in read_objects(os.path.join(directory, "candidates.jsonl"))]
  too_long = [i for i, r in enumerate(train + held) if len(r["steps"]) > config.max_steps]
  if too_long:
    raise ValueError(f"{len(too_long)} rows have more than max_steps ({config.max_steps}) "
                     "steps; raise max_steps")
  if len(train) < config.rows_per_step:
    raise ValueError(f"{len(train)} training rows, fewer than rows_per_step "
                     f"({config.rows_per_step})")
  return train, held[: config.eval_size], candidates
