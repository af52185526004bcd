r"""Supervised fine-tuning on (prompt, completion) pairs from JSONL, on the run harness.

  python -m experiments.sft --config=experiments/configs/sft_arithmetic.py:tiny \
      --workdir=/tmp/sft_tiny

Each line of `jsonl_path` is {"prompt": ..., "completion": ...} (a bad row
names its line). Without a file, the rows are the task's training questions
through `prompt_template` with their reference answers through
`completion_template` (fine-tuning on gold answers). The prompt goes through
the chat template as the user message, the completion is the reply, closed by
the end-of-turn token, and the loss is the reply tokens' negative
log-likelihood (`losses.sft_nll`; the prompt's tokens carry no loss).
Evaluation: the held-out rows' per-token NLL (`eval_jsonl_path`) and, when
`task` names one, the greedy accuracy on its held-out questions.

SFT then RL is one command after another:

  python -m experiments.sft --config=... --workdir=runs/sft
  python -m jaxrl_agents.tools.export --workdir=runs/sft --out=runs/sft_hf
  python -m experiments.grpo --config=experiments/configs/grpo_arithmetic.py \
      --config.model=runs/sft_hf --workdir=runs/grpo_after_sft

`SFTBatch`, `sft_loss` and `encode_rows` are shared with
`experiments.rejection_sampling`, which fine-tunes on the policy's own best replies.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from jaxrl_agents import data as data_lib
from jaxrl_agents.data import preferences
from jaxrl_agents.data.jsonl import read_objects
from jaxrl_agents.models import zoo
from jaxrl_agents.objectives import losses
from jaxrl_agents.parallel import sharding
from jaxrl_agents.rollout import scoring, single_turn
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib

log = logging.getLogger(__name__)


class SFTState(NamedTuple):
  params: Any
  opt_state: Any
  updates: jax.Array


class SFTBatch(NamedTuple):
  """Rows int32[B, W] tokens, bool[B, W] mask, and bool[B, R] reply mask over the last R
  columns (no loss where it is False)."""
  tokens: jax.Array
  mask: jax.Array
  reply: jax.Array


def sft_loss(params, batch: SFTBatch, *, cfg, aggregation: str = "token-mean"):
  """The reply tokens' NLL: (loss, metrics)."""
  logp = scoring.reply_logprobs(params, batch.tokens, batch.mask, batch.reply, cfg=cfg)
  return losses.sft_nll(logp, batch.reply, aggregation=aggregation)


def encode_rows(tok, prompts: Sequence[str], completions: Sequence[str], *, max_len: int,
                chat: bool, system: str | None, width: int | None = None
                ) -> tuple[SFTBatch, int]:
  """(SFTBatch, rows truncated to max_len) of (prompt, completion) texts. With a fixed
  `width` the reply mask spans all W columns (a fixed shape); else the last R
  (`preferences.reply_tail`: log-probs at the reply columns only)."""
  e = preferences.encode_texts(tok, prompts, completions, max_len=max_len, chat=chat,
                               system=system, width=width)
  reply = e.response if width else preferences.reply_tail(e.response)
  return SFTBatch(jnp.asarray(e.tokens), jnp.asarray(e.mask), jnp.asarray(reply)), \
      int(e.truncated.sum())


def make_update(config, model: zoo.Model, total_updates: int):
  """(optimizer, jitted update(state, batch, rng, progress) -> (state, metrics))."""
  optimizer = optim_lib.make_optimizer(total_updates=total_updates, **config.optimizer)
  loss = functools.partial(sft_loss, cfg=model.cfg, aggregation=config.aggregation)
  update = jax.jit(functools.partial(optim_lib.update_state, optimizer, loss, epochs=1,
                                     minibatches=config.minibatches), donate_argnums=0)
  return optimizer, update


def init_state(model: zoo.Model, optimizer) -> SFTState:
  params = jax.tree.map(jnp.copy, model.params)
  return SFTState(params=params, opt_state=optimizer.tx.init(params),
                  updates=jnp.zeros((), jnp.int32))


def held_out_accuracy(config, model: zoo.Model, params, eval_examples, rewards
                      ) -> tuple[dict, list]:
  """Greedy accuracy (and rewards) on the task's held-out questions (`single_turn.evaluate`);
  `rewards` is `common.make_rewards(config)`, made once per run."""
  reward_fn, grader = rewards
  return single_turn.evaluate(params, model, eval_examples, batch_size=config.eval_batch_size,
                          max_new_tokens=config.max_new_tokens, template=config.prompt_template,
                          chat=config.chat, system=config.system_prompt or None,
                          reward_fn=reward_fn, grader=grader)


class SFTTrainer:
  def __init__(self, config, model: zoo.Model, rows, held_rows, eval_examples):
    self.config, self.model = config, model
    self.held_rows, self.eval_examples = held_rows, eval_examples
    self.optimizer, self._update = make_update(config, model, config.steps * config.minibatches)
    self._nll = jax.jit(functools.partial(sft_loss, cfg=model.cfg))
    self.data = data_lib.make_loader(rows, batch_size=config.batch_size, seed=config.seed)
    self.mesh = sharding.for_config(config)
    self.system = config.system_prompt or None
    self.rewards = common.make_rewards(config) if eval_examples else None

  def init_state(self) -> SFTState:
    return init_state(self.model, self.optimizer)

  def _encode(self, rows):
    return encode_rows(self.model.tokenizer, [r["prompt"] for r in rows],
                       [r["completion"] for r in rows], max_len=self.config.max_len,
                       chat=self.config.chat, system=self.system)

  def train_step(self, state: SFTState, rng, progress: float) -> harness.StepResult:
    rows = next(self.data)
    batch, truncated = self._encode(rows)
    state, record = common.supervised_update(self._update, self.mesh, state, batch, rng,
                                             progress, truncated)
    return harness.StepResult(state=state, record=record,
                              samples=[{"prompt": r["prompt"], "completion": r["completion"]}
                                       for r in rows])

  def evaluate(self, state: SFTState) -> tuple[dict, list[dict]]:
    record, samples = {}, []
    if self.held_rows:
      bs, tokens, nll = self.config.batch_size, 0.0, 0.0
      for _, n, padded in data_lib.padded_batches(self.held_rows, bs):
        batch, _ = self._encode(padded)
        keep = np.arange(bs) < n  # the padding rows carry no loss
        batch = batch._replace(reply=batch.reply & jnp.asarray(keep)[:, None])
        _, m = self._nll(state.params, batch)
        tokens += float(m["num_tokens"])
        nll += float(m["token_nll"]) * float(m["num_tokens"])
      record.update(held_out_nll=nll / max(tokens, 1.0), held_out_tokens=tokens)
    if self.eval_examples:
      accuracy, samples = held_out_accuracy(self.config, self.model, state.params,
                                            self.eval_examples, self.rewards)
      record.update(accuracy)
    return record, samples

  def nonfinite_count(self, state) -> tuple[int, int]:
    return optim_lib.nonfinite_count(state)


def load_rows(path: str) -> list[dict]:
  """The {"prompt", "completion"} rows of a JSONL file; a bad row names its file and line."""
  rows = []
  for where, row in read_objects(path):
    for field in ("prompt", "completion"):
      if field not in row:
        raise ValueError(f"{where}: missing field {field!r} (fields: {sorted(row)})")
      if not isinstance(row[field], str):
        raise ValueError(f"{where}: field {field!r} must be a string, got "
                         f"{type(row[field]).__name__}")
    if not row["completion"].strip():
      raise ValueError(f"{where}: field 'completion' is empty")
    rows.append(row)
  if not rows:
    raise ValueError(f"{path}: no rows (the file is empty or blank)")
  return rows


def task_rows(config) -> list[dict]:
  """(prompt, completion) rows from the task's training questions and reference answers."""
  source = data_lib.load_task(config.task, "train")
  examples = [source[i] for i in range(len(source))]
  prompts = single_turn.format_prompts(examples, config.prompt_template)
  completions = single_turn.format_prompts(examples, config.completion_template)
  return [{"prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]


def held_out_examples(config) -> list[dict]:
  if not config.task:
    return []
  source = data_lib.load_task(config.task, config.eval_split)
  return [source[i] for i in range(min(config.eval_size, len(source)))]


def validate(config) -> None:
  harness.validate_run_keys(config)
  if config.minibatches < 1:
    raise ValueError(f"minibatches must be >= 1, got {config.minibatches}")
  if not config.jsonl_path and not config.task:
    raise ValueError("set config.jsonl_path (a JSONL file of {'prompt', 'completion'} rows) or "
                     "config.task (its questions and reference answers)")
  if config.batch_size < 1 or config.batch_size % config.minibatches:
    raise ValueError(f"batch_size ({config.batch_size}) must be a positive multiple of "
                     f"minibatches ({config.minibatches})")
  if config.max_len < 8:
    raise ValueError(f"max_len must be >= 8 tokens, got {config.max_len}")


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) supervised fine-tuning in `workdir`; returns the last eval record."""
  validate(config)
  rows = load_rows(config.jsonl_path) if config.jsonl_path else task_rows(config)
  held_rows = load_rows(config.eval_jsonl_path)[: config.eval_size] \
      if config.eval_jsonl_path else []
  model = common.load_model(config)
  eval_examples = held_out_examples(config)
  trainer = SFTTrainer(config, model, rows, held_rows, eval_examples)
  evaluate = trainer.evaluate if (held_rows or eval_examples) else None
  return harness.run(config, workdir, init_state=trainer.init_state,
                     train_step=trainer.train_step, evaluate=evaluate, data=trainer.data,
                     nonfinite_count=trainer.nonfinite_count, postfix=("loss",),
                     progress=progress, resume_rules=common.RESUME_RULES)


if __name__ == "__main__":
  # Large temporaries: the default config's step (16 x 128 tokens) 5.1-5.3 -> 4.7-4.8 s.
  common.main(train, host_memory="retain")
