"""Per-token log-probabilities (and entropies) of a Trajectory's policy tokens.

Training recomputes the log-probabilities of exactly the sampled tokens with
one forward pass over the whole stream; the old-policy and reference
log-probabilities use this same function, so sampling numerics never leak
into importance ratios.

Layout (`types.Trajectory`): the prompt is left-padded to Lp columns; the
N = T - Lp columns after it hold the turns. Each is predicted by the hidden
state of the last valid column before it (`predictor_columns`). Vocabulary
logits are computed only for the scored columns (`scored_columns`): the
reply blocks of a multi-turn Trajectory (its `reply_spans`), else all N.
Results come back over all T columns, zeros elsewhere (`to_stream`), so
every array of the update lines up with the Trajectory's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.models import lm
from jaxrl_agents.objectives.losses.entropy import softmax_terms
from jaxrl_agents.rollout import shapes
from jaxrl_agents.types import Trajectory


def predictor_columns(valid: jax.Array, prompt_width: int) -> jax.Array:
  """int32[B, N]: for each column Lp + j after the prompt, the last valid column before it.

  The hidden state there predicts the token at Lp + j. In a stream without
  gaps that is Lp + j - 1; fixed-width turn blocks leave invalid columns
  between a turn and the next, which attention skips and prediction must too.
  A left-padded prompt ends on a valid column, so the result is >= Lp - 1.
  """
  t = valid.shape[1]
  last_valid = jax.lax.cummax(jnp.where(valid, jnp.arange(t, dtype=jnp.int32), -1), axis=1)
  return last_valid[:, prompt_width - 1:t - 1]


def scored_columns(traj: Trajectory) -> np.ndarray:
  """int[C] (static): the columns whose tokens get logits, in order (see the module docstring)."""
  if not traj.reply_spans:
    return np.arange(traj.prompt_width, traj.tokens.shape[1])
  return np.concatenate([np.arange(start, start + width) for start, width in traj.reply_spans])


def scored(traj: Trajectory, x: jax.Array) -> jax.Array:
  """[B, T, ...] -> [B, C, ...]: the scored columns of a stream-aligned array."""
  if not traj.reply_spans:
    return x[:, traj.prompt_width:]
  return x[:, scored_columns(traj)]


def to_stream(x: jax.Array, traj: Trajectory) -> jax.Array:
  """f32[B, C] values of the scored columns -> f32[B, T], zeros on every other column."""
  if not traj.reply_spans:
    return jnp.pad(x, ((0, 0), (traj.prompt_width, 0)))
  out = jnp.zeros(traj.tokens.shape, x.dtype)
  return out.at[:, scored_columns(traj)].set(x)


def policy_hidden(params, cfg: lm.CausalLM, traj: Trajectory, *,
                  group_size: int = 1) -> jax.Array:
  """Final hidden states f[B, C, D] that predict each scored column (`scored_columns`).

  With group_size G > 1, rows come in groups of G consecutive rows that share
  one prompt (the rollout's layout): each distinct prompt is run once, its
  KV cache repeated for its G rows, and only the columns after it go through
  the model per row. The result equals the G = 1 full forward (the same
  attention, over the same keys) for a fraction of the prompt's cost, in the
  forward and in the backward pass (the gradient through the repeated cache
  sums over the group). A model with `apply_shared_prefix` (the project's
  transformer) does this in one pass (off a mesh, replies longer than one
  token), the prompts' and replies' tokens through
  each layer together; others prefill the prompts, then run the replies
  against the repeated cache.
  """
  lp, t = traj.prompt_width, traj.tokens.shape[1]
  n = t - lp
  positions = lm.positions_from_mask(traj.valid)
  segments = traj.valid.astype(jnp.int32)
  if group_size == 1:
    hidden, _ = cfg.apply(params, traj.tokens, positions, segment_ids=segments,
                                  return_hidden=True, num_positions=t)
    hidden = hidden[:, lp - 1: t - 1]
  else:
    b = traj.tokens.shape[0]
    if group_size < 1 or b % group_size:
      raise ValueError(f"batch of {b} rows is not a whole number of groups of {group_size}")
    prompt_valid = traj.valid[::group_size, :lp]
    if n > 1 and _one_pass(cfg):
      prompt_hidden, rest = cfg.apply_shared_prefix(
          params, traj.tokens[::group_size, :lp], lm.positions_from_mask(prompt_valid),
          prompt_valid.astype(jnp.int32), traj.tokens[:, lp:-1], positions[:, lp:-1],
          segments[:, lp:-1], group_size=group_size, num_positions=t)
      hidden = jnp.concatenate([jnp.repeat(prompt_hidden[:, -1:], group_size, axis=0), rest], 1)
      return _predictors(hidden, traj)
    prompt_hidden, cache = cfg.apply(
        params, traj.tokens[::group_size, :lp], lm.positions_from_mask(prompt_valid),
        segment_ids=prompt_valid.astype(jnp.int32), return_hidden=True, new_cache_len=t - 1,
        num_positions=lp)
    # The last prompt column predicts the first column after it; the last
    # column is never an input.
    hidden = jnp.repeat(prompt_hidden[:, -1:], group_size, axis=0)
    if n > 1:
      rest, _ = cfg.apply(
          params, traj.tokens[:, lp:-1], positions[:, lp:-1],
          segment_ids=segments[:, lp:-1], cache=lm.repeat_cache(cache, group_size),
          return_hidden=True, num_positions=t)
      hidden = jnp.concatenate([hidden, rest], axis=1)
  return _predictors(hidden, traj)


def _one_pass(cfg: lm.CausalLM) -> bool:
  """Whether the model scores shared prompts in one pass (`apply_shared_prefix`, optional in
  the contract). Not on a mesh: the pass runs all tokens as one row, which the mesh's
  row sharding cannot split; the prefill-then-cache pair keeps rows apart."""
  return hasattr(cfg, "apply_shared_prefix") and cfg.activation_mesh is None


def _predictors(hidden: jax.Array, traj: Trajectory) -> jax.Array:
  """f[B, N, D] hidden states from the prompt's last column on -> those predicting each scored
  column, f[B, C, D]."""
  lp = traj.prompt_width
  rows = predictor_columns(traj.valid, lp) - (lp - 1)
  if traj.reply_spans:
    rows = rows[:, scored_columns(traj) - lp]
  return jnp.take_along_axis(hidden, rows[..., None], axis=1)


class Packing(NamedTuple):
  """Where the packed policy tokens of a batch sit: `index` int32[M] flat indices into
  the [B, C] scored columns (B * C marks an empty slot), `valid` bool[M], and `complete`
  bool[]: whether every policy token and kept input had a slot (`packed_slots`
  bounds them; False means the values are wrong, and a loss should not be used)."""

  index: jax.Array
  valid: jax.Array
  complete: jax.Array


def can_pack(cfg: lm.CausalLM, traj: Trajectory, group_size: int) -> bool:
  """Whether `packed_policy_logits` applies: rows in groups sharing a prompt, one reply
  block per row (no `reply_spans`), a model with `apply_shared_prefix` off a mesh (and
  its `keep` argument: the project's transformer)."""
  return (group_size > 1 and not traj.reply_spans and
          traj.tokens.shape[1] - traj.prompt_width > 1 and _one_pass(cfg))


def _kept_inputs(traj: Trajectory) -> jax.Array:
  """bool[B, N - 1]: the reply inputs (columns Lp .. T-2) a packed pass runs: the valid
  ones before each row's last policy token (every key its predictions attend to)."""
  lp = traj.prompt_width
  policy = traj.policy_mask[:, lp:]
  columns = jnp.arange(policy.shape[1])
  last = jnp.max(jnp.where(policy, columns, -1), axis=1, keepdims=True)
  return traj.valid[:, lp:-1] & (columns[:-1] < last)


def packed_slots(traj: Trajectory, *, rows: int, group_size: int,
                 rounding: Callable[[int], int] = shapes.half_octave) -> int:
  """Slots M (static) for packed scoring of any `rows` rows of whole groups of `traj`.

  M bounds both the policy tokens and the reply inputs a packed pass runs
  (`_kept_inputs`) in the `rows` rows that hold the most, so a shuffled
  minibatch always fits; rounded up by `rounding` (few compiled shapes) and at
  most rows x N. Host-side (numpy), before the update.
  """
  lp, n = traj.prompt_width, traj.tokens.shape[1] - traj.prompt_width
  counts = (np.asarray(traj.policy_mask)[:, lp:].sum(1), np.asarray(_kept_inputs(traj)).sum(1))
  groups = rows // group_size
  bound = max(int(np.sort(c.reshape(-1, group_size).sum(1))[::-1][:groups].sum())
              for c in counts)
  return int(min(rounding(max(bound, 1)), rows * n))


def packed_policy_hidden(params, cfg: lm.CausalLM, traj: Trajectory, *, group_size: int,
                         slots: int) -> tuple[jax.Array, Packing]:
  """Final hidden states f[M, D] predicting each policy token, packed (`Packing` says where
  each sits), computed over the reply tokens that need running only.

  The same values as `policy_hidden` at the policy tokens (`can_pack` must hold):
  the prompts go through `apply_shared_prefix` once per group as there, and of
  the replies only the kept inputs (`_kept_inputs`), packed into `slots`
  positions of one stream, so a batch pays for its reply tokens, not for B
  times the longest reply. `slots` must be at least the policy tokens and the
  kept inputs (`packed_slots`); a slot beyond them is empty.
  """
  if group_size < 2 or traj.reply_spans:
    raise ValueError("packed scoring needs rows in groups that share a prompt (group_size "
                     f">= 2, got {group_size}) and one reply block per row (no reply_spans)")
  lp, t = traj.prompt_width, traj.tokens.shape[1]
  n = t - lp
  positions = lm.positions_from_mask(traj.valid)
  prompt_valid = traj.valid[::group_size, :lp]
  kept = _kept_inputs(traj).reshape(-1)
  (keep,) = jnp.nonzero(kept, size=slots, fill_value=kept.shape[0])
  prompt_hidden, rest = cfg.apply_shared_prefix(
      params, traj.tokens[::group_size, :lp], lm.positions_from_mask(prompt_valid),
      prompt_valid.astype(jnp.int32), traj.tokens[:, lp:-1], positions[:, lp:-1],
      traj.valid[:, lp:-1].astype(jnp.int32), group_size=group_size, num_positions=t,
      keep=keep)
  policy = traj.policy_mask[:, lp:].reshape(-1)
  (index,) = jnp.nonzero(policy, size=slots, fill_value=policy.shape[0])
  complete = (jnp.sum(policy) <= slots) & (jnp.sum(kept) <= slots)
  packing = Packing(index.astype(jnp.int32), index < policy.shape[0], complete)
  # Each policy token's predictor: its prompt's last column, or a kept input's slot.
  row = index // n
  predictor = jnp.take(predictor_columns(traj.valid, lp).reshape(-1), index, mode="clip") - lp
  slot_of = jnp.zeros(kept.shape, jnp.int32).at[keep].set(
      jnp.arange(slots, dtype=jnp.int32), mode="drop")
  from_reply = jnp.take(slot_of, row * (n - 1) + jnp.maximum(predictor, 0), mode="clip")
  source = jnp.where(predictor < 0, row // group_size, prompt_hidden.shape[0] + from_reply)
  hidden = jnp.concatenate([prompt_hidden[:, -1], rest], axis=0)
  # An empty slot's source is clipped into range: finite, and never read back.
  return jnp.take(hidden, source, axis=0, mode="clip"), packing


def packed_policy_logits(params, cfg: lm.CausalLM, traj: Trajectory, *, group_size: int,
                         slots: int) -> tuple[jax.Array, Packing]:
  """f32[M, V] logits predicting each policy token, packed (`packed_policy_hidden`)."""
  hidden, packing = packed_policy_hidden(params, cfg, traj, group_size=group_size, slots=slots)
  return cfg.lm_head(params, hidden[None])[0], packing


def packed_tokens(traj: Trajectory, packing: Packing) -> jax.Array:
  """int32[M] the policy tokens in `packing`'s order (0 in an empty slot)."""
  return jnp.take(scored(traj, traj.tokens).reshape(-1), packing.index, mode="fill",
                  fill_value=0)


def unpack(x: jax.Array, packing: Packing, traj: Trajectory) -> jax.Array:
  """f32[M] values of the packed policy tokens -> f32[B, T] (`to_stream`'s layout), zeros on
  every other column."""
  b, c = traj.tokens.shape[0], traj.tokens.shape[1] - traj.prompt_width
  out = jnp.zeros((b * c,), x.dtype).at[packing.index].set(x, mode="drop")
  return to_stream(out.reshape(b, c), traj)


def token_logprobs(logits: jax.Array, tokens: jax.Array, mask: jax.Array, *,
                   temperature: float = 1.0, with_entropy: bool = False
                   ) -> tuple[jax.Array, jax.Array | None]:
  """log pi_T(token) under softmax(logits / T), and optionally the entropy of pi_T.

  The temperature is the sampler's: the importance ratio, the KL and the
  policy gradient then refer to the distribution that produced the samples
  (as in verl and TRL). Top-k / top-p truncation is not applied here.

  Args:
    logits: f32[B, N, V].
    tokens: int32[B, N] the sampled tokens.
    mask: bool[B, N] the policy's tokens.
    temperature: the sampling temperature (> 0).
    with_entropy: also return the entropy at each position.

  Returns:
    (logp f32[B, N] (0 where mask is False), entropy f32[B, N] or None).
  """
  if temperature != 1.0:
    logits = logits / temperature
  shifted, log_total, entropy = softmax_terms(logits)
  logp = jnp.take_along_axis(shifted, tokens[..., None], axis=-1)[..., 0] - log_total
  logp = jnp.where(mask, logp, 0.0)
  return logp, entropy if with_entropy else None


def hidden_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    tokens: jax.Array, mask: jax.Array, *, chunk: int,
                    temperature: float = 1.0, with_entropy: bool = False
                    ) -> tuple[jax.Array, jax.Array | None]:
  """`token_logprobs(head(hidden), ...)` without ever holding the [B, N, V] logits.

  The head and the log-softmax run over `chunk` columns at a time (`lax.map`), each
  chunk under `jax.checkpoint`: the forward keeps one chunk's f32[B, chunk, V] logits at
  a time, and the backward recomputes them chunk by chunk from the hidden states, so
  the memory for the vocabulary grows with `chunk`, not with the sequence. At V =
  49152 that is 192 KiB a scored token in f32 without chunking. The values and
  gradients are the unchunked ones up to float rounding (tests/test_scoring.py).
  tokamax's fused LM-head loss (`linear_softmax_cross_entropy_loss`) returns a reduced
  loss only; RL needs each token's log-probability and entropy, hence this.

  Args:
    head: hidden f[B, c, D] -> logits f[B, c, V] (e.g. `partial(cfg.lm_head, params)`).
    hidden: f[B, N, D] the predictors' hidden states, or f[M, D] a packed stream's (with
      tokens and mask [M]; the head then gets rows of one).
    tokens, mask, temperature, with_entropy: as `token_logprobs`'.
    chunk: columns per chunk (> 0); N is padded up to a multiple of it.

  Returns:
    As `token_logprobs`: (logp f32[B, N], entropy f32[B, N] or None).
  """
  if chunk <= 0:
    raise ValueError(f"chunk must be > 0 columns, got {chunk}")
  if tokens.ndim == 1:  # a packed stream (hidden f[M, D]): one row of M columns
    logp, entropy = hidden_logprobs(head, hidden[None], tokens[None], mask[None], chunk=chunk,
                                    temperature=temperature, with_entropy=with_entropy)
    return logp[0], None if entropy is None else entropy[0]
  b, n = tokens.shape
  pad = -n % chunk
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    tokens, mask = jnp.pad(tokens, ((0, 0), (0, pad))), jnp.pad(mask, ((0, 0), (0, pad)))
  chunks = lambda x: jnp.moveaxis(x.reshape(b, -1, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one(args):
    h, tok, m = args
    logp, entropy = token_logprobs(head(h), tok, m, temperature=temperature,
                                   with_entropy=with_entropy)
    return logp, entropy if with_entropy else jnp.zeros_like(logp)

  logp, entropy = jax.lax.map(one, (chunks(hidden), chunks(tokens), chunks(mask)))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :n]
  return unchunk(logp), unchunk(entropy) if with_entropy else None


def policy_logits(params, cfg: lm.CausalLM, traj: Trajectory, *,
                  group_size: int = 1) -> jax.Array:
  """f32[B, C, V] logits predicting each scored column (see `policy_hidden`)."""
  return cfg.lm_head(params, policy_hidden(params, cfg, traj, group_size=group_size))


def policy_logprobs(
    params, cfg: lm.CausalLM, traj: Trajectory, *,
    temperature: float = 1.0, with_entropy: bool = False, group_size: int = 1,
    chunk: int = 0
) -> tuple[jax.Array, jax.Array | None]:
  """log pi_T(token | everything valid before it) at every policy token of the stream.

  Args:
    params: policy parameters.
    cfg: the architecture.
    traj: the episodes.
    temperature: the sampling temperature the policy tokens were drawn at.
    with_entropy: also return the policy entropy at each column.
    group_size: rows per shared prompt (see `policy_hidden`).
    chunk: > 0: the vocabulary logits `chunk` columns at a time (`hidden_logprobs`), never
      all at once; 0: in one piece.

  Returns:
    (logp f32[B, T] (0 where policy_mask is False), entropy f32[B, T] (0 on the
    prompt) or None).
  """
  tokens, mask = scored(traj, traj.tokens), scored(traj, traj.policy_mask)
  if chunk:
    hidden = policy_hidden(params, cfg, traj, group_size=group_size)
    logp, entropy = hidden_logprobs(lambda h: cfg.lm_head(params, h), hidden, tokens, mask,
                                    chunk=chunk, temperature=temperature,
                                    with_entropy=with_entropy)
  else:
    logits = policy_logits(params, cfg, traj, group_size=group_size)
    logp, entropy = token_logprobs(logits, tokens, mask, temperature=temperature,
                                   with_entropy=with_entropy)
  return to_stream(logp, traj), None if entropy is None else to_stream(entropy, traj)


def reply_logprobs(params, tokens: jax.Array, mask: jax.Array, reply: jax.Array, *,
                   cfg: lm.CausalLM) -> jax.Array:
  """f32[B, R]: log pi(token | the real tokens before it) at each reply token of the last R
  columns, 0 elsewhere.

  For sequences outside a Trajectory (preference pairs, SFT rows:
  `data.preferences.encode_texts`): tokens int[B, W] in any padding the mask
  describes; reply bool[B, R], R <= W, marks the tokens whose probability counts
  among the sequence's last R columns (R = W: all of them; `preferences.reply_tail`
  trims a right-aligned reply mask). Only those R columns get vocabulary logits,
  which in a short reply after a long prompt is most of the memory saved. A reply
  token with no real token before it has nothing to be predicted from and counts 0.
  """
  w, r = tokens.shape[1], reply.shape[1]
  if r > w:
    raise ValueError(f"reply mask of {r} columns for sequences of {w}")
  hidden, _ = cfg.apply(params, tokens, lm.positions_from_mask(mask),
                                segment_ids=mask.astype(jnp.int32), return_hidden=True,
                                num_positions=w)
  # Column c is predicted from column c - 1; the first column has no predictor.
  first = max(w - r, 1)
  logits = cfg.lm_head(params, hidden[:, first - 1:w - 1])
  # A reply token counts only when a real token precedes it (its prediction's input).
  counted = reply[:, first - (w - r):] & mask[:, first - 1:w - 1]
  logp, _ = token_logprobs(logits, tokens[:, first:], counted)
  return jnp.pad(logp, ((0, 0), (r - logp.shape[1], 0)))
