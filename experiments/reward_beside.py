r"""A reward model trained beside the policy, on pairs of the policy's own fresh replies.

  python -m experiments.grpo --config=experiments/configs/grpo_arithmetic.py:reward_model_beside \
      --config.rewards.reward_model.workdir=runs/rm_arithmetic --workdir=runs/grpo_rm_beside

A reward model frozen at the start of RL is gamed: the policy drifts to
replies it overrates, which it never saw during its training (docs/reward_models.md,
"GRPO with the reward model as its only reward"). Trained beside the policy, it
sees those replies. Each GRPO step:

  1. the reward model of the train state scores the step's replies: that is
     the policy's reward (its component "reward_model", weighted as in
     config.rewards, added to any verifiable rewards);
  2. up to `pairs_per_step` pairs (preferred reply, other reply to the same
     prompt) are drawn from the same replies, labelled by `labels`:
       "grader"    the experiment's grader: a reply it accepts is preferred to
                   one it rejects (an oracle labeller, as in online RLHF);
       "majority"  no verifier at all: a reply stating the group's most common
                   answer is preferred to one that does not (test-time RL's
                   pseudo-label; needs a grader with an answer reader);
  3. the reward model takes one Bradley-Terry step on them.

The reward model starts from the run named in config.rewards.reward_model
(its workdir and checkpoint step) and its pooling, frozen layers and length
limit; its parameters and optimizer state live in the GRPO train state, so a
resume continues it exactly. The step's pairs are scored by the reward model
before it trains on them: "reward_model/fresh_pair_accuracy" is its accuracy
on replies it has never seen, the online counterpart of the held-out pair
accuracy.

Settings (config.reward_model_beside): pairs_per_step (0: off, the reward model
stays frozen), labels, learning_rate (backbone above the frozen layers),
head_learning_rate.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common, preference_data
from experiments import reward_model as rm_trainer
from jaxrl_agents import types
from jaxrl_agents.objectives import losses
from jaxrl_agents.rewards import learned
from jaxrl_agents.rollout import single_turn
from jaxrl_agents.train import optim as optim_lib

LABELS = ("grader", "majority")
NAME = "reward_model"  # the reward it trains: config.rewards' entry of this name


enabled = common.trains_reward_model

def validate(config) -> None:
  """Fails naming the problem before anything loads (a no-op when it is off)."""
  if not enabled(config):
    return
  b = config.reward_model_beside
  if NAME not in config.rewards:
    raise ValueError(f"reward_model_beside trains the {NAME!r} reward: add "
                     f"{{'{NAME}': {{'workdir': RUN}}}} to config.rewards (RUN: the reward "
                     "model to start from)")
  if b.labels not in LABELS:
    raise ValueError(f"reward_model_beside.labels must be one of {LABELS}, got {b.labels!r}")
  if b.labels == "majority" and config.grader not in preference_data.ANSWER_READERS:
    raise ValueError(f"reward_model_beside.labels='majority' reads each reply's answer; grader "
                     f"{config.grader!r} has no answer reader "
                     f"({sorted(preference_data.ANSWER_READERS)})")
  for key in ("learning_rate", "head_learning_rate"):
    if not b[key] > 0:
      raise ValueError(f"reward_model_beside.{key} must be > 0, got {b[key]}")
  if config.get("env"):
    raise ValueError("reward_model_beside scores single-turn replies; an environment run's "
                     "reward is its return")
  if config.get("overlap", False):
    raise ValueError("reward_model_beside rescored replies with the train state's reward "
                     "model; the overlapped rollout has none: set overlap=False")
  mesh = config.get("mesh", None)
  if mesh and any(mesh[k] != 1 for k in mesh):
    raise ValueError("reward_model_beside runs on one device: set mesh to all 1")
  shaping = config.get("reward_shaping", None)
  if shaping and shaping.name != "none":
    raise ValueError("reward_model_beside: reward_shaping shapes the collector's rewards, "
                     "before the reward model scores them: set reward_shaping.name='none'")
  options = config.rewards[NAME]
  if hasattr(options, "items") and options.get("aggregate", ""):
    raise ValueError("reward_model_beside trains an outcome reward model; 'aggregate' is a "
                     "process reward model's")


@dataclasses.dataclass(frozen=True)
class Pairs:
  """The step's labelled pairs, as row indices into the rollout."""
  chosen: np.ndarray  # int[N]
  rejected: np.ndarray  # int[N]
  graded_right: np.ndarray  # bool[N]: the grader accepts chosen and rejects rejected


def preferred_rows(labels: str, completions: Sequence[str], correct: np.ndarray,
                   group_size: int, read_answer=None) -> list[tuple[list[int], list[int]]]:
  """Per group, (rows preferred, rows not), each text counted once.

  "grader": the rows the grader accepts against those it rejects. "majority":
  the rows stating the group's most common answer (strictly more common than
  any other, and stated by at least two rows) against the rest; a group without
  such an answer gives no pair.
  """
  out = []
  for g in range(len(completions) // group_size):
    rows = range(g * group_size, (g + 1) * group_size)
    if labels == "grader":
      good = [i for i in rows if correct[i] > 0.5]
    else:
      answers = {i: read_answer(completions[i]) for i in rows}
      counts = collections.Counter(a for a in answers.values() if a is not None).most_common(2)
      if not counts or counts[0][1] < 2 or (len(counts) > 1 and counts[1][1] == counts[0][1]):
        out.append(([], []))
        continue
      good = [i for i in rows if answers[i] == counts[0][0]]
    good_texts = {completions[i] for i in good}
    bad = [i for i in rows if i not in good and completions[i] not in good_texts]
    out.append((_distinct(good, completions), _distinct(bad, completions)))
  return out


def _distinct(rows: list[int], texts: Sequence[str]) -> list[int]:
  seen, out = set(), []
  for i in rows:
    if texts[i] not in seen:
      seen.add(texts[i])
      out.append(i)
  return out


def draw_pairs(groups: list[tuple[list[int], list[int]]], correct: np.ndarray, limit: int,
               seed: int) -> Pairs:
  """Up to `limit` (preferred, other) row pairs, taken from the groups in turn (each group's
  combinations shuffled) so that one group cannot fill the step."""
  rng = random.Random(seed)
  pools = []
  for good, bad in groups:
    combos = [(c, r) for c in good for r in bad]
    rng.shuffle(combos)
    if combos:
      pools.append(combos)
  picked = []
  while pools and len(picked) < limit:
    for pool in pools:
      if pool and len(picked) < limit:
        picked.append(pool.pop())
    pools = [p for p in pools if p]
  chosen = np.asarray([c for c, _ in picked], np.int64)
  rejected = np.asarray([r for _, r in picked], np.int64)
  right = (correct[chosen] > 0.5) & (correct[rejected] <= 0.5) if picked else np.zeros(0, bool)
  return Pairs(chosen=chosen, rejected=rejected, graded_right=right)


def weighted_bt_loss(params, batch, *, cfg, s: rm_trainer.RMSettings):
  """Bradley-Terry loss of (PairBatch, f32[N] weights): weight 0 marks a padding pair."""
  pairs, weights = batch
  chosen, rejected = rm_trainer.pair_rewards(params, pairs, cfg=cfg, s=s)
  return losses.bradley_terry_loss(chosen, rejected, margin=s.margin, weights=weights)


class RewardModelBeside:
  """The reward model's state, scoring and training steps inside a GRPO run."""

  def __init__(self, config):
    b = config.reward_model_beside
    options = config.rewards[NAME]
    options = dict(options.items()) if hasattr(options, "items") else {"weight": options}
    self.weight = float(options.get("weight", 1.0))
    self.reward = learned.load(options["workdir"], int(options.get("batch_size", 32)),
                               int(options.get("step", 0)))
    if self.reward.process:
      raise ValueError(f"reward_model_beside trains an outcome reward model; "
                       f"{options['workdir']} is a process reward model")
    self.template = options.get("prompt_template") or config.prompt_template
    self.labels, self.pairs_per_step = b.labels, int(b.pairs_per_step)
    self.read_answer = preference_data.ANSWER_READERS.get(config.grader)
    self.group_size = config.group_size
    self.s = rm_trainer.settings_from_config(ml_collections.ConfigDict(self.reward.config),
                                             self.reward.cfg)
    self.optimizer = optim_lib.make_optimizer(
        learning_rate=b.learning_rate, total_updates=config.steps, grad_clip=1.0,
        groups={"head": {"learning_rate": b.head_learning_rate}},
        label_fn=rm_trainer.head_labels)
    loss = functools.partial(weighted_bt_loss, cfg=self.reward.cfg, s=self.s)
    self._update = jax.jit(functools.partial(optim_lib.update_state, self.optimizer, loss,
                                             epochs=1, minibatches=1), donate_argnums=0)

  def init_state(self) -> rm_trainer.RMState:
    params = jax.tree.map(jnp.copy, self.reward.params)  # the loaded model stays as it was
    return rm_trainer.RMState(params=params, opt_state=self.optimizer.tx.init(params),
                              updates=jnp.zeros((), jnp.int32))

  def score(self, state: rm_trainer.RMState, examples, completions: Sequence[str]) -> np.ndarray:
    """f32[B] the reward model's scores of the replies to the prompts the policy saw."""
    r = self.reward
    return learned.score_texts(r._score, state.params, r.tokenizer,
                               single_turn.format_prompts(examples, self.template), completions,
                               max_len=r.max_len, chat=r.chat, system=r.system,
                               batch_size=r.batch_size)

  def scored_rollout(self, state: rm_trainer.RMState, r: types.Rollout, rng
                     ) -> tuple[types.Rollout, dict[str, float]]:
    """The rollout with this model's scores (times its weight) added to its rewards, and
    what the step's pairs (drawn from `rng`) say of the model before it trains on them."""
    scores = self.score(state, r.examples, r.completions)
    total = r.rewards + self.weight * scores
    r = dataclasses.replace(r, traj=types.with_outcome(r.traj, total), rewards=total,
                            components={**r.components, NAME: scores})
    return r, fresh_metrics(scores, self.pairs(r.completions, r.correct, _seed(rng)))

  def pairs_batch(self, r: types.Rollout, rng):
    """The batch of the pairs `scored_rollout` measured (the same `rng`), or None if none."""
    pairs = self.pairs(r.completions, r.correct, _seed(rng))
    return self.batch(r.examples, r.completions, pairs) if len(pairs.chosen) else None

  def pairs(self, completions: Sequence[str], correct: np.ndarray, seed: int) -> Pairs:
    groups = preferred_rows(self.labels, completions, correct, self.group_size,
                            self.read_answer)
    return draw_pairs(groups, correct, self.pairs_per_step, seed)

  def batch(self, examples, completions: Sequence[str], pairs: Pairs):
    """(PairBatch padded to pairs_per_step rows with weight-0 copies of the first pair,
    f32[pairs_per_step] weights): one shape per width bucket, whatever the step drew."""
    n, k = len(pairs.chosen), self.pairs_per_step
    prompts = single_turn.format_prompts([examples[i] for i in pairs.chosen], self.template)
    rows = [{"prompt": p, "chosen": completions[c], "rejected": completions[r]}
            for p, c, r in zip(prompts, pairs.chosen, pairs.rejected, strict=True)]
    rows += [rows[0]] * (k - n)
    batch, _ = rm_trainer.pair_batch(self.reward.tokenizer, rows, self.s)
    return batch, jnp.asarray(np.arange(k) < n, jnp.float32)

  def update(self, state: rm_trainer.RMState, batch, rng, progress):
    """One Bradley-Terry step: (state, metrics under "reward_model/")."""
    state, metrics = self._update(state, batch, rng, jnp.float32(progress))
    # Its accuracy and margin on these pairs are fresh_metrics' (scored before the step).
    return state, {f"{NAME}/loss": metrics["loss"], f"{NAME}/grad_norm": metrics["grad_norm"],
                   f"{NAME}/skipped_updates": state.opt_state.total_notfinite}


def _seed(rng) -> int:
  """A Python int seed from a step's key (the pair draw)."""
  return int(jax.random.randint(rng, (), 0, 2**31 - 1))


def fresh_metrics(scores: np.ndarray, pairs: Pairs) -> dict[str, float]:
  """What the step's pairs say about the reward model before it trains on them: its accuracy
  and mean margin on them (a tie counts half), and how many of their labels the grader
  agrees with (1 with labels "grader")."""
  out = {f"{NAME}/pairs": float(len(pairs.chosen))}
  if len(pairs.chosen):
    margins = scores[pairs.chosen] - scores[pairs.rejected]
    out[f"{NAME}/fresh_pair_accuracy"] = float(np.mean((margins > 0) + 0.5 * (margins == 0)))
    out[f"{NAME}/fresh_pair_margin"] = float(margins.mean())
    out[f"{NAME}/label_accuracy"] = float(pairs.graded_right.mean())
  return out
