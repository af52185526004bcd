"""Tic-tac-toe (pgx): games by hand against the first-free-square opponent, invalid moves,
random games to the end, and the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import envs
from jaxrl_agents.envs import base, tic_tac_toe
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo


@pytest.fixture(scope="module")
def tok():
  return zoo.load("tiny").tokenizer


def _action(tok, text, width=16):
  ids = tokenizer_lib.plain_ids(tok, text)[:width]
  return base.Tokens(jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32),
                     jnp.arange(width) < len(ids))


def _text(tok, obs):
  return tok.decode(np.asarray(obs.ids)[np.asarray(obs.mask)].tolist())


def _play(tok, env, first, moves):
  state, obs = env.reset(None, tic_tac_toe.Task(jnp.bool_(first), jax.random.key(0)))
  outs = []
  for move in moves:
    out = jax.jit(env.step)(state, _action(tok, move))
    state = out.state
    outs.append(out)
  return obs, outs


def test_a_win_by_hand(tok):
  env = envs.make("tic_tac_toe", tok, opponent="first")
  # X: 5, O takes 1; X: 3, O takes 2; X: 7 completes the diagonal 3-5-7.
  obs, outs = _play(tok, env, True, ["5", "I play 3", "7"])
  assert "You are X" in _text(tok, obs) and " 1 2 3\n 4 5 6\n 7 8 9\n" in _text(tok, obs)
  assert _text(tok, outs[0].obs).startswith("I took square 1.\n O 2 3\n 4 X 6\n 7 8 9\n")
  assert _text(tok, outs[1].obs).startswith("I took square 2.\n O O X\n 4 X 6\n 7 8 9\n")
  assert [float(o.reward) for o in outs] == [0.0, 0.0, 1.0]
  assert [bool(o.done) for o in outs] == [False, False, True]
  assert float(outs[-1].info["success"]) == 1.0


def test_a_loss_and_invalid_moves_by_hand(tok):
  env = envs.make("tic_tac_toe", tok, opponent="first")
  # The opponent (X) opens on 1; the agent (O) plays 9, X takes 2; after four invalid
  # replies the agent plays 8, X takes 3: 1-2-3 is a row for the opponent.
  obs, outs = _play(tok, env, False, ["9", "1", "ten", "0", "10", "8"])
  assert "You are O" in _text(tok, obs) and " X 2 3\n" in _text(tok, obs)
  assert [float(o.info["invalid"]) for o in outs] == [0, 1, 1, 1, 1, 0]
  for bad in outs[1:5]:  # nothing changes on an invalid reply
    assert _text(tok, bad.obs).startswith("That is not a free square.\n X X 3\n 4 5 6\n 7 8 O")
    assert not bool(bad.done) and float(bad.reward) == 0.0
  assert float(outs[-1].reward) == -1.0 and bool(outs[-1].done)
  assert float(outs[-1].info["defeat"]) == 1.0


def test_random_games_end_with_a_legal_outcome(tok):
  env = envs.make("tic_tac_toe", tok, opponent="random")
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(3), 64))
  states, _ = jax.vmap(env.reset)(jax.random.split(jax.random.key(0), 64), tasks)
  step = jax.jit(jax.vmap(env.step))
  done, total = np.zeros(64, bool), np.zeros(64)
  ends = {k: np.zeros(64) for k in ("success", "draw", "defeat")}
  rng = np.random.default_rng(0)
  for _ in range(5):  # at most five moves of the agent's
    legal = np.asarray(states.game.legal_action_mask)
    squares = [rng.choice(np.flatnonzero(row)) + 1 if row.any() else 1 for row in legal]
    actions = jax.tree.map(lambda *xs: jnp.stack(xs), *[_action(tok, str(s)) for s in squares])
    out = step(states, actions)
    live = ~done
    total += np.where(live, np.asarray(out.reward), 0.0)
    for k in ends:
      ends[k] += np.where(live, np.asarray(out.info[k]), 0.0)
    assert not np.asarray(out.info["invalid"])[live].any()
    done |= np.asarray(out.done)
    states = out.state
  assert done.all()
  assert (ends["success"] + ends["draw"] + ends["defeat"] == 1).all()
  np.testing.assert_array_equal(total, ends["success"] - ends["defeat"])
  assert ends["success"].sum() > 10 and ends["defeat"].sum() > 5  # both happen against random


def test_bad_options_are_refused(tok):
  with pytest.raises(ValueError, match="opponent"):
    envs.make("tic_tac_toe", tok, opponent="minimax")
