"""Sokoban: every generated room solved by an independent breadth-first search, the solution
replayed through the environment, pushes and blocks by hand, and the scan."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents import envs
from jaxrl_agents.envs import base, sokoban
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


@pytest.fixture(scope="module")
def tok():
  return zoo.load("tiny").tokenizer


def _action(tok, text, width=12):
  ids = tokenizer_lib.plain_ids(tok, text)[:width]
  return base.Tokens(jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32),
                     jnp.arange(width) < len(ids))


def _bfs(walls, targets, boxes, player, limit=200_000):
  """Shortest list of moves that puts every box on a target (plain Python rules), or None."""
  start = (player, frozenset(boxes))
  seen, queue = {start: None}, collections.deque([start])
  while queue and len(seen) < limit:
    state = queue.popleft()
    (r, c), bs = state
    if bs <= targets:
      path = []
      while seen[state] is not None:
        state, move = seen[state]
        path.append(move)
      return path[::-1]
    for move, (dr, dc) in MOVES.items():
      ahead, beyond = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
      if ahead in walls:
        continue
      if ahead in bs:
        if beyond in walls or beyond in bs:
          continue
        nxt = (ahead, (bs - {ahead}) | {beyond})
      else:
        nxt = (ahead, bs)
      if nxt not in seen:
        seen[nxt] = (state, move)
        queue.append(nxt)
  return None


def _cells(grid):
  return {tuple(map(int, rc)) for rc in np.argwhere(np.asarray(grid))}


@pytest.mark.parametrize("boxes", [1, 2])
def test_every_generated_room_is_solvable_and_the_solution_solves_it(tok, boxes):
  env = envs.make("sokoban", tok, boxes=boxes, inner_walls=1)
  rooms = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(boxes), 24))
  step = jax.jit(env.step)
  lengths = []
  for i in range(24):
    room = jax.tree.map(lambda x, i=i: x[i], rooms)
    assert int(np.asarray(room.boxes).sum()) == int(np.asarray(room.targets).sum()) == boxes
    path = _bfs(_cells(room.walls), _cells(room.targets), _cells(room.boxes),
                tuple(map(int, np.asarray(room.player))))
    assert path is not None, i
    lengths.append(len(path))
    state, _ = env.reset(None, room)
    for k, move in enumerate(path):
      out = step(state, _action(tok, f"I go {move}"))
      state = out.state
      assert bool(out.done) == (k == len(path) - 1) and float(out.reward) == float(out.done)
  assert np.mean(lengths) >= 3 and min(lengths) >= 1  # the rooms need some pushing


def test_pushes_and_blocks_by_hand(tok):
  env = envs.make("sokoban", tok)
  walls = np.ones((6, 6), bool)
  walls[1:-1, 1:-1] = False
  targets, boxes = np.zeros((6, 6), bool), np.zeros((6, 6), bool)
  targets[2, 4], boxes[2, 2] = True, True
  room = sokoban.Room(jnp.asarray(walls), jnp.asarray(targets), jnp.asarray(boxes),
                      jnp.asarray([2, 1], jnp.int32))
  state, obs = env.reset(None, room)
  text = tok.decode(np.asarray(obs.ids)[np.asarray(obs.mask)].tolist())
  assert " # _ _ _ _ #\n # @ $ _ . #\n" in text
  np.testing.assert_allclose(float(env.potential(state)), -2 / 8)
  out = env.step(state, _action(tok, "right"))  # push: the box moves to (2, 3)
  assert tuple(np.asarray(out.state.player)) == (2, 2) and bool(out.state.boxes[2, 3])
  assert not bool(out.done) and float(out.info["stuck"]) == 0.0
  out = env.step(out.state, _action(tok, "right"))  # onto the target: solved
  assert bool(out.done) and float(out.reward) == 1.0 and bool(out.state.boxes[2, 4])
  np.testing.assert_allclose(float(env.potential(out.state)), 0.0)
  # A box against the wall cannot be pushed further: nothing moves.
  blocked = env.step(out.state, _action(tok, "right"))
  assert float(blocked.info["stuck"]) == 1.0
  assert tuple(np.asarray(blocked.state.player)) == (2, 3)
  assert float(env.step(state, _action(tok, "push it")).info["invalid"]) == 1.0
  assert int(env.state_key(state)) != int(env.state_key(out.state))


def test_state_keys_tell_box_layouts_apart(tok):
  """Two boxes on squares {8, 15} or {9, 14} (the same index sum), the player anywhere: every
  layout of up to two boxes and a player in a 6x6 room gets its own non-negative key."""
  env = envs.make("sokoban", tok, boxes=2)
  inner = [r * 6 + c for r in range(1, 5) for c in range(1, 5)]
  pairs = [(a, b) for i, a in enumerate(inner) for b in inner[i + 1:]]
  boxes = np.zeros((len(pairs), 36), bool)
  for i, (a, b) in enumerate(pairs):
    boxes[i, [a, b]] = True
  keys = set()
  for player in inner[:4]:
    rooms = sokoban.Room(jnp.zeros((len(pairs), 6, 6), bool), jnp.zeros((len(pairs), 6, 6), bool),
                         jnp.asarray(boxes.reshape(-1, 6, 6)),
                         jnp.tile(jnp.asarray([player // 6, player % 6], jnp.int32),
                                  (len(pairs), 1)))
    k = np.asarray(jax.vmap(env.state_key)(rooms))
    assert (k >= 0).all()
    keys |= set(k.tolist())
  assert len(keys) == 4 * len(pairs)


def test_bad_options_are_refused(tok):
  with pytest.raises(ValueError, match="size"):
    envs.make("sokoban", tok, size=4)
  with pytest.raises(ValueError, match="room to move"):
    envs.make("sokoban", tok, size=5, boxes=3, inner_walls=3)
