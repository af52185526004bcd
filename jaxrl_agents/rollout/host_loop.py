"""Multi-turn episodes with environments that run on the host (tools, databases, search).

The same Trajectory as `rollout.multiturn`, for environments written in Python
on strings (`envs.base.HostEnv`): each turn runs the jitted decode from the
carried KV cache, detokenizes the live replies, steps every episode's
environment in a thread pool under a per-step time limit, tokenizes the
answers as plain text (never control tokens) and appends them to the cache
with the jitted extend. The history is never re-rendered or re-tokenized.

An environment is hostile input too. A step that raises, runs past
`step_timeout_s`, or returns something that is not a `HostStep` (a non-string
observation, a non-finite reward) ends that episode: it scores 0, its tokens
leave the loss (its `policy_mask` is cleared: the policy is not graded on the
environment's failure) and it is counted (`env_errors`, `env_timeouts`); the
batch goes on. A thread stuck in a step cannot be stopped; the pool it
occupies is abandoned (left to finish in the background) and the next step
gets a fresh one, so one stuck environment never stalls training. Observations
longer than `obs_tokens` tokens are cut (counted as `obs_truncated`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.envs import base
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import transformer
from jaxrl_agents.rollout import multiturn, shapes
from jaxrl_agents.rollout import sampler as sampler_lib

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
  global _pool
  if _pool is None:
    _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="host-env")
  return _pool


def _abandon_executor() -> None:
  """Leaves a pool with a stuck thread to finish on its own; the next call makes a new one."""
  global _pool
  if _pool is not None:
    _pool.shutdown(wait=False, cancel_futures=True)
    _pool = None


class Outcome(NamedTuple):
  """One environment call's result as the loop sees it."""

  step: base.HostStep | None  # None when the call failed
  failure: str | None  # "error" or "timeout"
  detail: str


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float, check: Callable[[Any], None],
             workers: int = 32) -> list[Outcome]:
  """Runs `calls` concurrently; each result is checked by `check` (raises on garbage).

  A call that raises, fails the check or is unfinished `timeout_s` after the
  calls started gives an Outcome with its failure; none of them raises here.
  """
  pool = _executor(workers)
  futures = [pool.submit(fn) for fn in calls]
  done, _ = concurrent.futures.wait(futures, timeout=timeout_s)
  outcomes, stuck = [], False
  for future in futures:
    if future not in done:
      future.cancel()
      stuck = True
      outcomes.append(Outcome(None, "timeout", f"no answer within {timeout_s:g} s"))
      continue
    try:
      result = future.result()
      check(result)
      outcomes.append(Outcome(result, None, ""))
    except Exception as e:  # noqa: BLE001 - the environment's failure is data, not a crash
      outcomes.append(Outcome(None, "error", f"{type(e).__name__}: {str(e)[:200]}"))
  if stuck:
    _abandon_executor()
  return outcomes


def check_step(result: Any) -> None:
  """Raises TypeError/ValueError when a step's result is not a usable HostStep."""
  if not isinstance(result, base.HostStep):
    raise TypeError(f"step returned {type(result).__name__}, not HostStep")
  if not isinstance(result.obs, str):
    raise TypeError(f"observation is {type(result.obs).__name__}, not str")
  if not math.isfinite(float(result.reward)):
    raise ValueError(f"reward {result.reward!r} is not finite")


def check_reset(result: Any) -> None:
  if not isinstance(result, str) or not result:
    raise TypeError(f"reset returned {type(result).__name__} {str(result)[:40]!r}, not text")


def _tokens(tok, texts: Sequence[str], width: int) -> tuple[base.Tokens, int]:
  """Texts as plain-text tokens, left-aligned in [B, width]; and how many were cut."""
  ids = np.zeros((len(texts), width), np.int32)
  mask = np.zeros((len(texts), width), bool)
  cut = 0
  for i, text in enumerate(texts):
    row = tokenizer_lib.plain_ids(tok, text) if text else []
    cut += len(row) > width
    row = row[:width]
    ids[i, :len(row)], mask[i, :len(row)] = row, True
  return base.Tokens(jnp.asarray(ids), jnp.asarray(mask)), cut


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def _decode(params, cfg, context, rng, sampling, active):
  return sampler_lib.decode(params, cfg, context, rng, sampling, active=active, keep_cache=True)


@functools.partial(jax.jit, static_argnames=("cfg", "template", "stop_tokens"))
def _append(params, cfg, context, template, stop_tokens, reply, obs, keep):
  block = multiturn._env_block(template, stop_tokens, reply, obs, keep)
  return sampler_lib.extend(params, cfg, context, block.ids, block.mask), block


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def _prefill(params, cfg, ids, mask, cache_len):
  return sampler_lib.prefill(params, cfg, ids, mask, cache_len=cache_len)


class HostEpisodes(NamedTuple):
  """`multiturn.Episodes` plus the loop's counters (ints over the batch)."""

  episodes: multiturn.Episodes
  counters: dict[str, int]


def rollout(params, cfg: transformer.TransformerConfig, tok, env: base.HostEnv,
            tasks: Sequence[Any], rng: jax.Array, sampling: sampler_lib.SamplingConfig, *,
            group_size: int, num_turns: int, obs_tokens: int, step_timeout_s: float,
            system: str | None = None) -> HostEpisodes:
  """G episodes of each task of `tasks`, at most `num_turns` turns (see the module docstring).

  Rows are task-major (row i plays task i // G), as in `multiturn.rollout`.
  """
  template = multiturn.turn_template(tok, system)
  episodes = [env.episode(task) for task in tasks for _ in range(group_size)]
  b, counters = len(episodes), {"env_errors": 0, "env_timeouts": 0, "obs_truncated": 0}
  failed = np.zeros(b, bool)
  starts = call_all([ep.reset for ep in episodes], step_timeout_s, check_reset)
  first = []
  for i, outcome in enumerate(starts):
    if outcome.failure:
      counters["env_errors" if outcome.failure == "error" else "env_timeouts"] += 1
      failed[i] = True
    first.append(outcome.step if not outcome.failure else "The environment failed to start.")
  rows = [list(template.opening) + tokenizer_lib.plain_ids(tok, text) + list(template.to_reply)
          for text in first]
  ids, mask = tokenizer_lib.pad_left(rows, 0, shapes.prompt_width(max(map(len, rows))))
  block_width = len(template.to_user) + obs_tokens + len(template.to_reply)
  context = _prefill(params, cfg, jnp.asarray(ids), jnp.asarray(mask),
                     cache_len=ids.shape[1] + num_turns * (sampling.max_new_tokens + block_width))
  done, records = failed.copy(), []
  for k in range(num_turns):
    out, context = _decode(params, cfg, context, jax.random.fold_in(rng, k), sampling,
                           jnp.asarray(~done))
    lengths = np.asarray(out.lengths)
    replies = tokenizer_lib.decode_completions(tok, np.asarray(out.tokens), lengths,
                                               sampling.stop_tokens)
    live = np.flatnonzero(~done)
    outcomes = call_all([functools.partial(episodes[i].step, replies[i]) for i in live],
                        step_timeout_s, check_step)
    obs, reward = [""] * b, np.zeros(b, np.float32)
    finished, info = done.copy(), {}
    for i, outcome in zip(live, outcomes, strict=True):
      if outcome.failure:
        counters["env_errors" if outcome.failure == "error" else "env_timeouts"] += 1
        failed[i] = finished[i] = True
        continue
      step = outcome.step
      obs[i], reward[i] = step.obs, float(step.reward)
      finished[i] = bool(step.done)
      for name, value in step.info.items():
        info.setdefault(name, np.zeros(b, np.float32))[i] = float(value)
    if k == num_turns - 1:
      finished[:] = True
    obs_block, cut = _tokens(tok, [o if not f else "" for o, f in zip(obs, finished,
                                                                        strict=True)],
                             obs_tokens)  # only what is appended
    counters["obs_truncated"] += cut
    reply = base.Tokens(out.tokens, out.mask)
    context, block = _append(params, cfg, context, template, sampling.stop_tokens, reply,
                             obs_block, jnp.asarray(~finished))
    records.append(dict(reply=reply, logp=out.sampling_logprobs, block=block,
                        reward=jnp.asarray(reward), live=jnp.asarray(~done),
                        info={n: jnp.asarray(v) for n, v in info.items()}))
    done = finished
    if done.all():
      break
  records = _same_info_keys(records, b)
  records += [jax.tree.map(jnp.zeros_like, records[-1])] * (num_turns - len(records))
  eps = multiturn.finish(base.Tokens(jnp.asarray(ids), jnp.asarray(mask)),
                         jax.tree.map(lambda *xs: jnp.stack(xs), *records), group_size=1)
  # An episode the environment broke teaches nothing: out of the loss, reward 0.
  keep = jnp.asarray(~failed)
  traj = eps.traj.replace(policy_mask=eps.traj.policy_mask & keep[:, None],
                          turn_rewards=jnp.where(keep[:, None], eps.traj.turn_rewards, 0.0))
  return HostEpisodes(eps._replace(traj=traj), counters)


def _same_info_keys(records: list[dict], b: int) -> list[dict]:
  """Every turn's info with the union of keys (a key a turn never saw is 0 there)."""
  names = sorted({n for r in records for n in r["info"]})
  zeros = jnp.zeros(b, jnp.float32)
  return [{**r, "info": {n: r["info"].get(n, zeros) for n in names}} for r in records]
