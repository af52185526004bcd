"""Reward and value networks: a causal-LM backbone plus a scalar head, as pure functions.

  params = {"backbone": transformer params, "head": {"w": f32[D], "b": f32[]}}

The backbone starts as a copy of a causal LM (its LM head unused); the head is
`heads.init_scalar_head`. Every function takes tokens int[B, T] and a mask
bool[B, T] of the real tokens (left or right padding, anything the mask
describes) and runs under jit:

  token_scores(params, tokens, mask)     f32[B, T]  a score at every real token
                                                     (values; process rewards)
  outcome_rewards(params, tokens, mask)  f32[B]     one score per sequence, read at
                                                     its last real token ("last") or
                                                     averaged over them ("mean")
  step_scores(params, tokens, mask, ends, step_mask)  f32[B, K]  scores at the step ends
                                                     only (a process reward model)

`frozen_layers` = k stops the gradient at the embedding and the first k
layers: their gradient is zero and, because nothing below layer k needs a
gradient, XLA drops their backward pass, so a step costs a fraction of a full
fine-tune's compute (the optimizer still holds their moments, and weight
decay would still shrink them: the trainer refuses it with frozen layers).

`jaxrl_agents.data.preferences.encode_texts` turns (prompt, response) texts
into the sequences a reward model reads, ending with the token that closes the
response, whose hidden state has seen all of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.models import heads, lm, lora, transformer

POOLINGS = ("last", "mean")


def init(backbone, rng: jax.Array, cfg: lm.CausalLM, head_scale: float = 0.0
         ) -> dict:
  """A reward model on a copy of `backbone` (a causal LM's params) and a fresh scalar head."""
  return {"backbone": jax.tree.map(jnp.copy, backbone),
          "head": heads.init_scalar_head(rng, cfg.d_model, head_scale)}


def check_frozen_layers(frozen_layers: int, cfg: lm.CausalLM) -> None:
  if frozen_layers and isinstance(cfg, lora.LoraLM):
    raise ValueError(f"frozen_layers={frozen_layers} freezes lower layers of a backbone that "
                     "trains every weight; with config.lora only the adapters train already: "
                     "set frozen_layers=0")
  if not 0 <= frozen_layers <= cfg.n_layers:
    raise ValueError(f"frozen_layers must be in [0, {cfg.n_layers}] (the model's layers), "
                     f"got {frozen_layers}")


def freeze(backbone, frozen_layers: int, cfg: lm.CausalLM):
  """The backbone with the embedding and the first `frozen_layers` layers under stop_gradient.

  The project's transformer names them "embed" and "layers"; a Flax model is frozen
  this way when it names them as Gemma does, "embedder" and "layer_<i>"."""
  if not frozen_layers:
    return backbone
  out = dict(backbone)
  if not isinstance(cfg, transformer.TransformerConfig):
    frozen = ["embedder"] + [f"layer_{i}" for i in range(frozen_layers)]
    missing = [name for name in frozen if name not in backbone]
    if missing:
      raise ValueError(f"frozen_layers={frozen_layers} needs the scopes {missing} (Gemma's "
                       f"names); this backbone has {sorted(backbone)[:8]}: set frozen_layers=0")
    out.update({name: jax.lax.stop_gradient(backbone[name]) for name in frozen})
    return out
  out["embed"] = jax.lax.stop_gradient(backbone["embed"])
  if transformer.is_stacked(backbone):  # the first k rows of each stacked array
    out["layers"] = {name: jnp.concatenate([jax.lax.stop_gradient(w[:frozen_layers]),
                                            w[frozen_layers:]])
                     for name, w in backbone["layers"].items()}
    return out
  out["layers"] = [jax.lax.stop_gradient(layer) if i < frozen_layers else layer
                   for i, layer in enumerate(backbone["layers"])]
  return out


def hidden_states(params, tokens: jax.Array, mask: jax.Array, *,
                  cfg: lm.CausalLM, frozen_layers: int = 0) -> jax.Array:
  """Final normalized hidden states f[B, T, D]; each real token sees the real ones before it."""
  check_frozen_layers(frozen_layers, cfg)
  hidden, _ = cfg.apply(
      freeze(params["backbone"], frozen_layers, cfg), tokens, lm.positions_from_mask(mask),
      segment_ids=mask.astype(jnp.int32), return_hidden=True, num_positions=tokens.shape[1])
  return hidden


def token_scores(params, tokens: jax.Array, mask: jax.Array, *,
                 cfg: lm.CausalLM, frozen_layers: int = 0) -> jax.Array:
  """f32[B, T]: the head's score at every real token (0 at padding)."""
  scores = heads.apply_scalar_head(
      params["head"], hidden_states(params, tokens, mask, cfg=cfg, frozen_layers=frozen_layers))
  return jnp.where(mask, scores, 0.0)


def last_index(mask: jax.Array) -> jax.Array:
  """int32[B]: the column of each row's last real token (0 for a row with none)."""
  t = mask.shape[1]
  return jnp.where(mask.any(axis=1), t - 1 - jnp.argmax(mask[:, ::-1], axis=1), 0
                   ).astype(jnp.int32)


def outcome_rewards(params, tokens: jax.Array, mask: jax.Array, *,
                    cfg: lm.CausalLM, pooling: str = "last",
                    frozen_layers: int = 0, reply: jax.Array | None = None) -> jax.Array:
  """f32[B]: one reward per sequence, the score at its last real token, or with "mean" the
  mean score over the reply's tokens (`reply` bool[B, T]; all real tokens without it)."""
  if pooling not in POOLINGS:
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
  scores = token_scores(params, tokens, mask, cfg=cfg, frozen_layers=frozen_layers)
  if pooling == "last":
    return jnp.take_along_axis(scores, last_index(mask)[:, None], axis=1)[:, 0]
  pooled = mask if reply is None else reply & mask
  return jnp.where(pooled, scores, 0.0).sum(axis=1) / jnp.maximum(pooled.sum(axis=1), 1)


def step_scores(params, tokens: jax.Array, mask: jax.Array, ends: jax.Array,
                step_mask: jax.Array, *, cfg: lm.CausalLM,
                frozen_layers: int = 0) -> jax.Array:
  """f32[B, K]: a process reward model's score of each step, read at the step's end column
  (`ends` int32[B, K], `data.steps.encode_steps`); 0 where `step_mask` is False."""
  scores = token_scores(params, tokens, mask, cfg=cfg, frozen_layers=frozen_layers)
  return jnp.where(step_mask, jnp.take_along_axis(scores, ends, axis=1), 0.0)


# ----------------------------------------------------------------------------
# Evaluation of a reward model on held-out pairs.


def pair_calibration(margins, bins: int = 10) -> dict[str, float]:
  """Pair accuracy, mean margin and expected calibration error of held-out pairs.

  `margins` f32[N] are r(chosen) - r(rejected). The Bradley-Terry model
  prefers the side with the higher reward, with confidence
  c = sigmoid(|margin|) in [0.5, 1]; it is right when margin > 0 (a tie
  counts half). The confidences fall in `bins` equal-width bins over
  [0.5, 1], and ECE = sum_b (n_b / N) |accuracy_b - mean confidence_b|: 0
  for a calibrated model; one always 90% sure and right 60% of the time
  scores 0.3.
  """
  margins = np.asarray(margins, np.float64)
  if margins.ndim != 1 or not len(margins):
    raise ValueError(f"margins must be a non-empty [N] array, got shape {margins.shape}")
  conf = 1.0 / (1.0 + np.exp(-np.abs(margins)))
  right = np.where(margins > 0, 1.0, np.where(margins < 0, 0.0, 0.5))
  which = np.minimum(((conf - 0.5) * 2 * bins).astype(int), bins - 1)
  ece = sum(float((which == b).mean()) * abs(right[which == b].mean() - conf[which == b].mean())
            for b in range(bins) if (which == b).any())
  return {"pair_accuracy": float(right.mean()), "reward_margin": float(margins.mean()),
          "calibration_error": float(ece)}
