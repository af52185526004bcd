"""Two-player self-play with a JAX-native game, as one `lax.scan` over plies.

One policy plays both sides of every game. Each side is a row of the batch
with a conversation of its own: it sees the game as user messages (the board
from its side, the opponent's last move) and writes its moves as replies;
neither side sees the other's replies, only the moves they made. B = P * G * 2
rows: G games per task, row = game * 2 + player (player 0 moves first).

Each ply, in every live game, the player to move gets its message appended to
its own cache (`multiturn.user_block`; a side's first message follows the
chat template's opening, which every row was prefilled with), decodes its
reply from there, and the game steps on it; the other side's row writes only
padding that ply. As in `rollout.multiturn`, nothing is prefilled twice or
re-tokenized, and a row's Trajectory holds exactly the tokens its side
sampled and conditioned on:

  [ opening | message 0 (Ob) | reply 0 (N) | message 1 | reply 1 | ... | reply K-1 ]

Both blocks of a ply are padding in the row that did not move. `turn_id` is
the ply, `turn_mask[:, k]` says the row moved at ply k, and each row's reward
(its side's outcome) sits on its last move. `Episodes.roles` holds each row's
player for role-conditioned advantages (`credit.role_baseline`, SPIRAL's RAE),
or -1 where there is nothing to credit: a side that never moved (the game
ended on the first reply; a game must then give that side no reward) and both
sides of a game the ply limit cut before it had an outcome.

The two-player protocol (`envs.tic_tac_toe.TicTacToeSelfPlay`):

  num_players = 2; obs_width
  sample_task(key)    -> task
  reset(key, task)    -> state
  to_move(state)      -> int32[]  the player whose reply `step` takes
  observe(state)      -> Tokens   that player's next message (width obs_width)
  step(state, action) -> (state, rewards f32[2], done, info {name: f32[2]})
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agents import types
from jaxrl_agents.envs import base
from jaxrl_agents.models import lm
from jaxrl_agents.objectives import credit
from jaxrl_agents.rollout import multiturn
from jaxrl_agents.rollout import sampler as sampler_lib

PLAYERS = 2
# The advantage self-play trains with (GRPO's config.advantage): SPIRAL's role-conditioned one.
ADVANTAGE = "rae"


def role_baseline(decay: float = 0.95) -> credit.RoleBaseline:
  """The per-side return baselines of ADVANTAGE. Like SPIRAL's, the average moves once per
  game side in batch order (decay per trajectory, not per step)."""
  return credit.role_baseline(PLAYERS, decay=decay)


@functools.lru_cache(maxsize=8)
def _role_update(decay: float):
  return jax.jit(role_baseline(decay).update)


def role_advantages(r: types.Rollout, baseline: credit.RoleBaselineState, decay: float = 0.95
                    ) -> tuple[jax.Array, credit.RoleBaselineState]:
  """ADVANTAGE's f32[B] advantages of a self-play rollout and the baselines after its returns.

  A row with role -1 (a side that never moved, or a game the ply limit cut before
  it had an outcome) gets 0 and leaves the baselines alone.
  """
  if r.roles is None:
    raise ValueError(f"advantage {ADVANTAGE!r} needs each row's role: a self-play rollout "
                     "(a two-player environment) has them, this one has none")
  roles = jnp.asarray(r.roles, jnp.int32)
  return _role_update(decay)(jnp.asarray(r.rewards, jnp.float32), roles, baseline, roles >= 0)


def check_role_advantage(*, env: str, turn_credit: str, drop_tied_groups: bool,
                         decay: float) -> None:
  """Refuses a run of ADVANTAGE that is not self-play or asks it for what it lacks."""
  if not env:
    raise ValueError(f"advantage {ADVANTAGE!r} is self-play's: set config.env to a "
                     "two-player game (e.g. tic_tac_toe_self_play)")
  if turn_credit != "episode":
    raise ValueError(f"advantage {ADVANTAGE!r} gives each side's moves its return less the "
                     f"side's baseline; turn_credit {turn_credit!r} is not defined for it: use "
                     "'episode'")
  if drop_tied_groups:
    raise ValueError(f"drop_tied_groups reads group rewards; advantage {ADVANTAGE!r} has "
                     "no groups: set drop_tied_groups=False")
  if not 0 <= decay < 1:
    raise ValueError(f"advantage_kwargs.decay must be in [0, 1), got {decay}")


class Carry(NamedTuple):
  """What one ply hands the next."""

  context: sampler_lib.Continuation
  games: Any  # the environments' states, one per game
  done: jax.Array  # bool[B / 2] the game is over
  spoken: jax.Array  # bool[B] the row has had a message
  ended: jax.Array  # bool[B] the row's last reply ended with the end-of-turn token


def check_env(env) -> None:
  """Refuses an environment that is not a two-player game (the protocol above)."""
  if getattr(env, "num_players", None) != PLAYERS:
    raise ValueError(f"self-play needs a {PLAYERS}-player environment (num_players = "
                     f"{PLAYERS}); {type(env).__name__} has "
                     f"{getattr(env, 'num_players', 'no num_players')}")
  missing = [m for m in ("to_move", "observe") if not hasattr(env, m)]
  if missing:
    raise ValueError(f"{type(env).__name__} has no {', '.join(missing)}: not a two-player game")


def _check_per_player(env, step, games: int) -> None:
  """A reward or info entry per game instead of per player would broadcast silently."""
  for name, value in [("rewards", step.rewards), *step.info.items()]:
    if value.shape != (games, PLAYERS):
      raise ValueError(f"{type(env).__name__}.step's {name} must be f32[{PLAYERS}] (one per "
                       f"player), got shape {value.shape[1:]}")


def _per_row(x: jax.Array) -> jax.Array:
  """A per-game array [B / 2, ...] for each of the game's rows [B, ...]."""
  return jnp.repeat(x, PLAYERS, axis=0)


def start(params, cfg: lm.CausalLM, env, template: multiturn.TurnTemplate,
          tasks: Any, rng: jax.Array, sampling: sampler_lib.SamplingConfig, *, group_size: int,
          num_plies: int) -> tuple[Carry, base.Tokens]:
  """Resets G games of each of P tasks and prefills every row with the template's opening:
  (the first Carry, the opening [1, Lp])."""
  if not template.opening:
    raise ValueError("self-play needs a chat template with an opening (the user header)")
  p = jax.tree.leaves(tasks)[0].shape[0]
  games = p * group_size
  tasks = jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), tasks)
  states = jax.vmap(env.reset)(jax.random.split(rng, games), tasks)
  opening = multiturn._const(template.opening, 1)
  width = multiturn.user_block_width(template, env.obs_width)
  context = sampler_lib.prefill(
      params, cfg, opening.ids, opening.mask,
      cache_len=len(template.opening) + num_plies * (width + sampling.max_new_tokens),
      samples_per_prompt=games * PLAYERS)
  rows = games * PLAYERS
  return Carry(context, states, jnp.zeros((games,), bool), jnp.zeros((rows,), bool),
               jnp.ones((rows,), bool)), opening


def play_ply(params, cfg: lm.CausalLM, env, template: multiturn.TurnTemplate,
             sampling: sampler_lib.SamplingConfig, carry: Carry, rng: jax.Array, k, *,
             num_plies: int) -> tuple[Carry, dict]:
  """Ply k: the players to move read their messages, reply, and their games step.

  Returns the next Carry and the ply's record (message, reply, sampling
  log-probs, which rows moved, each row's reward and info this ply, which
  games ended).
  """
  live = ~carry.done
  mover = jax.vmap(env.to_move)(carry.games)
  obs = jax.vmap(env.observe)(carry.games)
  if obs.ids.shape[-1] != env.obs_width:  # the cache has room for obs_width only
    raise ValueError(f"{type(env).__name__}.observe returned messages of width "
                     f"{obs.ids.shape[-1]}, its obs_width is {env.obs_width}")
  games = mover.shape[0]
  moving = (live[:, None] & (jnp.arange(PLAYERS)[None, :] == mover[:, None])).reshape(-1)
  message = multiturn.user_block(template, sampling.stop_tokens, jax.tree.map(_per_row, obs),
                                 moving, ended=carry.ended, first=~carry.spoken)
  context = sampler_lib.extend(params, cfg, carry.context, message.ids, message.mask)
  out, context = sampler_lib.decode(params, cfg, context, jax.random.fold_in(rng, k), sampling,
                                    active=moving, keep_cache=True)
  reply = base.Tokens(out.tokens, out.mask)
  action = jax.tree.map(lambda x: x.reshape(games, PLAYERS, -1)[jnp.arange(games), mover],
                        reply)
  step = jax.vmap(env.step)(carry.games, action)
  _check_per_player(env, step, games)
  states = jax.tree.map(lambda new, old: jnp.where(
      live.reshape((-1,) + (1,) * (new.ndim - 1)), new, old), step.state, carry.games)
  over = live & step.done
  done = carry.done | step.done | (k == num_plies - 1)
  ended = multiturn.reply_ended(reply, template.to_user[0]) if template.to_user \
      else jnp.ones_like(moving)
  per_row = lambda x: jnp.where(live[:, None], x, 0.0).reshape(-1)  # [games, 2] -> [B]
  record = dict(reply=reply, logp=out.sampling_logprobs, block=message, live=moving,
                reward=per_row(step.rewards), over=_per_row(over),
                info={name: per_row(v) for name, v in step.info.items()})
  return Carry(context, states, done, carry.spoken | moving,
               jnp.where(moving, ended, carry.ended)), record


def finish(opening: base.Tokens, plies: dict) -> multiturn.Episodes:
  """Episodes from the opening and the plies' records stacked along a leading K axis."""
  live = plies["live"].T  # [B, K]
  b, k = live.shape
  total = plies["reward"].sum(0)
  played = live.any(1)
  last = k - 1 - jnp.argmax(live[:, ::-1], axis=1)
  on_last = (jnp.arange(k)[None, :] == last[:, None]) & played[:, None]
  turns = dict(plies, reward=jnp.where(on_last, total[:, None], 0.0).T)
  traj = multiturn._trajectory(jnp.repeat(opening.ids, b, 0), jnp.repeat(opening.mask, b, 0),
                               turns, message_first=True)
  info = {name: v.sum(0) for name, v in plies["info"].items()}
  finished = plies["over"].any(0)
  info["unfinished"] = (~finished).astype(jnp.float32)
  player = jnp.arange(b, dtype=jnp.int32) % PLAYERS
  return multiturn.Episodes(
      traj=traj, info=info, turns=live.sum(1).astype(jnp.int32),
      turn_keys=jnp.full((b, k), -1, jnp.int32), turn_potentials=jnp.zeros((b, k), jnp.float32),
      roles=jnp.where(played & finished, player, -1))


@functools.partial(jax.jit, static_argnames=("cfg", "env", "template", "sampling", "group_size",
                                             "num_plies"))
def rollout(params, cfg: lm.CausalLM, env, template: multiturn.TurnTemplate,
            tasks: Any, rng: jax.Array, sampling: sampler_lib.SamplingConfig, *,
            group_size: int, num_plies: int) -> multiturn.Episodes:
  """G self-play games of each of P tasks, at most `num_plies` plies of at most
  `sampling.max_new_tokens` reply tokens each, as one program (`lax.scan` over plies).

  Args:
    params: the policy (both sides).
    cfg: its architecture (static).
    env: a two-player JAX-native game (static; see the module docstring).
    template: the chat template's pieces (`multiturn.turn_template`, static).
    tasks: a pytree of P tasks (`env.sample_task`, vmapped).
    rng: PRNG key; the games are a deterministic function of it.
    sampling: the SamplingConfig (static).
    group_size: G games per task (static).
    num_plies: K, moves of both sides together (static); a game still on after K
      ends with no reward (info "unfinished").

  Returns:
    Episodes of B = P * G * 2 rows (see the module docstring), with `roles`.
  """
  reset_rng, rng = jax.random.split(rng)
  carry, opening = start(params, cfg, env, template, tasks, reset_rng, sampling,
                         group_size=group_size, num_plies=num_plies)
  ply = functools.partial(play_ply, params, cfg, env, template, sampling, rng=rng,
                          num_plies=num_plies)
  _, plies = jax.lax.scan(lambda c, k: ply(c, k=k), carry, jnp.arange(num_plies))
  return finish(opening, plies)
