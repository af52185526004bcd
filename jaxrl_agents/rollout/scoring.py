"""Per-token log-probabilities (and entropies) of completions under a policy.

Training recomputes the log-probabilities of exactly the sampled tokens with
one full forward pass over `prompt ++ completion`; the old-policy and
reference log-probabilities use this same function, so sampling numerics
never leak into importance ratios.

Layout (the sampler's): prompts are left-padded to Lp, completions
right-padded to N, so the completion token j sits at column Lp + j and is
predicted by the hidden state at column Lp + j - 1. Vocabulary logits are
computed only for those N positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents.losses.entropy import entropy_from_logits
from jaxrl_agents.models import transformer


class SequenceBatch(NamedTuple):
  """Prompt + completion token streams.

  Attributes:
    prompt_tokens: int32[B, Lp] left-padded.
    prompt_mask: bool[B, Lp].
    completion_tokens: int32[B, N] right-padded.
    completion_mask: bool[B, N] the policy's tokens (loss mask).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array


def completion_hidden(params, cfg: transformer.TransformerConfig, batch: SequenceBatch):
  """Final hidden states f[B, N, D] at the positions that predict each completion token."""
  lp = batch.prompt_tokens.shape[1]
  n = batch.completion_tokens.shape[1]
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
  mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
  positions = transformer.positions_from_mask(mask)
  hidden, _ = transformer.apply(params, tokens, positions, cfg,
                                segment_ids=mask.astype(jnp.int32), return_hidden=True)
  return hidden[:, lp - 1: lp - 1 + n]


def completion_logprobs(
    params, cfg: transformer.TransformerConfig, batch: SequenceBatch, *,
    with_entropy: bool = False
) -> tuple[jax.Array, jax.Array | None]:
  """log pi(y_j | x, y_<j) for every completion token.

  Args:
    params: policy parameters.
    cfg: the architecture.
    batch: the token streams.
    with_entropy: also return the policy entropy at each completion position.

  Returns:
    (logp f32[B, N] (0 where the completion mask is False), entropy f32[B, N] or None).
  """
  hidden = completion_hidden(params, cfg, batch)
  logits = transformer.lm_head(params, hidden, cfg)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(log_probs, batch.completion_tokens[..., None], axis=-1)[..., 0]
  logp = jnp.where(batch.completion_mask, logp, 0.0)
  entropy = entropy_from_logits(logits) if with_entropy else None
  return logp, entropy
