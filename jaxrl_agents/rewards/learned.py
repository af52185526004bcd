"""A trained reward model as a reward: `{"reward_model": {"workdir": RUN}}` in config.rewards.

    from_config({"reward_model": {"weight": 1.0, "workdir": "runs/rm_arithmetic"}})

RUN is a workdir of `experiments/reward_model.py` (an outcome reward model) or
of `experiments/process_reward_model.py` (a process reward model: its step
scores' sigmoids are aggregated per reply, option `aggregate`: "min", "last"
or "clip"; `process_rewards.aggregate`). Its checkpoint `step` (0:
the newest; pin it for a run that must resume exactly while RUN trains on)
gives the parameters, verified against their digests, and its config.json the
model, chat settings, pooling and length limit. Each completion is scored
with its prompt made from its example through `prompt_template`: the
experiment binds its own (the prompt the policy saw), else the reward model
run's. Scoring is one jitted forward pass per batch of `batch_size`
(bucketed widths: a run compiles a few shapes).

A learned reward runs in the trainer's process, on the device, never in the
reward worker of `time_limit` (which would load a second copy of the model
and score one completion per call): `is_learned(name)` tells the experiment
which components to keep in-process.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.parallel import distributed
from jaxrl_agents.rewards._checks import as_rewards, check_batch

log = logging.getLogger(__name__)

LEARNED = ("reward_model",)


def is_learned(name: str) -> bool:
  """Whether the registered reward `name` is a learned model (scored in-process)."""
  return name in LEARNED


def check_workdir(workdir: str) -> None:
  """Fails naming the problem unless `workdir` holds a reward-model run with a checkpoint
  (checked before any step)."""
  if not workdir:
    raise ValueError("reward_model needs the workdir of a reward-model run: "
                     "{'reward_model': {'workdir': ...}}")
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"reward_model: {workdir} has no config.json; not the workdir of "
                            "a reward-model run (experiments/reward_model.py)")
  with open(config_path) as f:
    if "reward_model" not in json.load(f):
      raise ValueError(f"reward_model: {workdir} is not a reward-model run (its config has no "
                       "'reward_model' settings)")
  checkpoints = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(checkpoints) or not any(name.isdigit()
                                               for name in os.listdir(checkpoints)):
    raise FileNotFoundError(f"reward_model: {workdir} has no checkpoint yet")


def _padded_batches(columns: Sequence[Sequence[Any]], batch_size: int):
  """(real rows, the columns' next batch_size rows) of `data.padded_batches` over the
  columns' rows, so every batch has one shape and repeated scoring compiles a few."""
  from jaxrl_agents.data import loader

  for _, rows, batch in loader.padded_batches(list(zip(*columns, strict=True)), batch_size):
    yield rows, [list(c) for c in zip(*batch, strict=True)]


def score_texts(score_fn, params, tok, prompts: Sequence[str], responses: Sequence[str], *,
                max_len: int, chat: bool, system: str | None, batch_size: int) -> np.ndarray:
  """f32[B] `score_fn(params, tokens, mask, reply)` of (prompt, response) texts, in batches of
  `batch_size` rows (the last padded) at bucketed widths: repeated scoring compiles a
  few shapes."""
  import jax.numpy as jnp

  from jaxrl_agents.data import preferences

  out = []
  for rows, (p, r) in _padded_batches((prompts, responses), batch_size):
    e = preferences.encode_texts(tok, p, r, max_len=max_len, chat=chat, system=system)
    out.append(distributed.to_host(score_fn(params, jnp.asarray(e.tokens), jnp.asarray(e.mask),
                                            jnp.asarray(e.response)))[:rows])
  return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def score_steps(score_fn, params, tok, prompts: Sequence[str],
                step_lists: Sequence[Sequence[str]], *, max_len: int, max_steps: int,
                chat: bool, system: str | None, batch_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """(f32[B, K] step scores, bool[B, K] step mask) of (prompt, steps) rows:
  `score_fn(params, tokens, mask, ends, step_mask)` in batches of `batch_size` rows (the
  last padded) at bucketed widths."""
  import jax.numpy as jnp

  from jaxrl_agents.data import steps as steps_lib

  scores, masks = [], []
  for rows, (p, st) in _padded_batches((prompts, step_lists), batch_size):
    e = steps_lib.encode_steps(tok, p, st, max_len=max_len, max_steps=max_steps, chat=chat,
                               system=system)
    out = score_fn(params, *(jnp.asarray(x) for x in (e.tokens, e.mask, e.ends, e.step_mask)))
    scores.append(distributed.to_host(out)[:rows])
    masks.append(e.step_mask[:rows])
  if not scores:
    return np.zeros((0, max_steps), np.float32), np.zeros((0, max_steps), bool)
  return np.concatenate(scores).astype(np.float32), np.concatenate(masks)


class LearnedReward:
  """An outcome reward model restored from a reward-model run: texts -> f32[B] rewards."""

  def __init__(self, workdir: str, batch_size: int = 32, step: int = 0, aggregate: str = ""):
    # Imported here: the rewards package stays light for the reward worker processes.
    import jax
    import jax.numpy as jnp

    from jaxrl_agents.models import reward_model as rm_lib
    from jaxrl_agents.models import zoo
    from jaxrl_agents.train import checkpointing

    check_workdir(workdir)
    with open(os.path.join(workdir, "config.json")) as f:
      self.config = json.load(f)
    params, _, self.step = checkpointing.latest_policy_params(workdir, step or None)
    if set(params) != {"backbone", "head"}:
      raise ValueError(f"{workdir}'s checkpoint holds {sorted(params)}, not a reward model's "
                       "backbone and head")
    model = zoo.load(self.config["model"], dtype=self.config.get("dtype", "float32"))
    self.tokenizer, self.cfg = model.tokenizer, model.cfg
    self.params = jax.tree.map(jnp.asarray, params)
    settings = self.config["reward_model"]
    self.max_len = int(settings["max_len"])
    self.template = self.config["prompt_template"]
    self.chat = bool(self.config.get("chat", True))
    self.system = self.config.get("system_prompt") or None
    self.batch_size = batch_size
    # A process reward model's run names its step separator; an outcome model's, its pooling.
    self.process = "step_separator" in self.config
    if self.process:
      from jaxrl_agents.rewards import process_rewards

      self.aggregate = aggregate or "min"
      if self.aggregate not in process_rewards.AGGREGATIONS:
        raise ValueError(f"reward_model: aggregate must be one of "
                         f"{process_rewards.AGGREGATIONS}, got {aggregate!r}")
      self.separator = self.config["step_separator"]
      self.max_steps = int(self.config["max_steps"])
      self._score = jax.jit(lambda p, tokens, mask, ends, step_mask: rm_lib.step_scores(
          p, tokens, mask, ends, step_mask, cfg=model.cfg))
      self._aggregate = jax.jit(lambda scores, present: process_rewards.aggregate(
          jax.nn.sigmoid(scores), present, self.aggregate))
    else:
      if aggregate:
        raise ValueError(f"reward_model: aggregate={aggregate!r} is for process reward models; "
                         f"{workdir} is an outcome reward model")
      self._score = jax.jit(lambda p, tokens, mask, reply: rm_lib.outcome_rewards(
          p, tokens, mask, cfg=model.cfg, pooling=settings["pooling"], reply=reply))
    log.info("%s reward model from %s (step %d)", "process" if self.process else "outcome",
             workdir, self.step)

  def score(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
    """f32[B] rewards of (prompt, response) texts, the prompt as the user message; a process
    reward model's are its step scores' sigmoids aggregated per reply."""
    if self.process:
      import jax.numpy as jnp

      from jaxrl_agents.data import steps as steps_lib

      step_lists = [steps_lib.split_steps(r, self.separator, self.max_steps) for r in responses]
      scores, present = score_steps(self._score, self.params, self.tokenizer, prompts,
                                    step_lists, max_len=self.max_len, max_steps=self.max_steps,
                                    chat=self.chat, system=self.system,
                                    batch_size=self.batch_size)
      if not len(scores):
        return np.zeros(0, np.float32)
      return np.asarray(self._aggregate(jnp.asarray(scores), jnp.asarray(present)), np.float32)
    return score_texts(self._score, self.params, self.tokenizer, prompts, responses,
                       max_len=self.max_len, chat=self.chat, system=self.system,
                       batch_size=self.batch_size)

  def __call__(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
               template: str | None = None) -> np.ndarray:
    """Rewards of completions to the prompts `template` (default: the run's) makes."""
    from jaxrl_agents.data import prompts

    return self.score(prompts.format_prompts(examples, template or self.template),
                      completions)

  def __reduce__(self):
    raise TypeError("a learned reward holds device arrays and runs in the trainer's process")


@functools.lru_cache(maxsize=4)
def load(workdir: str, batch_size: int = 32, step: int = 0, aggregate: str = ""
         ) -> LearnedReward:
  """The reward model of `workdir` (checkpoint `step`, 0: the newest), loaded once per
  process."""
  return LearnedReward(os.path.abspath(workdir), batch_size, step, aggregate)


@registry.register("reward", "reward_model")
def reward_model_reward(completions: Sequence[str],
                        examples: Sequence[Mapping[str, Any]] | None = None, *,
                        workdir: str = "", prompt_template: str = "", step: int = 0,
                        batch_size: int = 32, aggregate: str = "") -> np.ndarray:
  """A trained reward model's score of each completion: an outcome model's score
  (unbounded, any sign), or a process model's step probabilities aggregated per reply
  (`process_rewards.aggregate`: "min" by default, "last", "clip").

  Args:
    completions: B decoded replies.
    examples: B task examples, with the fields the reward model's prompt template names.
    workdir: the reward-model run (experiments/reward_model.py) to score with.
    prompt_template: makes each prompt from its example (default: the run's own).
    step: the run's checkpoint to load (0: the newest at the first call).
    batch_size: completions per forward pass.
    aggregate: a process reward model's aggregation of its step scores.
  """
  check_batch("reward_model", completions, examples)
  if examples is None:
    raise ValueError("reward_model scores a reply with its prompt: it needs the examples")
  return as_rewards(load(workdir, batch_size, step, aggregate)(completions, examples,
                                                               prompt_template or None))
