r"""Train a process reward model: a score per reasoning step, fit to step-value labels.

  python -m experiments.process_reward_model \
      --config=experiments/configs/process_reward_model_arithmetic.py:tiny --workdir=/tmp/prm

The model is a reward model's backbone and scalar head
(`jaxrl_agents.models.reward_model`); step k's score is read at the step's
last token (`data.steps.encode_steps`; the last step's at the token closing
the reply), and sigmoid(score) is fit to the step's value label v_k in [0, 1]
by binary cross-entropy, over the real steps of `rows_per_step` replies a step.

Rows come from JSONL (`steps_jsonl`: {"prompt", "steps", "values"} per line)
or are generated from a task with a verifier: each step's value is the
fraction of Monte-Carlo continuations from it that reach the right answer
(`experiments/step_data.py`).

Evaluation, on held-out rows: the step loss, step accuracy (sigmoid(score) on
the same side of 1/2 as the label; labels of exactly 1/2 are left out) and the
mean absolute error of sigmoid(score); with generated rows, best-of-N among
each held-out question's N replies by the smallest step score ("min") and by
the last ("last"), beside greedy and pass@N.

A trained run is a reward for GRPO and the other trainers:
`{"reward_model": {"workdir": RUN, "aggregate": "min"}}` in config.rewards
(`rewards/learned.py`; "clip" sums min(sigmoid(score) - 1/2, 0), so a repeated
step never raises the total).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common, preference_data, step_data
from experiments import reward_model as rm_experiment
from jaxrl_agents.data import make_loader
from jaxrl_agents.data import steps as steps_lib
from jaxrl_agents.models import lm, zoo
from jaxrl_agents.models import reward_model as rm_lib
from jaxrl_agents.parallel import sharding
from jaxrl_agents.rewards import best_of_n, learned, process_rewards
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib


class StepBatch(NamedTuple):
  """R replies: int32[R, W] tokens, bool[R, W] mask, int32[R, K] step ends, bool[R, K]
  step mask, f32[R, K] step values."""
  tokens: jax.Array
  mask: jax.Array
  ends: jax.Array
  step_mask: jax.Array
  values: jax.Array


@dataclasses.dataclass(frozen=True)
class PRMSettings:
  frozen_layers: int
  max_len: int
  max_steps: int
  separator: str
  chat: bool
  system: str | None


def settings_from_config(config, cfg: lm.CausalLM) -> PRMSettings:
  r = config.reward_model
  rm_lib.check_frozen_layers(r.frozen_layers, cfg)
  if r.max_len < 8:
    raise ValueError(f"reward_model.max_len must be >= 8 tokens, got {r.max_len}")
  if config.max_steps < 1:
    raise ValueError(f"max_steps must be >= 1, got {config.max_steps}")
  if not config.step_separator:
    raise ValueError("step_separator must not be empty")
  return PRMSettings(frozen_layers=int(r.frozen_layers), max_len=int(r.max_len),
                     max_steps=int(config.max_steps), separator=config.step_separator,
                     chat=bool(config.chat), system=config.system_prompt or None)


def scores_of(params, tokens, mask, ends, step_mask, *, cfg, s: PRMSettings):
  return rm_lib.step_scores(params, tokens, mask, ends, step_mask, cfg=cfg,
                            frozen_layers=s.frozen_layers)


def step_loss(params, batch: StepBatch, *, cfg, s: PRMSettings):
  """Binary cross-entropy of sigmoid(step score) against the step values, averaged over the
  real steps: (loss, metrics)."""
  scores = scores_of(params, batch.tokens, batch.mask, batch.ends, batch.step_mask, cfg=cfg,
                     s=s)
  present = batch.step_mask.astype(jnp.float32)
  count = jnp.maximum(present.sum(), 1.0)
  bce = optax.sigmoid_binary_cross_entropy(scores, batch.values)
  loss = (bce * present).sum() / count
  decided = present * (batch.values != 0.5)
  right = ((scores > 0) == (batch.values > 0.5)) * decided
  return loss, {"loss": loss, "step_accuracy": right.sum() / jnp.maximum(decided.sum(), 1.0),
                "steps": present.sum()}


def step_batch(tok, rows, s: PRMSettings, width: int | None = None) -> tuple[StepBatch, int]:
  """(StepBatch of the rows, how many rows lost their start to max_len)."""
  e = steps_lib.encode_steps(tok, [r["prompt"] for r in rows], [r["steps"] for r in rows],
                             max_len=s.max_len, max_steps=s.max_steps, chat=s.chat,
                             system=s.system, width=width)
  values, _ = steps_lib.step_values(rows, s.max_steps)
  batch = StepBatch(jnp.asarray(e.tokens), jnp.asarray(e.mask), jnp.asarray(e.ends),
                    jnp.asarray(e.step_mask), jnp.asarray(values))
  return batch, int(e.truncated.sum())


class ProcessRewardModelTrainer:
  """Step-value training of a process reward model: harness callbacks over jitted steps."""

  def __init__(self, config, model: zoo.Model, train_rows, held_rows, candidates):
    self.config, self.model = config, model
    self.s = s = settings_from_config(config, model.cfg)
    self.held_rows, self.candidates = held_rows, candidates
    self.optimizer = rm_experiment.make_optimizer(config)
    loss = functools.partial(step_loss, cfg=model.cfg, s=s)
    self._update = jax.jit(functools.partial(
        optim_lib.update_state, self.optimizer, loss, epochs=1, minibatches=config.minibatches),
        donate_argnums=0)
    self._score = jax.jit(functools.partial(scores_of, cfg=model.cfg, s=s))
    self.data = make_loader(train_rows, batch_size=config.rows_per_step, seed=config.seed)
    self.mesh = sharding.for_config(config)

  def init_state(self) -> rm_experiment.RMState:
    return rm_experiment.init_state(self.config, self.model, self.optimizer)

  def train_step(self, state, rng, progress: float) -> harness.StepResult:
    rows = next(self.data)
    batch, truncated = step_batch(self.model.tokenizer, rows, self.s)
    state, record = common.supervised_update(self._update, self.mesh, state, batch, rng,
                                             progress, truncated)
    samples = [{"prompt": r["prompt"], "steps": r["steps"], "values": r["values"]}
               for r in rows]
    return harness.StepResult(state=state, record=record, samples=samples)

  def evaluate(self, state) -> tuple[dict, list[dict]]:
    held = self.held_rows
    scores, present = self._score_steps(state.params, [r["prompt"] for r in held],
                                        [r["steps"] for r in held])
    values, _ = steps_lib.step_values(held, self.s.max_steps)
    bce = np.asarray(optax.sigmoid_binary_cross_entropy(jnp.asarray(scores),
                                                        jnp.asarray(values)))
    decided = present & (values != 0.5)
    record = {"step_loss": float(bce[present].mean()),
              "step_accuracy": float(((scores > 0) == (values > 0.5))[decided].mean())
              if decided.any() else float("nan"),
              "step_mae": float(np.abs(1 / (1 + np.exp(-scores)) - values)[present].mean()),
              "num_rows": len(held), "num_steps": int(present.sum())}
    samples = [{"prompt": r["prompt"], "steps": r["steps"], "values": r["values"],
                "scores": scores[i, :len(r["steps"])].tolist()} for i, r in enumerate(held)]
    if self.candidates:
      record.update(self._best_of_n(state))
    return record, samples

  def _best_of_n(self, state) -> dict[str, float]:
    """Best-of-N accuracy on the held-out questions, choosing by each aggregation."""
    flat_prompts = [c["prompt"] for c in self.candidates for _ in c["replies"]]
    flat_steps = [steps_lib.split_steps(reply, self.s.separator, self.s.max_steps)
                  for c in self.candidates for reply in c["replies"]]
    scores, present = self._score_steps(state.params, flat_prompts, flat_steps)
    n = len(self.candidates[0]["replies"])
    correct = [c["correct"] for c in self.candidates]
    out = {}
    for how in ("min", "last"):
      rewards = np.asarray(process_rewards.aggregate(
          jax.nn.sigmoid(jnp.asarray(scores)), jnp.asarray(present), how)).reshape(-1, n)
      picked = best_of_n.selection_accuracy(
          rewards, correct, greedy_correct=[c["greedy_correct"] for c in self.candidates])
      out[f"best_of_{n}_accuracy/{how}"] = picked[f"best_of_{n}_accuracy"]
      out.update({k: v for k, v in picked.items() if not k.startswith("best_of_")})
    return out

  def _score_steps(self, params, prompts, step_lists):
    return learned.score_steps(self._score, params, self.model.tokenizer, prompts, step_lists,
                               max_len=self.s.max_len, max_steps=self.s.max_steps,
                               chat=self.s.chat, system=self.s.system,
                               batch_size=self.config.score_batch_size)

  def nonfinite_count(self, state) -> tuple[int, int]:
    return optim_lib.nonfinite_count(state)


def validate(config) -> None:
  harness.validate_run_keys(config)
  if config.minibatches < 1 or config.rows_per_step < 1 \
      or config.rows_per_step % config.minibatches:
    raise ValueError(f"rows_per_step ({config.rows_per_step}) must be a positive multiple of "
                     f"minibatches ({config.minibatches})")
  if config.eval_steps_jsonl and not config.steps_jsonl:
    raise ValueError("eval_steps_jsonl is set but steps_jsonl is not: generated rows bring "
                     "their own held-out rows")
  if config.score_batch_size < 1:
    raise ValueError(f"score_batch_size must be >= 1, got {config.score_batch_size}")
  rm_experiment.check_frozen_layers_decay(config)
  if not config.steps_jsonl:
    preference_data.grader(config)  # names a mistyped grader
    g = config.generation
    for key in ("train_prompts", "eval_prompts", "group_size", "continuations",
                "batch_prompts", "max_new_tokens"):
      if g[key] < 1:
        raise ValueError(f"generation.{key} must be >= 1, got {g[key]}")


def train(config, workdir: str, progress: bool = True) -> dict[str, Any]:
  """Runs (or resumes) process-reward-model training in `workdir`; returns the last eval
  record."""
  validate(config)
  model = common.load_model(config)
  settings_from_config(config, model.cfg)  # before any data is generated
  train_rows, held_rows, candidates = step_data.load_data(config, model, workdir, progress)
  trainer = ProcessRewardModelTrainer(config, model, train_rows, held_rows, candidates)
  return harness.run(config, workdir, init_state=trainer.init_state,
                     train_step=trainer.train_step, evaluate=trainer.evaluate,
                     data=trainer.data, nonfinite_count=trainer.nonfinite_count,
                     postfix=("loss", "step_accuracy"), finite_keys=(), progress=progress,
                     resume_rules=common.RESUME_RULES)


if __name__ == "__main__":
  common.main(train)
