r"""Train an outcome reward model with the Bradley-Terry loss on preference pairs.

  python -m experiments.reward_model \
      --config=experiments/configs/reward_model_arithmetic.py:tiny --workdir=/tmp/rm_tiny

The reward model is the policy model's backbone plus a scalar head
(`jaxrl_agents.models.reward_model`), read at the reply's closing token (or
averaged over the reply: `reward_model.pooling = "mean"`).
Each step takes `pairs_per_step` pairs and minimizes
-log sigmoid(r(x, chosen) - r(x, rejected) - margin).

Pairs come from JSONL (`pairs_jsonl`: {"prompt", "chosen", "rejected"} per
line; a bad row names its line) or are generated from a task with a verifier:
the model samples `generation.group_size` replies per question and a reply the
grader accepts is preferred to one it rejects (`experiments.preference_data`,
which DPO shares). The head learns at `reward_model.head_learning_rate`, the
backbone above `frozen_layers` at the optimizer's rate.

Evaluation: on held-out pairs, the pair accuracy (r(chosen) > r(rejected); a
tie counts half, while the training batches' "accuracy" counts it wrong),
the mean reward margin, and the expected calibration error of
P(chosen preferred) = sigmoid(margin) (`reward_model.pair_calibration`); with
generated pairs, also the accuracy of the reward model's best-of-N pick and of
its reward-weighted vote among each held-out question's N replies, beside the
greedy reply's accuracy and pass@N (an oracle's pick).

The run lives on the harness (`jaxrl_agents.train.harness`): workdir, checkpoints,
exact resume, metrics.jsonl, samples.jsonl, TensorBoard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from experiments import common, preference_data
from jaxrl_agents.data import make_loader, preferences
from jaxrl_agents.models import lm, zoo
from jaxrl_agents.models import reward_model as rm_lib
from jaxrl_agents.objectives import losses
from jaxrl_agents.parallel import sharding
from jaxrl_agents.rewards import best_of_n, learned
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib


class RMState(NamedTuple):
  params: dict  # {"backbone", "head"}
  opt_state: Any
  updates: jax.Array  # int32[] applied optimizer updates


class PairBatch(NamedTuple):
  """N pairs, each side int32[N, W] tokens, bool[N, W] mask and reply mask (left-padded)."""
  chosen: jax.Array
  chosen_mask: jax.Array
  chosen_reply: jax.Array
  rejected: jax.Array
  rejected_mask: jax.Array
  rejected_reply: jax.Array


@dataclasses.dataclass(frozen=True)
class RMSettings:
  pooling: str
  frozen_layers: int
  max_len: int
  margin: float
  chat: bool
  system: str | None


def settings_from_config(config, cfg: lm.CausalLM) -> RMSettings:
  r = config.reward_model
  if r.pooling not in rm_lib.POOLINGS:
    raise ValueError(f"reward_model.pooling must be one of {rm_lib.POOLINGS}, got {r.pooling!r}")
  rm_lib.check_frozen_layers(r.frozen_layers, cfg)
  if r.max_len < 8:
    raise ValueError(f"reward_model.max_len must be >= 8 tokens, got {r.max_len}")
  return RMSettings(pooling=r.pooling, frozen_layers=int(r.frozen_layers), max_len=int(r.max_len),
                    margin=float(config.margin), chat=bool(config.chat),
                    system=config.system_prompt or None)


def rewards_of(params, tokens, mask, reply, *, cfg, s: RMSettings):
  return rm_lib.outcome_rewards(params, tokens, mask, cfg=cfg, pooling=s.pooling,
                                frozen_layers=s.frozen_layers, reply=reply)


def pair_rewards(params, batch: PairBatch, *, cfg, s: RMSettings
                 ) -> tuple[jax.Array, jax.Array]:
  """(f32[N] rewards of the chosen sides, f32[N] of the rejected ones)."""
  # Both sides in one forward pass when they share a width (they always do: see pair_batch).
  tokens = jnp.concatenate([batch.chosen, batch.rejected])
  mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask])
  reply = jnp.concatenate([batch.chosen_reply, batch.rejected_reply])
  r = rewards_of(params, tokens, mask, reply, cfg=cfg, s=s)
  n = batch.chosen.shape[0]
  return r[:n], r[n:]


def bt_loss(params, batch: PairBatch, *, cfg, s: RMSettings):
  """Bradley-Terry loss of one (mini)batch of pairs: (loss, metrics)."""
  return losses.bradley_terry_loss(*pair_rewards(params, batch, cfg=cfg, s=s), margin=s.margin)


def pair_batch(tok, pairs: Sequence[Mapping[str, Any]], s: RMSettings) -> tuple[PairBatch, int]:
  """(PairBatch of both sides at one bucketed width, sequences truncated to max_len)."""
  c, r = preferences.encode_pairs(tok, pairs, max_len=s.max_len, chat=s.chat, system=s.system)
  batch = PairBatch(*(jnp.asarray(x) for x in (c.tokens, c.mask, c.response, r.tokens, r.mask,
                                                r.response)))
  return batch, int(c.truncated.sum() + r.truncated.sum())


def accuracy_by_source(pairs: Sequence[Mapping[str, Any]], margins) -> dict[str, float]:
  """Pair accuracy of each kind of pair ("pair_accuracy/<source>"; a pair without a
  "source" is "sampled"), when the pairs are of more than one kind."""
  sources = [p.get("source", "sampled") for p in pairs]
  if len(set(sources)) < 2:
    return {}
  out = {}
  for source in sorted(set(sources)):
    m = jnp.asarray([x for x, s in zip(margins, sources, strict=True) if s == source])
    out[f"pair_accuracy/{source}"] = float(jnp.mean((m > 0) + 0.5 * (m == 0)))
  return out


# ----------------------------------------------------------------------------
# The trainer.


def head_labels(params) -> dict:
  """Optimizer group of each parameter: "head" for the scalar head, "default" for the rest."""
  return {name: jax.tree.map(lambda _, n=name: "head" if n == "head" else "default", tree)
          for name, tree in params.items()}


def make_optimizer(config) -> optim_lib.Optimizer:
  """AdamW for a reward model: the backbone at the optimizer's rate, the head at
  `reward_model.head_learning_rate` (from zero, the backbone's rate would take hundreds
  of steps to give the rewards any scale)."""
  return optim_lib.make_optimizer(
      total_updates=config.steps * config.minibatches, **config.optimizer,
      groups={"head": {"learning_rate": config.reward_model.head_learning_rate}},
      label_fn=head_labels)


def init_state(config, model: zoo.Model, optimizer: optim_lib.Optimizer) -> RMState:
  """A fresh reward model on a copy of the policy model's backbone, and its optimizer state."""
  params = rm_lib.init(model.params, jax.random.key(config.seed), model.cfg,
                       head_scale=config.reward_model.head_scale)
  return RMState(params=params, opt_state=optimizer.tx.init(params),
                 updates=jnp.zeros((), jnp.int32))


class RewardModelTrainer:
  """Bradley-Terry training of an outcome reward model: harness callbacks over jitted steps."""

  def __init__(self, config, model: zoo.Model, train_pairs, held_pairs, candidates):
    self.config, self.model = config, model
    self.s = s = settings_from_config(config, model.cfg)
    self.held_pairs, self.candidates = held_pairs, candidates
    self.optimizer = make_optimizer(config)
    loss = functools.partial(bt_loss, cfg=model.cfg, s=s)
    self._update = jax.jit(functools.partial(
        optim_lib.update_state, self.optimizer, loss, epochs=1, minibatches=config.minibatches),
        donate_argnums=0)
    self._score = jax.jit(functools.partial(rewards_of, cfg=model.cfg, s=s))
    self.read_answer = preference_data.ANSWER_READERS.get(config.grader)
    self.data = make_loader(train_pairs, batch_size=config.pairs_per_step, seed=config.seed)
    self.mesh = sharding.for_config(config)

  def init_state(self) -> RMState:
    return init_state(self.config, self.model, self.optimizer)

  def train_step(self, state: RMState, rng, progress: float) -> harness.StepResult:
    pairs = next(self.data)
    batch, truncated = pair_batch(self.model.tokenizer, pairs, self.s)
    state, record = common.supervised_update(self._update, self.mesh, state, batch, rng,
                                             progress, truncated)
    samples = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}
               for p in pairs]
    return harness.StepResult(state=state, record=record, samples=samples)

  def evaluate(self, state: RMState) -> tuple[dict, list[dict]]:
    tok, bs = self.model.tokenizer, self.config.score_batch_size
    held = self.held_pairs
    prompts = [p["prompt"] for p in held]
    score = functools.partial(learned.score_texts, self._score, state.params, tok,
                              max_len=self.s.max_len, chat=self.s.chat, system=self.s.system,
                              batch_size=bs)
    chosen = score(prompts, [p["chosen"] for p in held])
    rejected = score(prompts, [p["rejected"] for p in held])
    record = rm_lib.pair_calibration(chosen - rejected)
    record["num_pairs"] = len(held)
    record.update(accuracy_by_source(held, chosen - rejected))
    samples = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"],
                "chosen_reward": float(c), "rejected_reward": float(r)}
               for p, c, r in zip(held, chosen, rejected, strict=True)]
    if self.candidates:
      flat_prompts = [c["prompt"] for c in self.candidates for _ in c["replies"]]
      flat_replies = [reply for c in self.candidates for reply in c["replies"]]
      n = len(self.candidates[0]["replies"])
      rewards = score(flat_prompts, flat_replies).reshape(-1, n)
      answers = None
      if self.read_answer is not None:
        answers = [[self.read_answer(reply) for reply in c["replies"]]
                   for c in self.candidates]
      record.update(best_of_n.selection_accuracy(
          rewards, [c["correct"] for c in self.candidates],
          greedy_correct=[c["greedy_correct"] for c in self.candidates], answers=answers,
          vote_temperature=self.config.vote_temperature))
    return record, samples

  def nonfinite_count(self, state) -> tuple[int, int]:
    return optim_lib.nonfinite_count(state)


def check_frozen_layers_decay(config) -> None:
  """Weight decay would shrink the frozen layers too (they get no gradient, not no update)."""
  if config.reward_model.frozen_layers and config.optimizer.weight_decay:
    raise ValueError("optimizer.weight_decay > 0 would shrink the frozen layers too; set it to "
                     "0 or reward_model.frozen_layers to 0")


def validate(config) -> None:
  harness.validate_run_keys(config)
  preference_data.validate(config)
  check_frozen_layers_decay(config)
  if config.vote_temperature <= 0:
    raise ValueError(f"vote_temperature must be > 0, got {config.vote_temperature}")


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) reward-model training in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  settings_from_config(config, model.cfg)  # before the pairs are generated
  train_pairs, held_pairs, candidates = preference_data.load_data(config, model, workdir,
                                                                  progress)
  trainer = RewardModelTrainer(config, model, train_pairs, held_pairs, candidates)
  return harness.run(config, workdir, init_state=trainer.init_state,
                     train_step=trainer.train_step,
                     evaluate=trainer.evaluate, data=trainer.data,
                     nonfinite_count=trainer.nonfinite_count, postfix=("loss", "accuracy"),
                     finite_keys=(), progress=progress, resume_rules=common.RESUME_RULES)


if __name__ == "__main__":
  # Large temporaries: a step on 16 SmolLM2 pairs 5.0-5.2 -> 4.7-4.8 s
  # (docs/train_step.md#freed-host-memory).
  common.main(train, host_memory="retain")
