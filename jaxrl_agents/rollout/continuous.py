"""Continuous batching: N sequences through B cache rows ("slots") in one jitted loop.

A static batch (`sampler.generate`) decodes until its longest reply is done, every
finished row decoding padding meanwhile; with long-tailed reply lengths most of a long
rollout is that padding. Here, when a slot's sequence ends (a stop token or its own
budget), the slot prefills the next queued prompt and goes on, without leaving the
`lax.while_loop`, so every decode step serves live sequences while any are queued.

How the cache allows it with one scalar write index (the decode step's fast path):
each row is a ring of S = Lp + N_max slots. Every decode step writes slot
`index mod S` of every row. A sequence that starts when the index is i puts its
prompt in the Lp slots before i and writes its replies to slots i, i + 1, ..., which
are the other N_max slots of the ring: it never overwrites itself. Attention reads
a row's valid slots in any order (keys carry their RoPE positions), and a refilled
row's other slots are marked invalid.

Each sequence draws its samples from its own key (`jax.random.fold_in(key, t)` at its
t-th token), so its tokens do not depend on which slot it ran in or beside whom:
equal to running it alone (`slots=1`), and for greedy decoding equal to a static
batch's, up to the rounding of products over other row counts (a token can differ at
a near-tie).

Only for models whose `decode_step` takes the cache's `index` as given and masks by
`valid` alone (the project's transformer); a clear error otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_agents.models import lm, transformer
from jaxrl_agents.rollout.sampler import SampleOutput, prefill
from jaxrl_agents.rollout.sampling import SamplingConfig, pick


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "slots"))
def generate(params, cfg: lm.CausalLM, prompt_tokens: jax.Array, prompt_mask: jax.Array,
             keys: jax.Array, sampling: SamplingConfig, *, slots: int,
             max_new_tokens: jax.Array | None = None) -> SampleOutput:
  """Completions of N left-padded prompts, decoded `slots` at a time.

  Args:
    params: model parameters.
    cfg: the architecture (static; the project's transformer).
    prompt_tokens: int32[N, Lp], left-padded, in queue order.
    prompt_mask: bool[N, Lp], True on real prompt tokens (every row needs one).
    keys: N PRNG keys, one per sequence (unused when greedy).
    sampling: the SamplingConfig (static); `max_new_tokens` is the longest reply.
    slots: B (static), the cache rows decoding at once; at most N.
    max_new_tokens: optional int32[N], each sequence's own budget (1 to
      `sampling.max_new_tokens`); default the config's for all.

  Returns:
    SampleOutput of N rows in queue order, `sampling.max_new_tokens` columns.
  """
  if not isinstance(cfg, transformer.TransformerConfig):
    raise ValueError("continuous batching needs the project's transformer (its decode step "
                     f"reads the cache as a ring); got {type(cfg).__name__}")
  n, lp = prompt_tokens.shape
  if not 1 <= slots <= n:
    raise ValueError(f"slots must be in [1, {n}] (the number of prompts), got {slots}")
  if sampling.compact_min_rows:
    raise ValueError("compact_min_rows is the static batch's; continuous batching refills "
                     "its rows instead")
  width = sampling.max_new_tokens
  ring = lp + width
  budget = (jnp.full((n,), width, jnp.int32) if max_new_tokens is None
            else jnp.clip(max_new_tokens.astype(jnp.int32), 1, width))
  params = lm.loop_params(cfg, params)
  stops = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)

  first = prefill(params, cfg, prompt_tokens[:slots], prompt_mask[:slots], cache_len=ring)
  state = dict(
      cache=first.cache, logits=first.logits, position=first.next_position,
      seq=jnp.arange(slots, dtype=jnp.int32),  # each slot's sequence (n: none)
      count=jnp.zeros((slots,), jnp.int32),  # tokens each slot's sequence has so far
      queued=jnp.int32(slots),  # the next sequence to start
      writes=jnp.int32(lp),  # decode writes so far + Lp: the ring's write index, unreduced
      tokens=jnp.full((n, width), sampling.pad_id, jnp.int32),
      logp=jnp.zeros((n, width), jnp.float32), slogp=jnp.zeros((n, width), jnp.float32),
      lengths=jnp.zeros((n,), jnp.int32))

  def step(state):
    live = state["seq"] < n
    seq = jnp.minimum(state["seq"], n - 1)
    uniform = None
    if not sampling.greedy:
      draw = lambda key, t: jax.random.uniform(jax.random.fold_in(key, t))
      uniform = jax.vmap(draw)(keys[seq], state["count"])
    token, logp, slogp = pick(state["logits"], None, sampling, uniform=uniform)
    token = jnp.where(live, token, sampling.pad_id)
    at = (jnp.where(live, state["seq"], n), state["count"])  # row n: dropped
    record = lambda a, v: a.at[at].set(v, mode="drop")
    count = state["count"] + live
    finished = live & (jnp.isin(token, stops) | (count >= budget[seq]))
    cache = state["cache"]._replace(index=state["writes"] % ring)
    logits, cache = cfg.decode_step(params, token, state["position"], cache, vocab_major=True)
    state = dict(state, cache=cache, logits=logits.astype(jnp.float32),
                 position=state["position"] + 1, count=count, writes=state["writes"] + 1,
                 tokens=record(state["tokens"], token), logp=record(state["logp"], logp),
                 slogp=record(state["slogp"], slogp),
                 lengths=state["lengths"].at[jnp.where(live, state["seq"], n)].set(
                     count, mode="drop"))
    state, unfilled = _refill(params, cfg, state, finished, prompt_tokens, prompt_mask, ring)
    # A finished slot the queue had nothing left for holds no sequence from now on.
    state["seq"] = jnp.where(unfilled, n, state["seq"])
    return state

  state = jax.lax.while_loop(lambda s: jnp.any(s["seq"] < n), step, state)
  mask = jnp.arange(width)[None, :] < state["lengths"][:, None]
  return SampleOutput(tokens=state["tokens"], logprobs=state["logp"],
                      sampling_logprobs=state["slogp"], mask=mask, lengths=state["lengths"])


def _refill(params, cfg, state, empty, prompt_tokens, prompt_mask, ring):
  """Starts the next queued sequences in the `empty` slots (bool[B]), one at a time, until
  the slots or the queue run out; returns (state, the slots still empty)."""
  n, lp = prompt_tokens.shape

  def cond(carry):
    state, empty = carry
    return jnp.any(empty) & (state["queued"] < n)

  def body(carry):
    state, empty = carry
    slot, q = jnp.argmax(empty), state["queued"]
    one = prefill(params, cfg, jax.lax.dynamic_slice_in_dim(prompt_tokens, q, 1),
                  jax.lax.dynamic_slice_in_dim(prompt_mask, q, 1), cache_len=lp)
    # The prompt takes the Lp ring slots before the next write; the rest of the row is
    # the sequence's replies to come, invalid until written.
    where = (state["writes"] - lp + jnp.arange(lp)) % ring
    cache = state["cache"]
    row = lambda buffer, new, axis: jax.lax.dynamic_update_index_in_dim(
        buffer, jnp.zeros(buffer.shape[1:], buffer.dtype).at[
            (slice(None),) * (axis - 1) + (where,)].set(new[0].astype(buffer.dtype)),
        slot, 0)
    cache = cache._replace(
        k=tuple(row(b, new, 3) for b, new in zip(cache.k, one.cache.k, strict=True)),
        v=tuple(row(b, new, 2) for b, new in zip(cache.v, one.cache.v, strict=True)),
        valid=row(cache.valid, one.cache.valid, 1))
    state = dict(state, cache=cache, logits=state["logits"].at[:, slot].set(one.logits[:, 0]),
                 position=state["position"].at[slot].set(one.next_position[0]),
                 seq=state["seq"].at[slot].set(q), count=state["count"].at[slot].set(0),
                 queued=q + 1)
    return state, empty.at[slot].set(False)

  return jax.lax.while_loop(cond, body, (state, empty))
