"""Jitted batched generation with a KV cache passed in and out.

Three pieces, each a pure function of params and a `Continuation` (the cache
plus next-token logits and positions), composable under jit and inside
`lax.scan`:

- `prefill`: left-padded prompts into a fresh cache (vocabulary logits only at
  the last prompt position; a shared prefix and G samples per prompt run once).
- `extend`: a block of tokens (an observation) appended to an existing cache,
  without recomputing what it holds.
- `decode`: one token per iteration of a `lax.while_loop` until every row has
  stopped or the budget is spent; optionally returns the cache after it.

`generate` is `prefill` then `decode`.

`Sampler` is the host-side wrapper: chat templating, tokenization, shape
bucketing (prompt length, batch, max new tokens rounded up so a run compiles a
handful of programs; see `shapes`) and detokenization.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.models import lm
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import shapes

# The token choice lives in sampling.py; its names stay importable from here.
from jaxrl_agents.rollout.sampling import (  # noqa: F401
  SamplingConfig,
  argmax_vocab_major,
  filter_logits,
  pick,
  sample_inverse_cdf,
)


class SampleOutput(NamedTuple):
  """Completions of one batch.

  Attributes:
    tokens: int32[B, N] completion tokens; pad_id after the stop token.
    logprobs: f32[B, N] log pi(token) under the unmodified policy (temperature 1,
      no truncation); 0 where mask is False.
    sampling_logprobs: f32[B, N] log-probability under the distribution actually
      sampled from (equal to `logprobs` when sampling is plain temperature 1;
      0 for greedy, a point mass).
    mask: bool[B, N] True for completion tokens, including the stop token.
    lengths: int32[B] number of completion tokens.
  """

  tokens: jax.Array
  logprobs: jax.Array
  sampling_logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array


class Continuation(NamedTuple):
  """Where decoding continues from: a batch's KV cache and its next-token logits.

  `prefill` makes one, `extend` appends tokens to one (an environment's
  observation, say) without recomputing what its cache holds, and `decode`
  samples from one and, asked to, returns the one after its completions.

  Attributes:
    logits: f32[V, B] next-token logits, vocabulary-major (as the decode step's
      head produces them).
    cache: the KVCache; `cache.index` is the next slot every row writes.
    next_position: int32[B] the RoPE position of each row's next token (the
      number of real tokens it holds).
  """

  logits: jax.Array
  cache: Any
  next_position: jax.Array


def prefill(params, cfg: lm.CausalLM, prompt_tokens: jax.Array,
            prompt_mask: jax.Array, *, cache_len: int, samples_per_prompt: int = 1,
            prefix_tokens: jax.Array | None = None) -> Continuation:
  """Runs left-padded prompts into a fresh cache of `cache_len` slots per row.

  Args:
    params: model parameters.
    cfg: the architecture.
    prompt_tokens: int32[P, Lp], left-padded.
    prompt_mask: bool[P, Lp], True on real prompt tokens (every row needs one).
    cache_len: slots per row (static): the prompt's plus everything that will
      be appended or decoded after it.
    samples_per_prompt: G: each prompt is run once and its cache repeated for
      G consecutive rows (row i continues prompt i // G).
    prefix_tokens: optional int32[Lx] tokens every prompt starts with (see
      `split_shared_prefix`): run once for the whole batch, its cache shared.
      Each prompt is then prefix + its row of `prompt_tokens`.

  Returns:
    The Continuation of P * G rows.
  """
  if samples_per_prompt < 1:
    raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
  prompt_len = prompt_tokens.shape[1]
  lx = 0 if prefix_tokens is None else prefix_tokens.shape[0]
  if cache_len < lx + prompt_len:
    raise ValueError(f"cache_len {cache_len} < the prompt's {lx + prompt_len} tokens")
  # A float32 cache whatever the compute dtype: with a bf16 cache, XLA:CPU
  # converted each layer's whole cache to float32 for the attention and back
  # again around the one-slot write (no longer in place), ~40% of a bf16 decode
  # step at batch 32. Keys and values are rounded to the compute dtype before
  # they are stored, so the numbers are the bf16 cache's.
  segments = prompt_mask.astype(jnp.int32)
  if lx == 0:
    hidden, cache = cfg.apply(
        params, prompt_tokens, lm.positions_from_mask(prompt_mask),
        segment_ids=segments, return_hidden=True, new_cache_len=cache_len,
        cache_dtype="float32", num_positions=prompt_len)
  else:
    _, cache = cfg.apply(
        params, prefix_tokens[None], jnp.arange(lx, dtype=jnp.int32)[None],
        return_hidden=True, new_cache_len=cache_len, cache_dtype="float32",
        num_positions=lx)
    hidden, cache = cfg.apply(
        params, prompt_tokens, lx + lm.positions_from_mask(prompt_mask),
        segment_ids=segments, cache=lm.repeat_cache(cache, prompt_tokens.shape[0]),
        return_hidden=True, num_positions=lx + prompt_len)
  logits = cfg.lm_head(params, hidden[:, -1]).T  # vocabulary-major [V, P]
  next_position = lx + prompt_mask.sum(axis=-1).astype(jnp.int32)
  if samples_per_prompt > 1:
    cache = lm.repeat_cache(cache, samples_per_prompt)
    logits = jnp.repeat(logits, samples_per_prompt, axis=1)
    next_position = jnp.repeat(next_position, samples_per_prompt, axis=0)
  return Continuation(logits=logits.astype(jnp.float32), cache=cache,
                      next_position=next_position)


def _run_block(params, cfg: lm.CausalLM, context: Continuation,
               tokens: jax.Array, mask: jax.Array):
  """(hidden states f[B, T, D], the cache with the block written) of a block of tokens after
  what `context` holds; padding is skipped by attention and positions."""
  if tokens.shape != mask.shape or tokens.shape[0] != context.next_position.shape[0]:
    raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be [B, T] with "
                     f"B = {context.next_position.shape[0]} rows")
  positions = context.next_position[:, None] + lm.positions_from_mask(mask)
  return cfg.apply(params, tokens, positions, segment_ids=mask.astype(jnp.int32),
                           cache=context.cache, return_hidden=True)


def extend(params, cfg: lm.CausalLM, context: Continuation,
           tokens: jax.Array, mask: jax.Array) -> Continuation:
  """Appends a left-padded block of tokens to every row's cache.

  The block takes slots [index, index + T) of every row; its padding is
  marked invalid, so attention skips it and positions count real tokens only.
  What the cache already holds is not recomputed. A row whose block is all
  padding keeps its logits and position.

  Args:
    params: model parameters.
    cfg: the architecture.
    context: the Continuation to extend (its cache needs T free slots).
    tokens: int32[B, T] left-padded (each row's real tokens end the block, so
      the last column predicts the next token).
    mask: bool[B, T] real tokens.

  Returns:
    The Continuation after the block.
  """
  hidden, cache = _run_block(params, cfg, context, tokens, mask)
  logits = cfg.lm_head(params, hidden[:, -1]).T.astype(jnp.float32)
  appended = jnp.any(mask, axis=1)
  return Continuation(logits=jnp.where(appended[None, :], logits, context.logits), cache=cache,
                      next_position=context.next_position + mask.sum(-1).astype(jnp.int32))


def answer_logprob(params, cfg: lm.CausalLM, context: Continuation,
                   tokens: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean log-probability per token of an answer continuing each row: f32[B].

  What IGPO's information gain reads: the policy's probability of the gold
  answer as its next reply, given everything the cache holds. The answer's
  first token is scored by the context's logits, the rest by one pass over the
  answer; the cache that pass writes is dropped, so the context is unchanged
  (its cache needs T free slots).

  Args:
    tokens: int32[B, T] the answer, right-padded (real tokens first).
    mask: bool[B, T] its real tokens (at least one a row).
  """
  hidden, _ = _run_block(params, cfg, context, tokens, mask)
  # Column i's hidden state predicts token i + 1; the context's logits predict token 0.
  logits = jnp.concatenate([context.logits.T[:, None, :],
                            cfg.lm_head(params, hidden[:, :-1])], axis=1)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                             tokens[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(mask, logp, 0.0), -1) / jnp.maximum(mask.sum(-1), 1)


def _pick_and_record(state, logits, step, rows=None, *, sampling: SamplingConfig):
  """Picks each live row's token at column `step` and records it with its log-probabilities.

  state is (rng, tokens, logp, sampling logp, done), over the whole batch;
  `logits` are those of the whole batch, or with `rows` (int32[b]) of those
  rows of it. Returns (state, token, live), the last two over the logits' rows.
  """
  rng, tokens, logp, slogp, done = state
  rng, step_rng = jax.random.split(rng)
  token, policy_logp, sampling_logp = pick(logits, step_rng, sampling, rows, done.shape[0])
  at = slice(None) if rows is None else rows
  live = ~done[at]
  token = jnp.where(live, token, sampling.pad_id)
  tokens = tokens.at[at, step].set(token)
  logp = logp.at[at, step].set(jnp.where(live, policy_logp, 0.0))
  slogp = slogp.at[at, step].set(jnp.where(live, sampling_logp, 0.0))
  stopped = jnp.isin(token, jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32))
  done = done | stopped if rows is None else done.at[rows].set(~live | stopped)
  return (rng, tokens, logp, slogp, done), token, live


def compaction_sizes(batch: int, min_rows: int) -> list[int]:
  """The row counts a decode with `compact_min_rows=min_rows` runs at: the batch, then
  halved while the half is a whole number of at least `min_rows` rows."""
  sizes = [batch]
  while min_rows and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= min_rows:
    sizes.append(sizes[-1] // 2)
  return sizes


def decode(params, cfg: lm.CausalLM, context: Continuation, rng: jax.Array,
           sampling: SamplingConfig, max_steps: jax.Array | int | None = None, *,
           active: jax.Array | None = None, keep_cache: bool = False
           ) -> tuple[SampleOutput, Continuation | None]:
  """Samples up to `sampling.max_new_tokens` tokens per row from a Continuation.

  One token per iteration of a `lax.while_loop` that stops as soon as every
  row has emitted a stop token or `max_steps` is reached. The cache lives in
  the loop carry, so XLA updates it in place. With `sampling.compact_min_rows`
  there is one such loop per row count (`compaction_sizes`), each handing the
  rows still sampling to the next.

  Args:
    params: model parameters.
    cfg: the architecture.
    context: where to continue from; its cache needs N = max_new_tokens free slots.
    rng: PRNG key; results are a deterministic function of it.
    sampling: the SamplingConfig.
    max_steps: optional traced limit <= max_new_tokens, so one compiled buffer
      size serves several completion lengths.
    active: optional bool[B]; rows that are False sample nothing (length 0), as
      finished episodes in a multi-turn batch.
    keep_cache: also return the Continuation after the completions: every
      row's completion in slots [index, index + N) of its cache (padding after
      it invalid), so an observation can be appended with `extend`. This costs
      one more decode step, to write the last sampled token. The returned
      next-token logits are those after the last token for rows that ran to
      the budget; a row that stopped earlier gets meaningless ones, so extend
      every continuing row with a non-empty block (an observation) before
      decoding it again.

  Returns:
    (SampleOutput with N = sampling.max_new_tokens columns, the Continuation
    after them or None).
  """
  params = lm.loop_params(cfg, params)  # derived once here, not at every token of the loop
  start_cache, start_position = context.cache, context.next_position
  batch, n = start_position.shape[0], sampling.max_new_tokens
  limit = jnp.minimum(n, n if max_steps is None else max_steps)
  pick_and_record = functools.partial(_pick_and_record, sampling=sampling)

  done = jnp.zeros((batch,), bool) if active is None else ~active
  state = (rng, jnp.full((batch, n), sampling.pad_id, jnp.int32),
           jnp.zeros((batch, n), jnp.float32), jnp.zeros((batch, n), jnp.float32), done)
  state, token, live = pick_and_record(state, context.logits, 0)
  lengths = live.astype(jnp.int32)

  sizes = [batch] if keep_cache else compaction_sizes(batch, sampling.compact_min_rows)
  steps, cache, state, token, lengths = _decode_loops(
      params, cfg, sizes, limit, pick_and_record,
      (jnp.int32(1), start_cache, state, token, lengths), start_position)
  _, tokens, logp, slogp, _ = state
  mask = jnp.arange(n)[None, :] < lengths[:, None]
  out = SampleOutput(tokens=tokens, logprobs=logp, sampling_logprobs=slogp, mask=mask,
                     lengths=lengths)
  if not keep_cache:
    return out, None
  return out, _close_block(params, cfg, cache, out, token, start_cache.index,
                           start_position + steps - 1, start_position)


def _decode_loops(params, cfg: lm.CausalLM, sizes: list[int], limit, pick_and_record, carry,
                  start_position):
  """`decode`'s token loop: one while_loop per row count in `sizes` (`compaction_sizes`),
  each running until at most the next count's rows are live, which then go on alone.
  carry is (step, cache, state, token, lengths) over the whole batch; returns it after."""
  batch = sizes[0]
  steps, cache, state, token, lengths = carry
  rows, position = None, start_position  # rows: the loop's rows in the batch (None: all)
  for level, size in enumerate(sizes):
    if level:  # (also where the loop before ended every row: one gather, no decode step)
      current = jnp.arange(batch) if rows is None else rows
      keep = jnp.argsort(state[-1][current], stable=True)[:size]  # the live rows first
      rows, token, position = current[keep], token[keep], position[keep]
      cache = lm.take_rows(cache, keep)
    still_live = sizes[level + 1] if level + 1 < len(sizes) else 0

    def cond(carry, still_live=still_live):
      step, _, state, _, _ = carry
      return (step < limit) & (jnp.sum(~state[-1]) > still_live)

    def body(carry, rows=rows, position=position):
      step, cache, state, token, lengths = carry
      logits, cache = cfg.decode_step(params, token, position + step - 1, cache,
                                      vocab_major=True)
      state, token, live = pick_and_record(state, logits, step, rows)
      live = live.astype(jnp.int32)
      return (step + 1, cache, state, token,
              lengths + live if rows is None else lengths.at[rows].add(live))

    steps, cache, state, token, lengths = jax.lax.while_loop(
        cond, body, (steps, cache, state, token, lengths))
  return steps, cache, state, token, lengths


def _close_block(params, cfg, cache, out: SampleOutput, last_token, start_slot, last_position,
                 start_position) -> Continuation:
  """The Continuation after a decoded block: the loop wrote all tokens but the last; write it
  (a finished row writes padding, marked invalid here) and fix the block's width at N."""
  logits, cache = cfg.decode_step(params, last_token, last_position, cache,
                                          vocab_major=True)
  valid = jax.lax.dynamic_update_slice(cache.valid, out.mask, (0, start_slot))
  cache = cache._replace(valid=valid, index=start_slot + out.tokens.shape[1])
  return Continuation(logits=logits.astype(jnp.float32), cache=cache,
                      next_position=start_position + out.lengths)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "samples_per_prompt"))
def generate(params, cfg: lm.CausalLM, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, rng: jax.Array, sampling: SamplingConfig,
             max_steps: jax.Array | int | None = None,
             samples_per_prompt: int = 1,
             prefix_tokens: jax.Array | None = None) -> SampleOutput:
  """Generates completions for left-padded prompts: `prefill`, then `decode`.

  Args:
    params: model parameters.
    cfg: the architecture (static).
    prompt_tokens: int32[P, Lp], left-padded.
    prompt_mask: bool[P, Lp], True on real prompt tokens (every row needs one).
    rng: PRNG key; results are a deterministic function of it.
    sampling: the SamplingConfig (static).
    max_steps: optional traced limit <= max_new_tokens, so one compiled buffer
      size serves several completion lengths.
    samples_per_prompt: G (static): completions per prompt. Each prompt is
      prefilled once and its cache repeated, so a group of G samples pays for
      one prefill; the same as passing each prompt G times, in less time.
    prefix_tokens: optional int32[Lx], tokens every prompt starts with (a chat
      template's system prompt, say; see `split_shared_prefix`). Each prompt is
      then prefix + its row of `prompt_tokens`; the prefix goes through the
      model once for the whole batch and its cache is shared.

  Returns:
    SampleOutput with B = P * G rows (prompt-major: row i is a sample of
    prompt i // G) and N = sampling.max_new_tokens.
  """
  if samples_per_prompt < 1:
    raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
  if prompt_tokens.shape[0] * samples_per_prompt == 1 and cfg.dtype == "bfloat16":
    # XLA:CPU has no bf16 kernel for a one-column product and converts every
    # weight to f32 at each step (a bf16 single-row decode ran ~4x slower than
    # f32); two columns take the bf16 kernel. Decode a copy alongside, keep row 0.
    out = generate(params, cfg, jnp.repeat(prompt_tokens, 2, axis=0),
                   jnp.repeat(prompt_mask, 2, axis=0), rng, sampling, max_steps,
                   prefix_tokens=prefix_tokens)
    return jax.tree.map(lambda x: x[:1], out)
  lx = 0 if prefix_tokens is None else prefix_tokens.shape[0]
  context = prefill(params, cfg, prompt_tokens, prompt_mask,
                    cache_len=lx + prompt_tokens.shape[1] + sampling.max_new_tokens,
                    samples_per_prompt=samples_per_prompt,
                    prefix_tokens=prefix_tokens if lx else None)
  return decode(params, cfg, context, rng, sampling, max_steps)[0]


def split_shared_prefix(ids: list[list[int]], multiple: int = shapes.PREFIX_MULTIPLE
                        ) -> tuple[list[int], list[list[int]]]:
  """(prefix, suffixes): the token prefix all prompts share, and what follows it in each.

  The prefix is the longest common one rounded down to a multiple of
  `multiple` (its length is a compiled shape, so it should not change with
  the first words of the questions) and leaves every suffix at least one
  token (the last prompt position predicts the first new token). Fewer than
  two prompts share nothing: ([], ids).
  """
  if not ids or any(len(s) == 0 for s in ids):
    raise ValueError("every prompt needs at least one token")
  if len(ids) < 2:
    return [], [list(s) for s in ids]
  shortest = min(len(s) for s in ids)
  common = 0
  while common < shortest - 1 and all(s[common] == ids[0][common] for s in ids):
    common += 1
  common = shapes.prefix_width(common, multiple)
  return list(ids[0][:common]), [list(s[common:]) for s in ids]


class Sampler:
  """Text in, text out, over the jitted `generate` with bucketed shapes."""

  def __init__(self, model, chat: bool = True, system: str | None = None):
    self.model = model
    self._decoding_params = {}  # rows == 1 -> `cfg.decoding_params`, prepared on first use
    self.chat = chat
    self.system = system
    self.stop_tokens = tokenizer_lib.stop_token_ids(model.tokenizer)
    self.pad_id = model.tokenizer.pad_token_id

  def sampling_config(self, max_new_tokens: int = 64, temperature: float = 0.0,
                      **kwargs) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                          stop_tokens=self.stop_tokens, pad_id=self.pad_id, **kwargs)

  def encode(self, prompts: list[str], batch_size: int | None = None):
    """Left-padded int32[B, Lp] tokens and bool mask (Lp: `shapes.prompt_width`)."""
    return self._pad(self._token_ids(prompts), batch_size)

  def encode_shared(self, prompts: list[str], batch_size: int | None = None):
    """(shared prefix tokens, left-padded bucketed suffix tokens, their mask); see
    `split_shared_prefix`."""
    prefix, suffixes = split_shared_prefix(self._token_ids(prompts))
    return (prefix, *self._pad(suffixes, batch_size))

  def _token_ids(self, prompts: list[str]) -> list[list[int]]:
    ids = tokenizer_lib.encode_prompts(self.model.tokenizer, prompts, self.chat, self.system)
    if any(len(s) == 0 for s in ids):
      raise ValueError("empty prompt: every prompt needs at least one token")
    longest = max(len(s) for s in ids)
    if longest > self.model.cfg.max_seq_len:
      raise ValueError(f"a prompt of {longest} tokens is longer than the model's context "
                       f"({self.model.cfg.max_seq_len} tokens)")
    return ids

  def _pad(self, ids: list[list[int]], batch_size: int | None):
    length = shapes.prompt_width(max(len(s) for s in ids))
    tokens, mask = tokenizer_lib.pad_left(ids, self.pad_id, length)
    batch = batch_size or shapes.power_of_two(len(ids), minimum=1)
    if batch > len(ids):  # pad the batch with copies of the first row
      extra = batch - len(ids)
      tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
      mask = np.concatenate([mask, np.repeat(mask[:1], extra, 0)])
    return tokens, mask

  def _params_for(self, rows: int):
    if (rows == 1) not in self._decoding_params:
      self._decoding_params[rows == 1] = self.model.cfg.decoding_params(self.model.params, rows)
    return self._decoding_params[rows == 1]

  def __call__(self, prompts: list[str], rng: jax.Array | None = None,
               max_new_tokens: int = 64, temperature: float = 0.0, **kwargs):
    """Returns (completion texts, SampleOutput for the real rows)."""
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rng = jax.random.key(0) if rng is None else rng
    prefix, tokens, mask = self.encode_shared(prompts)
    sampling = self.sampling_config(shapes.power_of_two(max_new_tokens), temperature, **kwargs)
    out = generate(self._params_for(tokens.shape[0]), self.model.cfg, jnp.asarray(tokens),
                   jnp.asarray(mask), rng, sampling, max_steps=jnp.int32(max_new_tokens),
                   prefix_tokens=jnp.asarray(prefix, jnp.int32) if prefix else None)
    out = jax.tree.map(lambda x: np.asarray(x)[: len(prompts), :max_new_tokens]
                       if x.ndim == 2 else np.asarray(x)[: len(prompts)], out)
    texts = tokenizer_lib.decode_completions(self.model.tokenizer, out.tokens, out.lengths,
                                             self.stop_tokens)
    return texts, out
