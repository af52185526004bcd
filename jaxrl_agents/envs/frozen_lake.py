"""FrozenLake as a text grid: walk from the top-left corner to the goal without falling in.

Each turn the agent sees the map (X marks it, G the goal, H the holes, . ice)
and answers with a move: left, down, right or up (the last one its reply
names; `base.last_keyword`). On a slippery lake a move goes the intended way
with probability 1/3 and to either side otherwise (Gymnasium's rule). Every
task is a random map with a path from start to goal (`hole_prob` per cell),
or Gymnasium's classic 4x4 map (`classic=True`). Pure JAX: the map is rendered
from pieces tokenized when the environment is made.

With `demonstrations`, that many games on other maps, played by a shortest
path, come before every episode as earlier chat turns (`preamble`), in the
environment's own words.

Reward 1 on reaching the goal; falling in a hole ends the episode with 0; a
reply naming no move is an invalid action (counted in info["invalid"]) that
costs a turn. The G episodes of one task share its random stream (common
random numbers): on a slippery lake their returns differ by their moves.

`state_key` is the position (GiGPO's anchor states); `potential` is minus
the Manhattan distance to the goal over its largest value.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import registry
from jaxrl_agents.envs import base

MOVES = ("left", "down", "right", "up")  # Gymnasium's action order
DELTAS = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)
ICE, HOLE, GOAL, AGENT = range(4)
WENT, BUMPED, FELL, REACHED, INVALID = 0, 4, 5, 6, 7  # status pieces (WENT + move)
CLASSIC = ("SFFF", "FHFH", "FFFH", "HFFG")  # Gymnasium's 4x4 map


class State(NamedTuple):
  holes: jax.Array  # bool[n, n]
  pos: jax.Array  # int32[] row * n + column
  key: jax.Array  # the slips' random stream


def reachable(holes: jax.Array) -> jax.Array:
  """Whether the bottom-right corner can be walked to from the top-left without a hole."""
  n = holes.shape[0]
  free = ~holes

  def grow(_, seen):
    pad = jnp.pad(seen, 1)
    near = pad[:-2, 1:-1] | pad[2:, 1:-1] | pad[1:-1, :-2] | pad[1:-1, 2:]
    return seen | (near & free)

  seen = jax.lax.fori_loop(0, n * n, grow, jnp.zeros((n, n), bool).at[0, 0].set(free[0, 0]))
  return seen[n - 1, n - 1]


DEMONSTRATION_SEED = 11  # the worked examples' maps (their own stream)


def shortest_path(holes: np.ndarray) -> list[int] | None:
  """Moves (indices of MOVES) of a shortest walk from the top-left to the bottom-right
  corner that steps on no hole (breadth-first search), or None if there is none."""
  n = holes.shape[0]
  came = {(0, 0): None}
  frontier = [(0, 0)]
  while frontier:
    nxt = []
    for r, c in frontier:
      for move, (dr, dc) in enumerate(DELTAS):
        cell = (r + int(dr), c + int(dc))
        if 0 <= cell[0] < n and 0 <= cell[1] < n and not holes[cell] and cell not in came:
          came[cell] = ((r, c), move)
          nxt.append(cell)
    frontier = nxt
  if (n - 1, n - 1) not in came:
    return None
  moves, cell = [], (n - 1, n - 1)
  while came[cell] is not None:
    cell, move = came[cell]
    moves.append(move)
  return moves[::-1]


class FrozenLake:
  """The environment (see the module docstring): `size` x `size` maps."""

  def __init__(self, tokenizer, *, size: int = 4, hole_prob: float = 0.2,
               slippery: bool = False, classic: bool = False, demonstrations: int = 0):
    if not 2 <= size <= 8:
      raise ValueError(f"frozen_lake size must be in [2, 8], got {size}")
    if not 0 <= hole_prob < 1:
      raise ValueError(f"frozen_lake hole_prob must be in [0, 1), got {hole_prob}")
    if classic and size != 4:
      raise ValueError(f"the classic map is 4x4; got size={size}")
    if not 0 <= demonstrations <= 4:
      raise ValueError(f"frozen_lake demonstrations must be in [0, 4], got {demonstrations}")
    if demonstrations and (classic or hole_prob == 0):
      raise ValueError("frozen_lake demonstrations need maps that differ: with classic=True or "
                       "hole_prob=0 every task is one map, and the worked game would be the "
                       "task itself")
    self.size, self.hole_prob, self.slippery, self.classic = size, hole_prob, slippery, classic
    # The wording was chosen by measurement: SmolLM2-135M-Instruct names a move in about
    # 30% of its sampled replies to this layout (question after the map), 17% when the
    # instruction comes first.
    lake = "slippery ice (a move may slide you sideways)" if slippery else "ice"
    self.texts = dict(
        intro=f"Grid game. You are X; the goal is G (bottom right); H are holes; . is {lake}.\n",
        cells=[" .", " H", " G", " X"], newline="\n",
        question="Your move? Say left, down, right or up.",
        status=[f"You went {m}.\n" for m in MOVES] + [
            "You bumped into the edge.\n", "You fell into a hole.", "You reached the goal!",
            "That is not a move: say left, down, right or up.\n"])
    self.intro = base.piece_table(tokenizer, [self.texts["intro"]])
    self.cells = base.piece_table(tokenizer, self.texts["cells"])
    self.newline = base.piece_table(tokenizer, [self.texts["newline"]])
    self.question = base.piece_table(tokenizer, [self.texts["question"]])
    self.status = base.piece_table(tokenizer, self.texts["status"])
    grid_width = size * (size * self.cells.ids.shape[-1] + self.newline.ids.shape[-1])
    self.obs_width = self.status.ids.shape[-1] + grid_width
    self.reader = base.keyword_reader(tokenizer, MOVES)
    rng = np.random.default_rng(DEMONSTRATION_SEED)
    self.preamble = tuple(m for _ in range(demonstrations)
                          for m in self.demonstration(self.demonstration_map(rng)))

  def grid_text(self, holes: np.ndarray, pos: int) -> str:
    """The map as the observation's tokens spell it."""
    n, cells = self.size, self.texts["cells"]
    kind = np.where(holes, HOLE, ICE).reshape(-1)
    kind[n * n - 1], kind[pos] = GOAL, AGENT
    return "".join("".join(cells[k] for k in kind[r * n:(r + 1) * n]) + self.texts["newline"]
                   for r in range(n))

  def demonstration_map(self, rng: np.random.Generator) -> np.ndarray:
    """A map with a path, drawn as `sample_task` draws them (never classic: refused)."""
    while True:
      holes = rng.random((self.size, self.size)) < self.hole_prob
      holes[0, 0] = holes[-1, -1] = False
      if shortest_path(holes) is not None:
        return holes

  def demonstration(self, holes: np.ndarray) -> list[dict[str, str]]:
    """A game on `holes` played by a shortest path, as chat messages (the environment's
    texts), ending with the move that reaches the goal. Not slippery: the moves go where
    they say."""
    n, pos = self.size, 0
    messages = [{"role": "user", "content": self.texts["intro"] + self.grid_text(holes, 0)
                 + self.texts["question"]}]
    path = shortest_path(holes)
    for i, move in enumerate(path):
      messages.append({"role": "assistant", "content": MOVES[move]})
      if i == len(path) - 1:
        break
      pos += int(DELTAS[move][0]) * n + int(DELTAS[move][1])
      messages.append({"role": "user", "content": self.texts["status"][WENT + move]
                       + self.grid_text(holes, pos)})
    return messages

  def sample_task(self, key: jax.Array) -> jax.Array:
    """bool[n, n] holes: the first of 16 random maps with a path (an empty map if none has)."""
    n = self.size
    if self.classic:
      return jnp.asarray([[c == "H" for c in line] for line in CLASSIC])
    maps = jax.random.bernoulli(key, self.hole_prob, (16, n, n))
    maps = maps.at[:, 0, 0].set(False).at[:, n - 1, n - 1].set(False)
    ok = jax.vmap(reachable)(maps)
    return jnp.where(ok.any(), maps[jnp.argmax(ok)], jnp.zeros((n, n), bool))

  def _grid(self, holes: jax.Array, pos: jax.Array) -> base.Tokens:
    n = self.size
    kind = jnp.where(holes, HOLE, ICE).reshape(-1).at[n * n - 1].set(GOAL).at[pos].set(AGENT)
    return base.grid(self.cells, kind, n, self.newline)

  def reset(self, key: jax.Array, task: jax.Array) -> tuple[State, base.Tokens]:
    state = State(holes=jnp.asarray(task, bool), pos=jnp.int32(0), key=key)
    return state, base.concat(base.row(self.intro, 0), self._grid(state.holes, state.pos),
                              base.row(self.question, 0))

  def step(self, state: State, action: base.Tokens) -> base.EnvStep:
    n = self.size
    move, found = base.last_keyword(self.reader, action)
    key, slip_key = jax.random.split(state.key)
    if self.slippery:
      move = (move + jax.random.randint(slip_key, (), -1, 2)) % 4
    row, col = state.pos // n, state.pos % n
    delta = jnp.asarray(DELTAS)[move]
    to_row, to_col = jnp.clip(row + delta[0], 0, n - 1), jnp.clip(col + delta[1], 0, n - 1)
    pos = jnp.where(found, to_row * n + to_col, state.pos)
    fell = found & state.holes.reshape(-1)[pos]
    reached = found & (pos == n * n - 1)
    status = jnp.where(~found, INVALID, jnp.where(
        fell, FELL, jnp.where(reached, REACHED, jnp.where(pos == state.pos, BUMPED,
                                                          WENT + move))))
    # The question is asked once, in the first message: every column of the history
    # goes through the model in each update, and the map is most of it.
    obs = base.concat(base.row(self.status, status), self._grid(state.holes, pos))
    return base.EnvStep(
        state=State(state.holes, pos.astype(jnp.int32), key), obs=obs,
        reward=reached.astype(jnp.float32), done=fell | reached,
        info={"invalid": (~found).astype(jnp.float32), "success": reached.astype(jnp.float32),
              "fell": fell.astype(jnp.float32)})

  def state_key(self, state: State) -> jax.Array:
    return state.pos

  def potential(self, state: State) -> jax.Array:
    n = self.size
    distance = (n - 1 - state.pos // n) + (n - 1 - state.pos % n)
    return -distance.astype(jnp.float32) / (2 * (n - 1))


@registry.register("env", "frozen_lake")
def make(tokenizer, **options) -> FrozenLake:
  """FrozenLake as a text grid: walk to the goal without falling in (JAX, lax.scan)."""
  return FrozenLake(tokenizer, **options)
