r"""Preference optimization of the policy against a frozen reference: DPO, IPO, RPO, CPL.

  python -m experiments.dpo --config=experiments/configs/dpo_arithmetic.py:tiny \
      --workdir=/tmp/dpo_tiny

Each step takes `pairs_per_step` pairs (`experiments.preference_data`: JSONL,
or generated from a task's verifier), scores both replies under the policy
and the frozen initial policy (the reference), and minimizes the loss named by
`config.loss`, with its own hyperparameters in `config.loss_kwargs.<loss>`:

  dpo   -log sigmoid(beta * (log-ratio(chosen) - log-ratio(rejected)))  (label_smoothing)
  ipo   (log-ratio gap - 1 / (2 tau))^2
  rpo   DPO + eta * the chosen reply's mean per-token NLL
  cpl   -log sigmoid(alpha * (S(chosen) - S(rejected))), S a discounted sum of the
        policy's log-probs (no reference)

(`jaxrl_agents.objectives.losses.preference` has the equations and the papers.) A reply's
log-probability sums its tokens and its closing token, given the prompt
through the chat template.

Evaluation: on held-out pairs, the accuracy, mean and calibration of the
implicit reward margin (beta or tau times the log-ratio gap; alpha times the
score gap for CPL); with generated pairs, also the policy's greedy accuracy on
the held-out questions, the measure that counts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, preference_data
from jaxrl_agents import data as data_lib
from jaxrl_agents.data import make_loader, preferences
from jaxrl_agents.models import lora, zoo
from jaxrl_agents.models import reward_model as rm_lib
from jaxrl_agents.objectives import losses
from jaxrl_agents.objectives.losses import preference as preference_lib
from jaxrl_agents.parallel import distributed, sharding
from jaxrl_agents.rollout import scoring
from jaxrl_agents.train import harness
from jaxrl_agents.train import optim as optim_lib

LOSSES = ("dpo", "ipo", "rpo", "cpl")
_LOSS_FNS = {"dpo": losses.dpo_loss, "ipo": losses.ipo_loss, "rpo": losses.rpo_loss,
             "cpl": losses.cpl_loss}
# The hyperparameter that scales each loss's implicit reward (its margin's units).
MARGIN_SCALE = {"dpo": "beta", "ipo": "tau", "rpo": "beta", "cpl": "alpha"}


class DPOState(NamedTuple):
  """The policy being trained. The reference (the initial policy) is the model as loaded, so it
  is not checkpointed: a resume loads it again."""
  params: Any
  opt_state: Any
  updates: jax.Array


class PairBatch(NamedTuple):
  """N pairs: each side's tokens int32[N, W] and mask bool[N, W], its response mask bool[N, R]
  over the last R columns (`preferences.reply_tail`), and the reference's sequence
  log-probs f32[N]."""
  chosen: jax.Array
  chosen_mask: jax.Array
  chosen_response: jax.Array
  rejected: jax.Array
  rejected_mask: jax.Array
  rejected_response: jax.Array
  ref_chosen_logp: jax.Array
  ref_rejected_logp: jax.Array


@dataclasses.dataclass(frozen=True)
class DPOSettings:
  loss: str
  loss_kwargs: tuple[tuple[str, float], ...]
  max_len: int
  chat: bool
  system: str | None

  @property
  def kwargs(self) -> dict[str, float]:
    return dict(self.loss_kwargs)


def settings_from_config(config) -> DPOSettings:
  if config.loss not in LOSSES:
    raise ValueError(f"config.loss must be one of {LOSSES}, got {config.loss!r}")
  kwargs = dict(config.loss_kwargs.get(config.loss, {}))
  accepted = set(inspect.signature(_LOSS_FNS[config.loss]).parameters) - {
      "chosen_logp", "rejected_logp", "ref_chosen_logp", "ref_rejected_logp", "chosen_nll",
      "chosen_mask", "rejected_mask"}
  unknown = sorted(set(kwargs) - accepted)
  if unknown:
    raise ValueError(f"loss_kwargs.{config.loss}: unknown setting(s) {unknown}; "
                     f"{config.loss} takes {sorted(accepted)}")
  return DPOSettings(loss=config.loss, loss_kwargs=tuple(sorted(kwargs.items())),
                     max_len=int(config.max_len), chat=bool(config.chat),
                     system=config.system_prompt or None)


def _both_sides(params, batch: PairBatch, cfg):
  """Per-token log-probs of (chosen, rejected), both sides in one forward pass."""
  lp = scoring.reply_logprobs(params, jnp.concatenate([batch.chosen, batch.rejected]),
                      jnp.concatenate([batch.chosen_mask, batch.rejected_mask]),
                      jnp.concatenate([batch.chosen_response, batch.rejected_response]), cfg=cfg)
  n = batch.chosen.shape[0]
  return lp[:n], lp[n:]


def reference_logprobs(ref_params, batch: PairBatch, *, cfg):
  """(f32[N], f32[N]) the reference's sequence log-probs of the chosen and rejected replies."""
  c, r = _both_sides(ref_params, batch, cfg)
  return c.sum(axis=1), r.sum(axis=1)


def preference_loss(params, batch: PairBatch, *, cfg, s: DPOSettings):
  """The configured loss on one (mini)batch of pairs: (loss, metrics with "implicit_margin")."""
  c_tok, r_tok = _both_sides(params, batch, cfg)
  c, r = c_tok.sum(axis=1), r_tok.sum(axis=1)
  refs = (batch.ref_chosen_logp, batch.ref_rejected_logp)
  kw = s.kwargs
  if s.loss == "dpo":
    loss, metrics = losses.dpo_loss(c, r, *refs, **kw)
  elif s.loss == "ipo":
    loss, metrics = losses.ipo_loss(c, r, *refs, **kw)
  elif s.loss == "rpo":
    # The chosen reply's mean per-token NLL (TRL's rpo_alpha form).
    nll = -c / jnp.maximum(batch.chosen_response.sum(axis=1), 1)
    loss, metrics = losses.rpo_loss(c, r, *refs, nll, **kw)
  else:
    loss, metrics = losses.cpl_loss(c_tok, r_tok, batch.chosen_response,
                                    batch.rejected_response, **kw)
  return loss, {**metrics, "chosen_logp": c.mean(), "rejected_logp": r.mean()}


def implicit_margins(params, batch: PairBatch, *, cfg, s: DPOSettings) -> jax.Array:
  """f32[N]: each pair's implicit reward margin (the quantity the loss pushes up)."""
  c_tok, r_tok = _both_sides(params, batch, cfg)
  scale = s.kwargs.get(MARGIN_SCALE[s.loss], _default(s.loss, MARGIN_SCALE[s.loss]))
  if s.loss == "cpl":
    gamma = s.kwargs.get("gamma", _default("cpl", "gamma"))
    score = functools.partial(preference_lib.discounted_logp_sum, gamma=gamma)
    return scale * (score(c_tok, batch.chosen_response) - score(r_tok, batch.rejected_response))
  gap = (c_tok.sum(1) - batch.ref_chosen_logp) - (r_tok.sum(1) - batch.ref_rejected_logp)
  return scale * gap


def _default(loss: str, name: str) -> float:
  """A loss function's default for one of its hyperparameters."""
  return inspect.signature(_LOSS_FNS[loss]).parameters[name].default


class PreferenceTrainer:
  """Offline preference optimization of the policy: harness callbacks over jitted steps."""

  def __init__(self, config, model: zoo.Model, train_pairs, held_pairs, candidates):
    self.config, self.model = config, model
    self.s = s = settings_from_config(config)
    self.held_pairs, self.candidates = held_pairs, candidates
    # The frozen initial policy (unused by CPL); with LoRA its base, adapters off.
    self.ref_params = lora.reference_params(model.params)
    self.optimizer = optim_lib.make_optimizer(total_updates=config.steps * config.minibatches,
                                              **config.optimizer)
    loss = functools.partial(preference_loss, cfg=model.cfg, s=s)
    self._update = jax.jit(functools.partial(
        optim_lib.update_state, self.optimizer, loss, epochs=1, minibatches=config.minibatches),
        donate_argnums=0)
    self._reference = jax.jit(functools.partial(reference_logprobs, cfg=model.cfg))
    self._margins = jax.jit(functools.partial(implicit_margins, cfg=model.cfg, s=s))
    self.data = make_loader(train_pairs, batch_size=config.pairs_per_step, seed=config.seed)
    self.mesh = sharding.for_config(config)
    self._held_batches = None

  def init_state(self) -> DPOState:
    params = jax.tree.map(jnp.copy, self.model.params)
    return DPOState(params=params, opt_state=self.optimizer.tx.init(params),
                    updates=jnp.zeros((), jnp.int32))

  def batch(self, pairs: Sequence[Mapping[str, Any]]) -> tuple[PairBatch, int]:
    c, r = preferences.encode_pairs(self.model.tokenizer, pairs, max_len=self.s.max_len,
                                    chat=self.s.chat, system=self.s.system)
    # Log-probs are needed at the reply columns only: both sides' last R (one R for both).
    tail = preferences.reply_tail(np.concatenate([c.response, r.response]))
    c_reply, r_reply = tail[:len(pairs)], tail[len(pairs):]
    arrays = [jnp.asarray(x) for x in (c.tokens, c.mask, c_reply, r.tokens, r.mask, r_reply)]
    zeros = jnp.zeros((len(pairs),), jnp.float32)
    batch = PairBatch(*arrays, zeros, zeros)
    if self.s.loss != "cpl":
      batch = batch._replace(**dict(zip(("ref_chosen_logp", "ref_rejected_logp"),
                                        self._reference(self.ref_params, batch), strict=True)))
    return batch, int(c.truncated.sum() + r.truncated.sum())

  def train_step(self, state: DPOState, rng, progress: float) -> harness.StepResult:
    pairs = next(self.data)
    batch, truncated = self.batch(pairs)
    state, record = common.supervised_update(self._update, self.mesh, state, batch, rng,
                                             progress, truncated)
    samples = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}
               for p in pairs]
    return harness.StepResult(state=state, record=record, samples=samples)

  def held_batches(self) -> list[tuple[PairBatch, int]]:
    """The held-out pairs as batches of score_batch_size (the last padded) with the
    reference's log-probs, made once: (batch, real rows)."""
    if self._held_batches is None:
      bs, held = self.config.score_batch_size, self.held_pairs
      self._held_batches = [(self.batch(padded)[0], n)
                            for _, n, padded in data_lib.padded_batches(held, bs)]
    return self._held_batches

  def evaluate(self, state: DPOState) -> tuple[dict, list[dict]]:
    held = self.held_pairs
    margins = np.concatenate([distributed.to_host(self._margins(state.params, batch))[:rows]
                              for batch, rows in self.held_batches()])
    record = {**rm_lib.pair_calibration(margins), "num_pairs": len(held)}
    if self.candidates:
      record["greedy_accuracy"] = preference_data.greedy_accuracy(
          state.params, self.model, self.candidates, self.config)
    samples = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"],
                "implicit_margin": float(m)} for p, m in zip(held, margins, strict=True)]
    return record, samples

  def nonfinite_count(self, state) -> tuple[int, int]:
    return optim_lib.nonfinite_count(state)


def validate(config) -> None:
  harness.validate_run_keys(config)
  settings_from_config(config)
  if config.max_len < 8:
    raise ValueError(f"max_len must be >= 8 tokens, got {config.max_len}")
  preference_data.validate(config)


def train(config, workdir: str, progress: bool = True) -> dict:
  """Runs (or resumes) preference optimization in `workdir`; returns the last eval record."""
  validate(config)
  model = common.load_model(config)
  train_pairs, held_pairs, candidates = preference_data.load_data(config, model, workdir,
                                                                  progress)
  trainer = PreferenceTrainer(config, model, train_pairs, held_pairs, candidates)
  return harness.run(config, workdir, init_state=trainer.init_state,
                     train_step=trainer.train_step,
                     evaluate=trainer.evaluate, data=trainer.data,
                     nonfinite_count=trainer.nonfinite_count, postfix=("loss",),
                     progress=progress, resume_rules=common.RESUME_RULES,
                     # the reference is the model as loaded, not part of the checkpoint
                     frozen={f"reference ({config.model})": trainer.ref_params})


if __name__ == "__main__":
  # Large temporaries: a step on 16 SmolLM2 pairs 14.5-15.4 -> 12.1-12.6 s
  # (docs/train_step.md#freed-host-memory).
  common.main(train, host_memory="retain")
