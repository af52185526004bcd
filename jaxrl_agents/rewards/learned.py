"""A trained reward model as a reward: `{"reward_model": {"workdir": RUN}}` in config.rewards.

    from_config({"reward_model": {"weight": 1.0, "workdir": "runs/rm_arithmetic"}})

RUN is a workdir of `experiments/reward_model.py`. Its newest checkpoint gives
the parameters (verified against their digests) and its config.json the model,
the prompt template and chat settings it was trained with, the pooling and
the length limit. Each completion is scored with the prompt its example makes
through that template, as one jitted forward pass per batch of `batch_size`
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
from jaxrl_agents.rewards._checks import as_rewards, check_batch

log = logging.getLogger(__name__)

LEARNED = ("reward_model",)


def is_learned(name: str) -> bool:
  """Whether the registered reward `name` is a learned model (scored in-process)."""
  return name in LEARNED


def check_workdir(workdir: str) -> None:
  """Fails naming the problem unless `workdir` holds a reward-model run (before any step)."""
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


class LearnedReward:
  """An outcome reward model restored from a reward-model run: texts -> f32[B] rewards."""

  def __init__(self, workdir: str, batch_size: int = 32):
    # Imported here: the rewards package stays light for the reward worker processes.
    import jax
    import jax.numpy as jnp

    from jaxrl_agents import checkpointing
    from jaxrl_agents.models import reward_model as rm_lib
    from jaxrl_agents.models import zoo

    check_workdir(workdir)
    with open(os.path.join(workdir, "config.json")) as f:
      self.config = json.load(f)
    params, _, self.step = checkpointing.latest_policy_params(workdir)
    if set(params) != {"backbone", "head"}:
      raise ValueError(f"{workdir}'s checkpoint holds {sorted(params)}, not a reward model's "
                       "backbone and head")
    model = zoo.load(self.config["model"], dtype=self.config.get("dtype", "float32"))
    self.tokenizer = model.tokenizer
    self.params = jax.tree.map(jnp.asarray, params)
    settings = self.config["reward_model"]
    self.max_len = int(settings["max_len"])
    self.template = self.config["prompt_template"]
    self.chat = bool(self.config.get("chat", True))
    self.system = self.config.get("system_prompt") or None
    self.batch_size = batch_size
    self._score = jax.jit(functools.partial(rm_lib.outcome_rewards, cfg=model.cfg,
                                            pooling=settings["pooling"]))
    log.info("reward model from %s (step %d)", workdir, self.step)

  def score(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
    """f32[B] rewards of (prompt, response) texts, the prompt as the user message."""
    import jax.numpy as jnp

    from jaxrl_agents.data import preferences

    out = []
    for start in range(0, len(prompts), self.batch_size):
      p = list(prompts[start:start + self.batch_size])
      r = list(responses[start:start + self.batch_size])
      rows = len(p)
      p += [p[0]] * (self.batch_size - rows)  # one batch size: one compiled shape per width
      r += [r[0]] * (self.batch_size - rows)
      e = preferences.encode_texts(self.tokenizer, p, r, max_len=self.max_len, chat=self.chat,
                                   system=self.system)
      out.append(np.asarray(self._score(self.params, jnp.asarray(e.tokens),
                                        jnp.asarray(e.mask)))[:rows])
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

  def __call__(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]
               ) -> np.ndarray:
    from jaxrl_agents.rollout import single_turn

    return self.score(single_turn.format_prompts(examples, self.template), completions)

  def __reduce__(self):
    raise TypeError("a learned reward holds device arrays and runs in the trainer's process")


@functools.lru_cache(maxsize=4)
def load(workdir: str, batch_size: int = 32) -> LearnedReward:
  """The reward model of `workdir`, loaded once per process."""
  return LearnedReward(os.path.abspath(workdir), batch_size)


@registry.register("reward", "reward_model")
def reward_model_reward(completions: Sequence[str],
                        examples: Sequence[Mapping[str, Any]] | None = None, *,
                        workdir: str = "", batch_size: int = 32) -> np.ndarray:
  """A trained outcome reward model's score of each completion (unbounded, any sign).

  Args:
    completions: B decoded replies.
    examples: B task examples, with the fields the reward model's prompt template names.
    workdir: the reward-model run (experiments/reward_model.py) to score with.
    batch_size: completions per forward pass.
  """
  check_batch("reward_model", completions, examples)
  if examples is None:
    raise ValueError("reward_model scores a reply with its prompt: it needs the examples")
  return as_rewards(load(workdir, batch_size)(completions, examples))
