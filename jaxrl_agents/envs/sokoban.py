"""Sokoban in small rooms, as a text grid: push every box onto a target.

Each turn the agent sees the room (# wall, _ floor, . target, $ box, * box on
a target, @ itself, + itself on a target) and answers left, down, right or up
(the last move its reply names; `base.last_keyword`). Walking into a wall, or
pushing a box into a wall or another box, leaves everything in place.

Rooms are generated in pure JAX by playing backwards from a solved room
(boxes on their targets, a few inner walls): the player walks at random and,
when it steps away from a box behind it, sometimes pulls it along. Every move
pulled backwards is a push forwards, so every generated room is solvable; a
room whose boxes all ended on their targets is replaced by the next of
`candidates` draws.

Reward 1 when every box is on a target (the episode ends); a reply naming no
move is an invalid action (info["invalid"]) that costs a turn. `state_key`
hashes the player's and the boxes' squares (GiGPO's anchor states; distinct
states collide with probability about 2^-31). `potential` is minus the summed
distance from each box to its nearest target, over the room's size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.envs import base
from jaxrl_agents.envs.frozen_lake import DELTAS, MOVES

FLOOR, WALL, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(7)
WENT, BUMPED, SOLVED, INVALID = 0, 4, 5, 6  # status pieces (WENT + move)


class Room(NamedTuple):
  walls: jax.Array  # bool[n, n]
  targets: jax.Array  # bool[n, n]
  boxes: jax.Array  # bool[n, n]
  player: jax.Array  # int32[2] row, column


def _step_from(room: Room, move: jax.Array) -> tuple[Room, jax.Array]:
  """The room after a forward move (a push when a box is in the way), and whether anything
  moved."""
  delta = jnp.asarray(DELTAS)[move]
  n = room.walls.shape[0]
  ahead = jnp.clip(room.player + delta, 0, n - 1)
  beyond = jnp.clip(room.player + 2 * delta, 0, n - 1)
  at = lambda grid, pos: grid[pos[0], pos[1]]
  box_ahead = at(room.boxes, ahead)
  push_ok = ~at(room.walls, beyond) & ~at(room.boxes, beyond)
  moves = ~at(room.walls, ahead) & (~box_ahead | push_ok)
  pushed = moves & box_ahead
  boxes = jnp.where(pushed, room.boxes.at[ahead[0], ahead[1]].set(False)
                    .at[beyond[0], beyond[1]].set(True), room.boxes)
  return room._replace(boxes=boxes, player=jnp.where(moves, ahead, room.player)), moves


def _pull(room: Room, key: jax.Array) -> Room:
  """One backward move: the player steps at random; a box behind it may come along."""
  move_key, pull_key = jax.random.split(key)
  delta = jnp.asarray(DELTAS)[jax.random.randint(move_key, (), 0, 4)]
  n = room.walls.shape[0]
  ahead = jnp.clip(room.player + delta, 0, n - 1)
  behind = jnp.clip(room.player - delta, 0, n - 1)
  free = ~room.walls[ahead[0], ahead[1]] & ~room.boxes[ahead[0], ahead[1]]
  pull = free & room.boxes[behind[0], behind[1]] & jax.random.bernoulli(pull_key, 0.7)
  boxes = jnp.where(pull, room.boxes.at[behind[0], behind[1]].set(False)
                    .at[room.player[0], room.player[1]].set(True), room.boxes)
  return room._replace(boxes=boxes, player=jnp.where(free, ahead, room.player))


def generate_room(key: jax.Array, size: int, num_boxes: int, inner_walls: int,
                  pulls: int) -> Room:
  """A solvable room (see the module docstring), possibly already solved."""
  n = size
  place_key, play_key = jax.random.split(key)
  border = np.ones((n, n), bool)
  border[1:-1, 1:-1] = False
  inner = (n - 2) ** 2
  # Inner walls, targets (with their boxes) and the player on distinct inner squares.
  order = jax.random.permutation(place_key, inner)
  squares = lambda idx: jnp.zeros(inner, bool).at[idx].set(True).reshape(n - 2, n - 2)
  pad = lambda grid: jnp.pad(grid, 1)
  walls = jnp.asarray(border) | pad(squares(order[:inner_walls]))
  targets = pad(squares(order[inner_walls:inner_walls + num_boxes]))
  start = order[inner_walls + num_boxes]
  player = jnp.stack([start // (n - 2) + 1, start % (n - 2) + 1]).astype(jnp.int32)
  room = Room(walls=walls, targets=targets, boxes=targets, player=player)
  return jax.lax.fori_loop(0, pulls, lambda i, r: _pull(r, jax.random.fold_in(play_key, i)),
                           room)


def solved(room: Room) -> jax.Array:
  return ~(room.boxes & ~room.targets).any()


class Sokoban:
  """The environment (see the module docstring): `size` x `size` rooms, walls included."""

  def __init__(self, tokenizer, *, size: int = 6, boxes: int = 1, inner_walls: int = 2,
               pulls: int = 40, candidates: int = 8):
    if not 5 <= size <= 8:
      raise ValueError(f"sokoban size must be in [5, 8], got {size}")
    if not 1 <= boxes <= 3 or boxes + inner_walls + 1 > (size - 2) ** 2 // 2:
      raise ValueError(f"sokoban needs 1 <= boxes <= 3 and room to move: got boxes={boxes}, "
                       f"inner_walls={inner_walls} in a {size}x{size} room")
    if pulls < 1 or candidates < 1:
      raise ValueError(f"sokoban pulls and candidates must be >= 1, got {pulls}, {candidates}")
    self.size, self.boxes, self.inner_walls = size, boxes, inner_walls
    self.pulls, self.candidates = pulls, candidates
    self.intro = base.piece_table(tokenizer, [
        "Sokoban. You are @; push every box $ onto a target . (a box on a target is *). "
        "# is wall, _ is floor. Boxes can be pushed, not pulled.\n"])
    self.cells = base.piece_table(tokenizer, [" _", " #", " .", " $", " *", " @", " +"])
    self.newline = base.piece_table(tokenizer, ["\n"])
    self.question = base.piece_table(tokenizer, ["Your move? Say left, down, right or up."])
    self.status = base.piece_table(tokenizer, [f"You went {m}.\n" for m in MOVES] + [
        "Nothing moved.\n", "Every box is on a target!",
        "That is not a move: say left, down, right or up.\n"])
    grid_width = size * (size * self.cells.ids.shape[-1] + self.newline.ids.shape[-1])
    self.obs_width = self.status.ids.shape[-1] + grid_width
    self.reader = base.keyword_reader(tokenizer, MOVES)
    codes = np.random.default_rng(0).integers(0, 2**31, size=(2, size * size))
    self._box_codes, self._player_codes = (jnp.asarray(c, jnp.int32) for c in codes)

  def sample_task(self, key: jax.Array) -> Room:
    """The first of `candidates` generated rooms that is not already solved."""
    rooms = jax.vmap(lambda k: generate_room(k, self.size, self.boxes, self.inner_walls,
                                             self.pulls))(jax.random.split(key, self.candidates))
    pick = jnp.argmax(~jax.vmap(solved)(rooms))
    return jax.tree.map(lambda x: x[pick], rooms)

  def _grid(self, room: Room) -> base.Tokens:
    n = self.size
    kind = jnp.where(room.walls, WALL, jnp.where(room.boxes, jnp.where(
        room.targets, BOX_ON_TARGET, BOX), jnp.where(room.targets, TARGET, FLOOR)))
    r, c = room.player[0], room.player[1]
    kind = kind.at[r, c].set(jnp.where(room.targets[r, c], PLAYER_ON_TARGET, PLAYER))
    return base.grid(self.cells, kind.reshape(-1), n, self.newline)

  def reset(self, key: jax.Array, task: Room) -> tuple[Room, base.Tokens]:
    del key  # the task is the room
    return task, base.concat(base.row(self.intro, 0), self._grid(task),
                             base.row(self.question, 0))

  def step(self, state: Room, action: base.Tokens) -> base.EnvStep:
    move, found = base.last_keyword(self.reader, action)
    moved_room, moved = _step_from(state, move)
    room = jax.tree.map(lambda a, b: jnp.where(found, a, b), moved_room, state)
    done = found & solved(room)
    status = jnp.where(~found, INVALID, jnp.where(done, SOLVED, jnp.where(
        moved, WENT + move, BUMPED)))
    obs = base.concat(base.row(self.status, status), self._grid(room))
    return base.EnvStep(
        state=room, obs=obs, reward=done.astype(jnp.float32), done=done,
        info={"invalid": (~found).astype(jnp.float32), "success": done.astype(jnp.float32),
              "stuck": (found & ~moved).astype(jnp.float32)})

  def state_key(self, state: Room) -> jax.Array:
    """Zobrist hash of the player's and the boxes' squares, in [0, 2^31)."""
    boxes = jax.lax.reduce(jnp.where(state.boxes.reshape(-1), self._box_codes, 0), 0,
                           jax.lax.bitwise_xor, (0,))
    player = self._player_codes[state.player[0] * self.size + state.player[1]]
    return (boxes ^ player) & 0x7FFFFFFF

  def potential(self, state: Room) -> jax.Array:
    n = self.size
    rows, cols = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    far = 2 * n
    # Distance from each square to its nearest target, then summed over the boxes.
    distance = jnp.min(jnp.where(
        state.targets[None, None], jnp.abs(rows[:, :, None, None] - rows[None, None]) +
        jnp.abs(cols[:, :, None, None] - cols[None, None]), far), axis=(2, 3))
    total = jnp.sum(jnp.where(state.boxes, distance, 0))
    return -total.astype(jnp.float32) / (self.boxes * 2 * (n - 2))


@registry.register("env", "sokoban")
def make(tokenizer, **options) -> Sokoban:
  """Sokoban in small generated rooms as a text grid (JAX, lax.scan)."""
  return Sokoban(tokenizer, **options)
