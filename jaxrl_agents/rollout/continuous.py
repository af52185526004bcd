"""Continuous batching: N sequences through B cache rows ("slots") in one jitted loop.

A static batch (`sampler.generate`) decodes until its longest reply is done, every
finished row decoding padding meanwhile; with long-tailed reply lengths most of a long
rollout is that padding. Here, when a slot's sequence ends (a stop token or its own
budget), the slot starts the next queued sequence and goes on, without leaving the
`lax.while_loop`, so every decode step serves live sequences while any are queued.
Every prompt is prefilled once, before the loop (G samples of a prompt share it); a
slot starting a sequence copies its prompt's keys and values into its row.

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

from jaxrl_agents.models import lm, lora, transformer
from jaxrl_agents.rollout.sampler import SampleOutput, prefill
from jaxrl_agents.rollout.sampling import SamplingConfig, pick


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "slots", "samples_per_prompt"))
def generate(params, cfg: lm.CausalLM, prompt_tokens: jax.Array, prompt_mask: jax.Array,
             keys: jax.Array, sampling: SamplingConfig, *, slots: int,
             max_new_tokens: jax.Array | None = None,
             samples_per_prompt: int = 1) -> SampleOutput:
  """Completions of N = P * G sequences, decoded `slots` at a time.

  Args:
    params: model parameters.
    cfg: the architecture (static; the project's transformer).
    prompt_tokens: int32[P, Lp], left-padded; sequence i continues prompt i // G.
    prompt_mask: bool[P, Lp], True on real prompt tokens (every row needs one).
    keys: N PRNG keys, one per sequence (unused when greedy).
    sampling: the SamplingConfig (static); `max_new_tokens` is the longest reply.
    slots: B (static), the cache rows decoding at once; at most N.
    max_new_tokens: optional int32[N], each sequence's own budget (1 to
      `sampling.max_new_tokens`); default the config's for all.
    samples_per_prompt: G (static), sequences per prompt, in queue order.

  Returns:
    SampleOutput of N rows in queue order, `sampling.max_new_tokens` columns.
  """
  if isinstance(cfg, lora.LoraLM):  # adapters merged once, then the base's ring decoding
    params, cfg = cfg.loop_params(params)["base"], cfg.base
  if not isinstance(cfg, transformer.TransformerConfig):
    raise ValueError("continuous batching needs the project's transformer (its decode step "
                     f"reads the cache as a ring); got {type(cfg).__name__}")
  if samples_per_prompt < 1:
    raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
  p, lp = prompt_tokens.shape
  n = p * samples_per_prompt
  if not 1 <= slots <= n:
    raise ValueError(f"slots must be in [1, {n}] (the number of sequences), got {slots}")
  if sampling.compact_min_rows:
    raise ValueError("compact_min_rows is the static batch's; continuous batching refills "
                     "its rows instead")
  width = sampling.max_new_tokens
  ring = lp + width
  budget = (jnp.full((n,), width, jnp.int32) if max_new_tokens is None
            else jnp.clip(max_new_tokens.astype(jnp.int32), 1, width))
  params = lm.loop_params(cfg, params)

  # Every prompt prefilled once, in one batch; a slot starting a sequence copies its
  # prompt's keys, values and next-token logits from here (no model call in the loop).
  prompts = prefill(params, cfg, prompt_tokens, prompt_mask, cache_len=lp)
  start = functools.partial(_refill, prompts=prompts, group=samples_per_prompt, n=n, ring=ring)
  state, _ = start(_empty_state(cfg, prompts, slots, n, width, ring, sampling.pad_id),
                   jnp.ones((slots,), bool))
  step = functools.partial(_step, params=params, cfg=cfg, keys=keys, budget=budget,
                           sampling=sampling, ring=ring, start=start)
  state = jax.lax.while_loop(lambda s: jnp.any(s["seq"] < n), step, state)
  mask = jnp.arange(width)[None, :] < state["lengths"][:, None]
  return SampleOutput(tokens=state["tokens"], logprobs=state["logp"],
                      sampling_logprobs=state["slogp"], mask=mask, lengths=state["lengths"])


def _empty_state(cfg, prompts, slots: int, n: int, width: int, ring: int, pad_id: int):
  """The loop's state before any slot holds a sequence (`_refill` starts them)."""
  lp = prompts.cache.valid.shape[1]
  return dict(
      cache=cfg.init_cache(slots, ring, dtype="float32"),
      logits=jnp.zeros((prompts.logits.shape[0], slots), jnp.float32),
      position=jnp.zeros((slots,), jnp.int32),
      seq=jnp.full((slots,), n, jnp.int32),  # each slot's sequence (n: none)
      count=jnp.zeros((slots,), jnp.int32),  # tokens each slot's sequence has so far
      queued=jnp.int32(0),  # the next sequence to start
      writes=jnp.int32(lp),  # decode writes so far + Lp: the ring's write index, unreduced
      tokens=jnp.full((n, width), pad_id, jnp.int32),
      logp=jnp.zeros((n, width), jnp.float32), slogp=jnp.zeros((n, width), jnp.float32),
      lengths=jnp.zeros((n,), jnp.int32))


def _step(state, *, params, cfg, keys, budget, sampling: SamplingConfig, ring: int, start):
  """One token for every live slot: pick it, record it, decode it into the ring; then the
  slots whose sequences finished start the next queued ones (`start`: `_refill`)."""
  n = state["tokens"].shape[0]
  stops = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)
  live = state["seq"] < n
  seq = jnp.minimum(state["seq"], n - 1)
  uniform = None
  if not sampling.greedy:
    draw = lambda key, t: jax.random.uniform(jax.random.fold_in(key, t))
    uniform = jax.vmap(draw)(keys[seq], state["count"])
  token, logp, slogp = pick(state["logits"], None, sampling, uniform=uniform)
  token = jnp.where(live, token, sampling.pad_id)
  row, column = jnp.where(live, state["seq"], n), state["count"]  # row n: dropped
  record = lambda a, v: a.at[row, column].set(v, mode="drop")
  count = state["count"] + live
  finished = live & (jnp.isin(token, stops) | (count >= budget[seq]))
  cache = state["cache"]._replace(index=state["writes"] % ring)
  logits, cache = cfg.decode_step(params, token, state["position"], cache, vocab_major=True)
  state = dict(state, cache=cache, logits=logits.astype(jnp.float32),
               position=state["position"] + 1, count=count, writes=state["writes"] + 1,
               tokens=record(state["tokens"], token), logp=record(state["logp"], logp),
               slogp=record(state["slogp"], slogp),
               lengths=state["lengths"].at[row].set(count, mode="drop"))
  state, unfilled = start(state, finished)
  # A finished slot the queue had nothing left for holds no sequence from now on.
  state["seq"] = jnp.where(unfilled, n, state["seq"])
  return state


def _refill(state, empty, *, prompts, group: int, n: int, ring: int):
  """Starts the next queued sequences in the `empty` slots (bool[B]), one at a time, until
  the slots or the queue run out; returns (state, the slots still empty). `prompts` is
  the prompts' prefill (a Continuation of P rows with Lp cache slots each)."""
  lp = prompts.cache.valid.shape[1]

  def cond(carry):
    state, empty = carry
    return jnp.any(empty) & (state["queued"] < n)

  def body(carry):
    state, empty = carry
    slot, q = jnp.argmax(empty), state["queued"]
    prompt = q // group
    # The prompt takes the Lp ring slots before the next write; the rest of the row is
    # the sequence's replies to come, invalid until written.
    where = (state["writes"] - lp + jnp.arange(lp)) % ring

    def row(buffer, table, axis):
      """`buffer`'s row `slot` (slots on `axis`): the prompt's table row at `where`."""
      new = jnp.zeros(buffer.shape[1:], buffer.dtype).at[
          (slice(None),) * (axis - 1) + (where,)].set(table[prompt].astype(buffer.dtype))
      return jax.lax.dynamic_update_index_in_dim(buffer, new, slot, 0)

    cache, table = state["cache"], prompts.cache
    cache = cache._replace(
        k=tuple(row(b, t, 3) for b, t in zip(cache.k, table.k, strict=True)),
        v=tuple(row(b, t, 2) for b, t in zip(cache.v, table.v, strict=True)),
        valid=row(cache.valid, table.valid, 1))
    state = dict(state, cache=cache,
                 logits=state["logits"].at[:, slot].set(prompts.logits[:, prompt]),
                 position=state["position"].at[slot].set(prompts.next_position[prompt]),
                 seq=state["seq"].at[slot].set(q), count=state["count"].at[slot].set(0),
                 queued=q + 1)
    return state, empty.at[slot].set(False)

  return jax.lax.while_loop(cond, body, (state, empty))
