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

from jaxrl_agents.losses.entropy import softmax_terms
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


def completion_hidden(params, cfg: transformer.TransformerConfig, batch: SequenceBatch, *,
                      group_size: int = 1):
  """Final hidden states f[B, N, D] at the positions that predict each completion token.

  With group_size G > 1, rows come in groups of G consecutive rows that share
  one prompt (the rollout's layout): each distinct prompt is run once, its
  KV cache repeated for its G completions, and only the completion tokens go
  through the model per row. The result equals the G = 1 full forward (the
  same attention, over the same keys) for a fraction of the prompt's cost,
  in the forward and in the backward pass (the gradient through the repeated
  cache sums over the group).
  """
  lp = batch.prompt_tokens.shape[1]
  n = batch.completion_tokens.shape[1]
  if group_size == 1:
    tokens = jnp.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
    positions = transformer.positions_from_mask(mask)
    hidden, _ = transformer.apply(params, tokens, positions, cfg,
                                  segment_ids=mask.astype(jnp.int32), return_hidden=True,
                                  num_positions=lp + n)
    return hidden[:, lp - 1: lp - 1 + n]
  b = batch.prompt_tokens.shape[0]
  if group_size < 1 or b % group_size:
    raise ValueError(f"batch of {b} rows is not a whole number of groups of {group_size}")
  prompt_tokens = batch.prompt_tokens[::group_size]
  prompt_mask = batch.prompt_mask[::group_size]
  prompt_hidden, cache = transformer.apply(
      params, prompt_tokens, transformer.positions_from_mask(prompt_mask), cfg,
      segment_ids=prompt_mask.astype(jnp.int32), return_hidden=True, new_cache_len=lp + n - 1,
      num_positions=lp)
  # The last prompt position predicts the first completion token; completion
  # token j predicts token j + 1, so the last one is never an input.
  first = jnp.repeat(prompt_hidden[:, -1:], group_size, axis=0)
  if n == 1:
    return first
  inputs = batch.completion_tokens[:, :-1]
  prompt_len = jnp.sum(batch.prompt_mask, axis=1, dtype=jnp.int32)[:, None]
  positions = prompt_len + jnp.arange(n - 1, dtype=jnp.int32)[None, :]
  rest, _ = transformer.apply(
      params, inputs, positions, cfg, segment_ids=batch.completion_mask[:, :-1].astype(jnp.int32),
      cache=transformer.repeat_cache(cache, group_size), return_hidden=True,
      num_positions=lp + n)
  return jnp.concatenate([first, rest], axis=1)


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


def completion_logprobs(
    params, cfg: transformer.TransformerConfig, batch: SequenceBatch, *,
    temperature: float = 1.0, with_entropy: bool = False, group_size: int = 1
) -> tuple[jax.Array, jax.Array | None]:
  """log pi_T(y_j | x, y_<j) for every completion token.

  Args:
    params: policy parameters.
    cfg: the architecture.
    batch: the token streams.
    temperature: the sampling temperature the completions were drawn at.
    with_entropy: also return the policy entropy at each completion position.
    group_size: rows per shared prompt (see `completion_hidden`).

  Returns:
    (logp f32[B, N] (0 where the completion mask is False), entropy f32[B, N] or None).
  """
  hidden = completion_hidden(params, cfg, batch, group_size=group_size)
  logits = transformer.lm_head(params, hidden, cfg)
  return token_logprobs(logits, batch.completion_tokens, batch.completion_mask,
                        temperature=temperature, with_entropy=with_entropy)
