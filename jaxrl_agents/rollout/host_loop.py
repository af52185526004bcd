"""Multi-turn episodes with environments that run on the host (tools, databases, search).

The same Trajectory as `rollout.multiturn`, for environments written in Python
on strings (`envs.base.HostEnv`): each turn runs the jitted decode from the
carried KV cache, detokenizes the live replies, steps every episode's
environment in a thread pool under a per-step time limit, tokenizes the
answers as plain text (never control tokens) and appends them to the cache
with the jitted extend. The history is never re-rendered or re-tokenized.

An environment is hostile input too. A step that raises, runs past
`step_timeout_s` (from its own start), or returns something that is not a
usable `HostStep` (a non-string observation, a non-finite reward or info
value, a non-bool done) ends that episode: its tokens leave the loss (its
`policy_mask` is cleared: the policy is not graded on the environment's
failure), its reward is 0 and it is counted (`env_errors`, `env_timeouts`; the
first few are logged); the batch goes on. A failed reset fails its whole group
(its episodes share a prompt). Each call runs in its own daemon thread, so a
call that never returns blocks neither the loop nor the interpreter's exit;
it cannot be stopped, though (`env_calls_stuck` counts those still running).
Environment text is bounded before it is tokenized (MAX_RESET_CHARS, and
OBS_CHARS_PER_TOKEN per observation token); observations longer than
`obs_tokens` tokens are cut (`obs_truncated`).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents.envs import base
from jaxrl_agents.models import lm
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import multiturn, shapes
from jaxrl_agents.rollout import sampler as sampler_lib

log = logging.getLogger(__name__)

# Characters of environment text read at most: tokenizing is linear, but a
# hostile environment could hand over gigabytes. A longer first message fails
# its episode; a longer observation is cut (and then cut to obs_tokens).
MAX_RESET_CHARS = 16_384
OBS_CHARS_PER_TOKEN = 32


class Outcome(NamedTuple):
  """One environment call's result as the loop sees it."""

  step: Any  # the call's checked result; None when it failed
  failure: str | None  # "error" or "timeout"
  detail: str


class _Call(threading.Thread):
  """One environment call in its own daemon thread: a stuck call never blocks the loop, the
  next turn, or the interpreter's exit (a pool's worker threads would be joined at exit)."""

  def __init__(self, fn: Callable[[], Any]):
    super().__init__(daemon=True, name="host-env-step")
    self.fn, self.result, self.error = fn, None, None

  def run(self) -> None:
    try:
      self.result = self.fn()
    except BaseException as e:  # noqa: BLE001 - reported as the call's failure
      self.error = e


_stuck: list[_Call] = []  # calls that ran past their limit and have not returned yet


def stuck_calls() -> int:
  """Environment calls still running after their time limit (threads that cannot be stopped)."""
  _stuck[:] = [c for c in _stuck if c.is_alive()]
  return len(_stuck)


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float,
             check: Callable[[Any], None]) -> list[Outcome]:
  """Runs `calls` at once, each in its own thread with `timeout_s` from its start; each
  result is checked by `check` (raises on garbage).

  A call that raises, fails the check or has not returned in time gives an
  Outcome with its failure; nothing raises here. A CPU-bound call that never
  returns keeps a thread busy (counted by `stuck_calls`): give such
  environments their own time limits, or run them out of process.
  """
  threads = [_Call(fn) for fn in calls]
  deadline = time.monotonic() + timeout_s
  for t in threads:
    t.start()
  outcomes = []
  for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
    if t.is_alive():
      _stuck.append(t)
      outcomes.append(Outcome(None, "timeout", f"no answer within {timeout_s:g} s"))
      continue
    try:
      if t.error is not None:
        raise t.error
      check(t.result)
      outcomes.append(Outcome(t.result, None, ""))
    except Exception as e:  # noqa: BLE001 - the environment's failure is data, not a crash
      outcomes.append(Outcome(None, "error", f"{type(e).__name__}: {str(e)[:200]}"))
  return outcomes


def check_step(result: Any) -> None:
  """Raises TypeError/ValueError when a step's result is not a usable HostStep."""
  if not isinstance(result, base.HostStep):
    raise TypeError(f"step returned {type(result).__name__}, not HostStep")
  if not isinstance(result.obs, str):
    raise TypeError(f"observation is {type(result.obs).__name__}, not str")
  if not math.isfinite(float(result.reward)):
    raise ValueError(f"reward {result.reward!r} is not finite")
  if not isinstance(result.done, bool | np.bool_ | int) or isinstance(result.done, float):
    raise TypeError(f"done is {type(result.done).__name__}, not bool")
  if not isinstance(result.info, Mapping):
    raise TypeError(f"info is {type(result.info).__name__}, not a dict")
  for name, value in result.info.items():
    if not isinstance(name, str) or not isinstance(value, int | float | np.number) \
        or not math.isfinite(float(value)):
      raise ValueError(f"info[{name!r}] = {value!r} is not a finite number")


def check_reset(result: Any) -> None:
  if not isinstance(result, str) or not result:
    raise TypeError(f"reset returned {type(result).__name__} {str(result)[:40]!r}, not text")
  if len(result) > MAX_RESET_CHARS:
    raise ValueError(f"the first message has {len(result)} characters (at most "
                     f"{MAX_RESET_CHARS})")


def _tokens(tok, texts: Sequence[str], width: int) -> tuple[base.Tokens, int]:
  """Texts as plain-text tokens, left-aligned in [B, width]; and how many were cut."""
  rows = [tokenizer_lib.plain_ids(tok, t[:width * OBS_CHARS_PER_TOKEN]) if t else []
          for t in texts]
  return base.token_rows([r[:width] for r in rows], width), sum(len(r) > width for r in rows)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def _decode(params, cfg, context, rng, sampling, active):
  return sampler_lib.decode(params, cfg, context, rng, sampling, active=active, keep_cache=True)


@functools.partial(jax.jit, static_argnames=("cfg", "template", "stop_tokens"))
def _append(params, cfg, context, template, stop_tokens, reply, obs, keep):
  block = multiturn._env_block(template, stop_tokens, reply, obs, keep)
  return sampler_lib.extend(params, cfg, context, block.ids, block.mask), block


_answer_logprob = jax.jit(sampler_lib.answer_logprob, static_argnames=("cfg",))


def check_answer(result: Any) -> None:
  if not isinstance(result, str) or not result:
    raise TypeError(f"answer returned {type(result).__name__} {str(result)[:40]!r}, not text")


def _answers(tok, env, tasks, group_size: int, width: int, timeout_s: float,
             fails: _Failures) -> base.Tokens:
  """Each row's gold answer (`env.answer(task)`, on the host with the step's time limit) as
  plain-text tokens, real tokens first. A task whose answer failed fails its group (one
  error counted); an answer longer than `width` tokens is cut (counted: answer_truncated)."""
  outcomes = call_all([functools.partial(env.answer, task) for task in tasks], timeout_s,
                      check_answer)
  texts = []
  for t, outcome in enumerate(outcomes):
    if outcome.failure:
      fails.add(t * group_size, outcome)
      fails.failed[t * group_size:(t + 1) * group_size] = True
    texts += [outcome.step or ""] * group_size
  answers, cut = _tokens(tok, texts, width)
  fails.counters["answer_truncated"] = cut
  return answers


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def _prefill(params, cfg, ids, mask, cache_len):
  return sampler_lib.prefill(params, cfg, ids, mask, cache_len=cache_len)


class HostEpisodes(NamedTuple):
  """`multiturn.Episodes` (failed episodes out of the loss) and what went wrong.

  Attributes:
    episodes: the Episodes; a failed row's policy_mask is cleared and its reward 0.
    counters: env_errors, env_timeouts, obs_truncated, env_calls_stuck (ints).
    failed: bool[B] episodes an environment failure ended.
    failures: per row, the failure ("error: ..." / "timeout: ...") or None.
    unmasked: the Trajectory before failed rows were masked (for samples.jsonl).
  """

  episodes: multiturn.Episodes
  counters: dict[str, int]
  failed: np.ndarray
  failures: list[str | None]
  unmasked: Any


class _Failures:
  """Counts and remembers environment failures, logging the first few of a rollout."""

  def __init__(self, b: int):
    self.failed, self.why = np.zeros(b, bool), [None] * b
    self.counters = {"env_errors": 0, "env_timeouts": 0, "obs_truncated": 0}

  def add(self, row: int, outcome: Outcome) -> None:
    self.counters["env_errors" if outcome.failure == "error" else "env_timeouts"] += 1
    self.failed[row], self.why[row] = True, f"{outcome.failure}: {outcome.detail}"
    if sum(w is not None for w in self.why) <= 3:
      log.warning("host environment failed (episode %d): %s", row, self.why[row])


def _first_messages(episodes, group_size: int, timeout_s: float, fails: _Failures) -> list[str]:
  """Each episode's first message. A group whose episodes must share a prompt (GRPO compares
  them; scoring may run it once per group) fails whole if one reset fails."""
  starts = call_all([ep.reset for ep in episodes], timeout_s, check_reset)
  texts = []
  for g in range(0, len(episodes), group_size):
    group = starts[g:g + group_size]
    broken = [i for i, o in enumerate(group) if o.failure]
    for i in broken:
      fails.add(g + i, group[i])
    if broken:
      fails.failed[g:g + group_size] = True
      texts += ["The environment failed to start."] * len(group)
      continue
    if len({o.step for o in group}) > 1:
      raise ValueError("a host environment's reset() gave different first messages for one "
                       "task; the episodes of a group must start from the same prompt")
    texts += [o.step for o in group]
  return texts


def rollout(params, cfg: lm.CausalLM, tok, env: base.HostEnv,
            tasks: Sequence[Any], rng: jax.Array, sampling: sampler_lib.SamplingConfig, *,
            group_size: int, num_turns: int, obs_tokens: int, step_timeout_s: float,
            system: str | None = None, score_answers: bool = False,
            answer_tokens: int = 32) -> HostEpisodes:
  """G episodes of each task of `tasks`, at most `num_turns` turns (see the module docstring).

  Rows are task-major (row i plays task i // G), as in `multiturn.rollout`. With
  `score_answers`, the gold answer (`env.answer(task)`, at most `answer_tokens`
  tokens) is scored before every turn and after the last (`Episodes.answer_logp`).
  """
  template = multiturn.turn_template(tok, system, getattr(env, "preamble", ()))
  episodes = [env.episode(task) for task in tasks for _ in range(group_size)]
  fails = _Failures(len(episodes))
  rows = [list(template.opening) + tokenizer_lib.plain_ids(tok, text) + list(template.to_reply)
          for text in _first_messages(episodes, group_size, step_timeout_s, fails)]
  ids, mask = tokenizer_lib.pad_left(rows, 0, shapes.prompt_width(max(map(len, rows))))
  block_width = multiturn.user_block_width(template, obs_tokens)
  answers = _answers(tok, env, tasks, group_size, answer_tokens, step_timeout_s, fails) \
      if score_answers else None
  context = _prefill(params, cfg, jnp.asarray(ids), jnp.asarray(mask),
                     cache_len=ids.shape[1] + num_turns * (sampling.max_new_tokens + block_width)
                     + (answer_tokens if score_answers else 0))
  done, records = fails.failed.copy(), []
  score = lambda: _answer_logprob(params, cfg, context, answers.ids, answers.mask)
  for k in range(num_turns):
    answer_logp = score() if score_answers else None
    out, context = _decode(params, cfg, context, jax.random.fold_in(rng, k), sampling,
                           jnp.asarray(~done))
    # Special-token text stays in the replies: a tool's tag may be a special token.
    replies = tokenizer_lib.decode_completions(tok, out.tokens, out.lengths,
                                               sampling.stop_tokens, skip_special_tokens=False)
    obs, reward, finished, info = _step_all(episodes, replies, done, step_timeout_s, fails)
    finished |= k == num_turns - 1
    obs_block, cut = _tokens(tok, [o if not f else "" for o, f in zip(obs, finished,
                                                                        strict=True)],
                             obs_tokens)  # only what is appended
    fails.counters["obs_truncated"] += cut
    reply = base.Tokens(out.tokens, out.mask)
    context, block = _append(params, cfg, context, template, sampling.stop_tokens, reply,
                             obs_block, jnp.asarray(~finished))
    records.append(dict(reply=reply, logp=out.sampling_logprobs, block=block,
                        reward=jnp.asarray(reward), live=jnp.asarray(~done),
                        info={n: jnp.asarray(v) for n, v in info.items()}))
    if answer_logp is not None:
      records[-1]["answer_logp"] = answer_logp
    done = finished
    if done.all():
      break
  return _finish(ids, mask, records, num_turns, fails, score() if score_answers else None)


def _step_all(episodes, replies: list[str], done: np.ndarray, step_timeout_s: float,
              fails: _Failures) -> tuple[list[str], np.ndarray, np.ndarray, dict]:
  """Each live episode's step on its reply, each under the time limit: (observations,
  f32[B] rewards, bool[B] finished, {info name: f32[B]}); a failed step ends its episode."""
  b = len(episodes)
  live = np.flatnonzero(~done)
  outcomes = call_all([functools.partial(episodes[i].step, replies[i]) for i in live],
                      step_timeout_s, check_step)
  obs, reward, finished, info = [""] * b, np.zeros(b, np.float32), done.copy(), {}
  for i, outcome in zip(live, outcomes, strict=True):
    if outcome.failure:
      fails.add(i, outcome)
      finished[i] = True
      continue
    step = outcome.step
    obs[i], reward[i], finished[i] = step.obs, float(step.reward), bool(step.done)
    for name, value in step.info.items():
      info.setdefault(name, np.zeros(b, np.float32))[i] = float(value)
  return obs, reward, finished, info


def _finish(ids, mask, records: list[dict], num_turns: int, fails: _Failures,
            last_answer_logp=None) -> HostEpisodes:
  """HostEpisodes from the played turns; unplayed turns are recorded as not live."""
  b = ids.shape[0]
  records = _same_info_keys(records, b)
  unplayed = jax.tree.map(jnp.zeros_like, records[-1])
  if last_answer_logp is not None:  # nothing changes after the last turn played
    unplayed["answer_logp"] = last_answer_logp
  records += [unplayed] * (num_turns - len(records))
  eps = multiturn.finish(base.Tokens(jnp.asarray(ids), jnp.asarray(mask)),
                         jax.tree.map(lambda *xs: jnp.stack(xs), *records), group_size=1,
                         last_answer_logp=last_answer_logp)
  # An episode the environment broke teaches nothing: out of the loss, reward 0.
  keep = jnp.asarray(~fails.failed)
  # Its turns leave turn-level statistics too (group means, GiGPO's step groups).
  traj = eps.traj.replace(policy_mask=eps.traj.policy_mask & keep[:, None],
                          turn_rewards=jnp.where(keep[:, None], eps.traj.turn_rewards, 0.0),
                          turn_mask=eps.traj.turn_mask & keep[:, None])
  counters = {**fails.counters, "env_calls_stuck": stuck_calls()}
  return HostEpisodes(eps._replace(traj=traj), counters, fails.failed.copy(), fails.why,
                      eps.traj)


def _same_info_keys(records: list[dict], b: int) -> list[dict]:
  """Every turn's info with the union of keys (a key a turn never saw is 0 there)."""
  names = sorted({n for r in records for n in r["info"]})
  zeros = jnp.zeros(b, jnp.float32)
  return [{**r, "info": {n: r["info"].get(n, zeros) for n in names}} for r in records]
