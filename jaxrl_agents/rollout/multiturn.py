"""Multi-turn episodes with a JAX-native environment, as one `lax.scan` over turns.

Each turn decodes the agent's reply from the carried KV cache (`sampler.decode`
with `keep_cache`), steps the vmapped environment on the reply's tokens, and
appends the environment's answer to the cache (`sampler.extend`), wrapped in
the chat template's tokens. Nothing is ever prefilled twice or re-tokenized:
the template's pieces are tokenized once (`turn_template`), the environment
writes token ids, and the Trajectory holds exactly the tokens the policy
sampled and conditioned on. Finished episodes stop generating (`decode`'s
`active`) and get nothing appended.

Trajectory layout, B = P * G rows (G episodes per task, prompt-major), K turns,
N = the reply budget per turn, Ob = the width of an environment block:

  [ prompt Lp | reply 0 (N) | env block 0 (Ob) | reply 1 (N) | ... | reply K-1 (N) ]

Each block is fixed width; its unused columns are invalid (attention and
scoring skip them). `policy_mask` marks the reply tokens only; `turn_id` is the
turn of each reply token; `turn_rewards[:, k]` is what the environment returned
after reply k, and `turn_mask[:, k]` says whether turn k happened.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import secrets
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents import types
from jaxrl_agents.envs import base
from jaxrl_agents.models import lm
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import sampler as sampler_lib


@dataclasses.dataclass(frozen=True)
class TurnTemplate:
  """The chat template's own tokens around an episode's messages (hashable: jit-static).

  Attributes:
    opening: everything before the first user message's content (system turn,
      user header).
    to_reply: after a user message's content, up to where the reply starts
      (end of the user turn, the assistant header: the generation prompt).
    to_user: after a reply's content, up to the next user message's content
      (the end of the assistant turn, the user header). Its first token, when it
      is a stop token the reply already ended with, is not written twice.
  """

  opening: tuple[int, ...]
  to_reply: tuple[int, ...]
  to_user: tuple[int, ...]


def turn_template(tokenizer, system: str | None = None,
                  preamble: Sequence[dict[str, str]] = ()) -> TurnTemplate:
  """Cuts the tokenizer's chat template into TurnTemplate pieces, by rendering placeholders.

  `preamble` is a conversation that comes before the episode's first message (an
  environment's worked example, `base.check_preamble`); it becomes part of `opening`.
  """
  base.check_preamble(tokenizer, preamble)
  nonce = secrets.token_hex(8)
  mark = lambda i: f"[[turn-{nonce}-{i}]]"
  messages = [*preamble, {"role": "user", "content": mark(0)},
              {"role": "assistant", "content": mark(1)}, {"role": "user", "content": mark(2)}]
  if system is not None:
    messages = [{"role": "system", "content": system}] + messages
  first = tokenizer_lib.chat_prompt(tokenizer, messages[:-2])
  full = tokenizer_lib.chat_prompt(tokenizer, messages)
  opening, rest = first.split(mark(0))
  pieces = re.split(rf"\[\[turn-{nonce}-\d\]\]", full)
  if len(pieces) != 4 or pieces[0] != opening or pieces[3] != rest:
    raise ValueError("the chat template does not write each message once and a reply after a "
                     "user message the same way every turn; multi-turn rollouts need it to")
  encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
  return TurnTemplate(opening=encode(opening), to_reply=encode(rest), to_user=encode(pieces[2]))


class Episodes(NamedTuple):
  """What `rollout` returns.

  Attributes:
    traj: the Trajectory (see the module docstring).
    info: per-episode sums of the environment's info entries, f32[B] each.
    turns: int32[B] turns each episode took.
    turn_keys: int32[B, K] the state each turn was taken from (`env.state_key`;
      -1 for a turn that did not happen or an environment without state keys).
    turn_potentials: f32[B, K] the potential of that state (`env.potential`; 0
      without one).
    answer_logp: with `score_answers`, f32[B, K + 1]: the policy's mean log-prob
      per token of the gold answer (`env.answer`) as its reply before turn k,
      IGPO's `credit.igpo_turn_rewards` input; else None. Defined before each
      turn a row played; the columns after its last turn are not (no question
      was asked there: IGPO puts the return on the last turn instead).
    roles: self-play (`rollout.self_play`): int32[B] the player each row played
      (-1: nothing to credit, a side that never moved or an unfinished game); else
      None.
  """

  traj: types.Trajectory
  info: dict[str, jax.Array]
  turns: jax.Array
  turn_keys: jax.Array
  turn_potentials: jax.Array
  answer_logp: jax.Array | None = None
  roles: jax.Array | None = None


def _const(ids: tuple[int, ...], batch: int) -> base.Tokens:
  return base.Tokens(jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (batch, len(ids))),
                     jnp.ones((batch, len(ids)), bool))


def reply_ended(reply: base.Tokens, token: int) -> jax.Array:
  """bool[B]: each reply's last real token is `token` (a stop token it ended with)."""
  lengths = reply.mask.sum(-1)
  last = jnp.take_along_axis(reply.ids, jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  return (lengths > 0) & (last == token)


def user_block(template: TurnTemplate, stop_tokens: tuple[int, ...], obs: base.Tokens,
               keep: jax.Array, *, ended: jax.Array, first: jax.Array | None = None
               ) -> base.Tokens:
  """A user message after a reply: [end of turn] + to_user + obs + to_reply, left-padded.

  The end-of-turn token (to_user's first, when it is a stop token) is written
  only where the reply did not end with it (`ended` False: a reply cut at the
  budget). Rows with `first` True get the message right after the template's
  opening instead (no reply before it: obs + to_reply only); rows with keep
  False get an all-padding block.
  """
  b = obs.ids.shape[0]
  to_user = template.to_user
  after_reply = jnp.ones((b,), bool) if first is None else ~first
  closing = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), bool)
  if to_user and to_user[0] in stop_tokens:
    closing = (jnp.full((b, 1), to_user[0], jnp.int32), (~ended & after_reply)[:, None])
    to_user = to_user[1:]
  header = _const(to_user, b)
  block = base.concat(base.Tokens(*closing),
                      base.Tokens(header.ids, header.mask & after_reply[:, None]), obs,
                      _const(template.to_reply, b))
  block = base.Tokens(block.ids, block.mask & keep[:, None])
  return base.pack(block, side="left")


def user_block_width(template: TurnTemplate, obs_width: int) -> int:
  """The width of `user_block`'s blocks for observations of `obs_width`."""
  return len(template.to_user) + obs_width + len(template.to_reply)


def _env_block(template: TurnTemplate, stop_tokens: tuple[int, ...], reply: base.Tokens,
               obs: base.Tokens, keep: jax.Array) -> base.Tokens:
  """The tokens appended after a reply (`user_block`); rows with keep False get padding."""
  to_user = template.to_user
  ended = reply_ended(reply, to_user[0]) if to_user else jnp.ones(obs.ids.shape[:1], bool)
  return user_block(template, stop_tokens, obs, keep, ended=ended)


def prompt_tokens(env, template: TurnTemplate, tasks: Any, keys: jax.Array
                  ) -> tuple[Any, base.Tokens]:
  """(environment states, left-padded first prompts) of P tasks."""
  states, obs = jax.vmap(env.reset)(keys, tasks)
  p = obs.ids.shape[0]
  prompt = base.concat(_const(template.opening, p), obs, _const(template.to_reply, p))
  return states, base.pack(prompt, side="left")


class Carry(NamedTuple):
  """What one turn hands the next: the cache, the environments' states, finished rows, and
  the gold answers each turn scores (`score_answers`; else None)."""

  context: sampler_lib.Continuation
  states: Any
  done: jax.Array  # bool[B]
  answers: base.Tokens | None = None


def start(params, cfg: lm.CausalLM, env, template: TurnTemplate, tasks: Any,
          rng: jax.Array, sampling: sampler_lib.SamplingConfig, *, group_size: int,
          num_turns: int, score_answers: bool = False) -> tuple[Carry, base.Tokens]:
  """Resets P environments and prefills their prompts G times: (the first Carry, the
  left-padded prompts [P, Lp])."""
  p = jax.tree.leaves(tasks)[0].shape[0]
  states, prompt = prompt_tokens(env, template, tasks, jax.random.split(rng, p))
  states = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), states)
  answers = None
  if score_answers:
    if not hasattr(env, "answer"):
      raise ValueError(f"{type(env).__name__} has no answer(task): nothing to score")
    answers = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0),
                           jax.vmap(env.answer)(tasks))
  block_width = user_block_width(template, env.obs_width)
  # Every turn, the last included, appends a block (the last one all padding),
  # and the gold answer is scored after the last: the cache has room for all of
  # them, so no write ever lands past its end.
  context = sampler_lib.prefill(
      params, cfg, prompt.ids, prompt.mask,
      cache_len=prompt.ids.shape[1] + num_turns * (sampling.max_new_tokens + block_width)
      + (answers.ids.shape[-1] if score_answers else 0),
      samples_per_prompt=group_size)
  return Carry(context, states, jnp.zeros((p * group_size,), bool), answers), prompt


def score_answer(params, cfg: lm.CausalLM, carry: Carry) -> jax.Array:
  """f32[B]: the gold answers' mean log-prob per token as the next reply (`Episodes`)."""
  return sampler_lib.answer_logprob(params, cfg, carry.context, carry.answers.ids,
                                    carry.answers.mask)


def play_turn(params, cfg: lm.CausalLM, env, template: TurnTemplate,
              sampling: sampler_lib.SamplingConfig, carry: Carry, rng: jax.Array, k, *,
              num_turns: int) -> tuple[Carry, dict]:
  """Turn k: decode the live rows' replies, step their environments, append the answers.

  Returns the next Carry and the turn's record (reply, sampling log-probs, the
  appended block, reward, which rows were live, info; with answers, the answer's
  log-prob before the turn).
  """
  answer_logp = None if carry.answers is None else score_answer(params, cfg, carry)
  out, context = sampler_lib.decode(params, cfg, carry.context, jax.random.fold_in(rng, k),
                                    sampling, active=~carry.done, keep_cache=True)
  reply = base.Tokens(out.tokens, out.mask)
  step = jax.vmap(env.step)(carry.states, reply)
  if step.obs.ids.shape[-1] != env.obs_width:  # the cache has room for obs_width only
    raise ValueError(f"{type(env).__name__}.step returned observations of width "
                     f"{step.obs.ids.shape[-1]}, its obs_width is {env.obs_width}")
  live = ~carry.done
  b = live.shape[0]
  key = jax.vmap(env.state_key)(carry.states) if hasattr(env, "state_key") \
      else jnp.full((b,), -1, jnp.int32)
  potential = jax.vmap(env.potential)(carry.states) if hasattr(env, "potential") \
      else jnp.zeros((b,), jnp.float32)
  states = jax.tree.map(lambda new, old: jnp.where(
      live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old), step.state, carry.states)
  finished = carry.done | step.done | (k == num_turns - 1)
  block = _env_block(template, sampling.stop_tokens, reply, step.obs, ~finished)
  context = sampler_lib.extend(params, cfg, context, block.ids, block.mask)
  record = dict(reply=reply, logp=out.sampling_logprobs, block=block,
                reward=jnp.where(live, step.reward, 0.0), live=live,
                key=jnp.where(live, key, -1).astype(jnp.int32),
                potential=jnp.where(live, potential, 0.0).astype(jnp.float32),
                info={name: jnp.where(live, v, 0.0) for name, v in step.info.items()})
  if answer_logp is not None:
    record["answer_logp"] = answer_logp
  return Carry(context, states, finished, carry.answers), record


def finish(prompt: base.Tokens, turns: dict, group_size: int,
           last_answer_logp: jax.Array | None = None) -> Episodes:
  """Episodes from the prompts and the turns' records stacked along a leading K axis (and,
  with answers scored, the answer's log-prob after the last turn)."""
  traj = _trajectory(jnp.repeat(prompt.ids, group_size, 0),
                     jnp.repeat(prompt.mask, group_size, 0), turns)
  info = {k: v.sum(0) for k, v in turns["info"].items()}
  live = turns["live"].T
  keys = jnp.where(live, turns["key"].T, -1) if "key" in turns \
      else jnp.full(live.shape, -1, jnp.int32)  # turns never played hold zeros
  potentials = turns["potential"].T if "potential" in turns else jnp.zeros(live.shape)
  answer_logp = None
  if last_answer_logp is not None:
    answer_logp = jnp.concatenate([turns["answer_logp"].T, last_answer_logp[:, None]], 1)
  return Episodes(traj=traj, info=info, turns=live.sum(1).astype(jnp.int32),
                  turn_keys=keys, turn_potentials=potentials.astype(jnp.float32),
                  answer_logp=answer_logp)


@functools.partial(jax.jit, static_argnames=("cfg", "env", "template", "sampling", "group_size",
                                             "num_turns", "score_answers"))
def rollout(params, cfg: lm.CausalLM, env, template: TurnTemplate,
            tasks: Any, rng: jax.Array, sampling: sampler_lib.SamplingConfig, *,
            group_size: int, num_turns: int, score_answers: bool = False) -> Episodes:
  """G episodes of each of P tasks, at most `num_turns` turns of at most
  `sampling.max_new_tokens` reply tokens each, as one program (`lax.scan` over turns).

  Args:
    params: the policy.
    cfg: its architecture (static).
    env: a JAX-native environment (static; `envs.base`).
    template: the chat template's pieces (`turn_template`, static).
    tasks: a pytree of P tasks (`env.sample_task`, vmapped).
    rng: PRNG key; the episodes are a deterministic function of it.
    sampling: the SamplingConfig (static).
    group_size: G episodes per task (static).
    num_turns: K (static).
    score_answers: also score the environment's gold answer (`env.answer`)
      before every turn and after the last (`Episodes.answer_logp`; static).

  Returns:
    Episodes of B = P * G rows.
  """
  reset_rng, rng = jax.random.split(rng)
  carry, prompt = start(params, cfg, env, template, tasks, reset_rng, sampling,
                        group_size=group_size, num_turns=num_turns, score_answers=score_answers)
  turn = functools.partial(play_turn, params, cfg, env, template, sampling, rng=rng,
                           num_turns=num_turns)
  carry, turns = jax.lax.scan(lambda c, k: turn(c, k=k), carry, jnp.arange(num_turns))
  return finish(prompt, turns, group_size,
                score_answer(params, cfg, carry) if score_answers else None)


def _trajectory(prompt_ids, prompt_mask, turns: dict, *, message_first: bool = False
                ) -> types.Trajectory:
  """The Trajectory of scanned turns (leading axis K): replies and env blocks interleaved,
  the last turn's (never appended) env block dropped; with `message_first`, each turn's
  block comes before its reply (a user message, then the answer: `rollout.self_play`)."""
  num_turns, b = turns["live"].shape
  ids, valid, policy, turn_id, logp = [prompt_ids], [prompt_mask], [], [], []
  spans, column = [], prompt_ids.shape[1]
  policy.append(jnp.zeros_like(prompt_mask))
  turn_id.append(jnp.full(prompt_ids.shape, -1, jnp.int32))
  logp.append(jnp.zeros(prompt_ids.shape, jnp.float32))
  for k in range(num_turns):
    reply, block = jax.tree.map(lambda x, k=k: x[k], (turns["reply"], turns["block"]))
    if message_first:
      pieces = [(block, False), (reply, True)]
    else:
      pieces = [(reply, True)] + ([(block, False)] if k < num_turns - 1 else [])
    for piece, is_reply in pieces:
      if is_reply:
        spans.append((column, piece.ids.shape[1]))
      column += piece.ids.shape[1]
      ids.append(jnp.where(piece.mask, piece.ids, 0))  # unused columns hold 0, whatever ran
      valid.append(piece.mask)
      policy.append(piece.mask if is_reply else jnp.zeros_like(piece.mask))
      turn_id.append(jnp.where(piece.mask & is_reply, k, -1).astype(jnp.int32))
      logp.append(jnp.where(piece.mask & is_reply, turns["logp"][k], 0.0) if is_reply
                  else jnp.zeros(piece.ids.shape, jnp.float32))
  cat = lambda xs: jnp.concatenate(xs, axis=1)
  return types.Trajectory(
      tokens=cat(ids), valid=cat(valid), policy_mask=cat(policy), turn_id=cat(turn_id),
      sampling_logprobs=cat(logp), turn_rewards=turns["reward"].T.astype(jnp.float32),
      turn_mask=turns["live"].T, prompt_width=prompt_ids.shape[1], reply_spans=tuple(spans))


_start = jax.jit(start, static_argnames=("cfg", "env", "template", "sampling", "group_size",
                                         "num_turns", "score_answers"))
_score_answer = jax.jit(score_answer, static_argnames=("cfg",))
_play_turn = jax.jit(play_turn, static_argnames=("cfg", "env", "template", "sampling",
                                                 "num_turns"))


def rollout_by_turn(params, cfg: lm.CausalLM, env, template: TurnTemplate,
                    tasks: Any, rng: jax.Array, sampling: sampler_lib.SamplingConfig, *,
                    group_size: int, num_turns: int, score_answers: bool = False) -> Episodes:
  """`rollout` with the turns driven from Python (one jitted program per turn).

  The same episodes as `rollout`, token for token; it stops as soon as every
  episode has finished (the scan always runs K turns), at the price of a host
  round trip per turn. The turns never played are recorded as not live.
  """
  reset_rng, rng = jax.random.split(rng)
  carry, prompt = _start(params, cfg, env, template, tasks, reset_rng, sampling,
                         group_size=group_size, num_turns=num_turns,
                         score_answers=score_answers)
  records = []
  for k in range(num_turns):
    carry, record = _play_turn(params, cfg, env, template, sampling, carry, rng, jnp.int32(k),
                               num_turns=num_turns)
    records.append(record)
    if bool(carry.done.all()):
      break
  last = _score_answer(params, cfg, carry) if score_answers else None
  unplayed = jax.tree.map(jnp.zeros_like, records[-1])
  if score_answers:  # nothing changes after the last turn played
    unplayed["answer_logp"] = last
  records += [unplayed] * (num_turns - len(records))
  return finish(prompt, jax.tree.map(lambda *xs: jnp.stack(xs), *records), group_size, last)
