"""Tic-tac-toe, the game from pgx, the board as text: against a fixed opponent, or self-play.

Each turn the agent sees the board (free squares show their numbers 1-9, taken
ones X or O) and answers with the number of a free square (the last number of
its reply, `base.last_number`); the opponent answers at once. The task says
whether the agent moves first (X) or second (O) and seeds the opponent: a
random legal move (`opponent="random"`; the G episodes of a task share its
random stream) or always the first free square (`opponent="first"`). The
rules, the legal moves and the outcome are pgx's (`pgx.make("tic_tac_toe")`),
stepped inside jit like any JAX-native environment here.

Reward: 1 for a win, -1 for a loss, 0 for a draw, when the game ends. A reply
naming no free square is an invalid action (info["invalid"]) that costs a
turn and changes nothing. info also counts success (wins), draws and
defeats (not "loss": the metrics already use that name for the training loss).
`state_key` is the board (from the agent's side), so GiGPO compares moves
made from the same position.

`tic_tac_toe_self_play` is the same game with the policy on both sides: a
two-player environment for `rollout.self_play` (each side its own
conversation, in the same words as above: a side's first message shows the
intro and the board, each later one the opponent's move, "I took square k.",
and the board). A reply naming no free square forfeits the game: -1 for the
side that wrote it, 0 for the other (a format error is not a win to learn
from). Its held-out evaluation plays the fixed random opponent
(`evaluation_env`), so greedy play is measured against something outside the
policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

# pgx is imported where used: it computes with JAX on import, which would start JAX's
# backend before `jax.distributed` can be initialized.
if TYPE_CHECKING:
  import pgx

from jaxrl_agents import registry
from jaxrl_agents.envs import base

OPPONENTS = ("random", "first")
EMPTY, MINE, THEIRS = range(3)
# Status pieces: the opponent took square k (0-8), then the endings and the complaint.
WON, LOST, DRAW, INVALID = 9, 10, 11, 12


class Task(NamedTuple):
  agent_first: jax.Array  # bool[]
  key: jax.Array  # the game's and the opponent's random stream


class State(NamedTuple):
  game: pgx.State
  agent: jax.Array  # int32[] the agent's pgx player id
  agent_x: jax.Array  # bool[] the agent plays X (moved first)
  key: jax.Array


class TicTacToe:
  """The environment (see the module docstring)."""

  def __init__(self, tokenizer, *, opponent: str = "random"):
    if opponent not in OPPONENTS:
      raise ValueError(f"tic_tac_toe opponent must be one of {OPPONENTS}, got {opponent!r}")
    self.opponent = opponent
    import pgx

    self.game = pgx.make("tic_tac_toe")
    self.intro = base.piece_table(tokenizer, [
        f"Tic-tac-toe. You are {mark}: get three in a row, column or diagonal. Free squares "
        "show their numbers.\n" for mark in ("X", "O")])
    self.question = base.piece_table(tokenizer, ["Your move? Answer with the number of a "
                                                 "free square."])
    # One piece per (square, what is on it) for X's and O's point of view.
    self.cells = [base.piece_table(tokenizer, [
        f" {text}" for square in range(9) for text in (str(square + 1), mine, theirs)])
        for mine, theirs in (("X", "O"), ("O", "X"))]
    self.row_end = base.piece_table(tokenizer, ["\n"])
    self.status = base.piece_table(tokenizer, [f"I took square {k + 1}.\n" for k in range(9)] + [
        "You won!", "I won.", "Draw.", "That is not a free square.\n"])
    board_width = 9 * self.cells[0].ids.shape[-1] + 3 * self.row_end.ids.shape[-1]
    self.obs_width = self.status.ids.shape[-1] + board_width + self.question.ids.shape[-1]
    self.reader = base.number_reader(tokenizer)

  def sample_task(self, key: jax.Array) -> Task:
    first_key, key = jax.random.split(key)
    return Task(agent_first=jax.random.bernoulli(first_key), key=key)

  def _board(self, state: State) -> jax.Array:
    """int32[9]: EMPTY, MINE or THEIRS, from the agent's side (its turn: observation[..., 0])."""
    obs = state.game.observation.reshape(9, 2)
    return jnp.where(obs[:, 0], MINE, jnp.where(obs[:, 1], THEIRS, EMPTY))

  def _render(self, state: State, agent_x: jax.Array) -> base.Tokens:
    cells = jax.tree.map(lambda a, b: jnp.where(agent_x, a, b), *self.cells)
    return base.grid(cells, jnp.arange(9) * 3 + self._board(state), 3, self.row_end)

  def _opponent_move(self, game: pgx.State, key: jax.Array) -> jax.Array:
    legal = game.legal_action_mask
    if self.opponent == "first":
      return jnp.argmax(legal).astype(jnp.int32)
    return jax.random.choice(key, 9, p=legal / jnp.maximum(legal.sum(), 1)).astype(jnp.int32)

  def reset(self, key: jax.Array, task: Task) -> tuple[State, base.Tokens]:
    del key  # the task's key decides the game and the opponent
    init_key, move_key, key = jax.random.split(task.key, 3)
    game = self.game.init(init_key)
    opened = self.game.step(game, self._opponent_move(game, move_key))
    game = jax.tree.map(lambda a, b: jnp.where(task.agent_first, a, b), game, opened)
    state = State(game=game, agent=game.current_player, agent_x=task.agent_first, key=key)
    obs = base.concat(base.row(self.intro, jnp.where(task.agent_first, 0, 1)),
                      self._render(state, task.agent_first), base.row(self.question, 0))
    return state, obs

  def step(self, state: State, action: base.Tokens) -> base.EnvStep:
    number, found = base.last_number(self.reader, action)
    square = number - 1
    legal = state.game.legal_action_mask
    valid = found & (square >= 0) & (square < 9) & legal[jnp.clip(square, 0, 8)]
    # Only legal moves reach pgx (it ends the game on an illegal one).
    mine = self.game.step(state.game, jnp.where(valid, square, jnp.argmax(legal)))
    move_key, key = jax.random.split(state.key)
    reply = self._opponent_move(mine, move_key)
    theirs = self.game.step(mine, reply)
    game = jax.tree.map(lambda a, b: jnp.where(mine.terminated, a, b), mine, theirs)
    game = jax.tree.map(lambda a, b: jnp.where(valid, a, b), game, state.game)
    reward = jnp.where(valid, game.rewards[state.agent], 0.0)
    done = valid & game.terminated
    status = jnp.where(~valid, INVALID, jnp.where(
        ~done, reply, jnp.where(reward > 0, WON, jnp.where(reward < 0, LOST, DRAW))))
    new = state._replace(game=game, key=key)
    # The board is drawn from the side to move: the agent's, unless the game just ended
    # (an ended episode's observation is never shown).
    obs = base.concat(base.row(self.status, status), self._render(new, state.agent_x),
                      base.row(self.question, 0))
    return base.EnvStep(
        state=new, obs=obs, reward=reward.astype(jnp.float32), done=done,
        info={"invalid": (~valid).astype(jnp.float32),
              "success": (done & (reward > 0)).astype(jnp.float32),
              "draw": (done & (reward == 0)).astype(jnp.float32),
              "defeat": (done & (reward < 0)).astype(jnp.float32)})

  def state_key(self, state: State) -> jax.Array:
    return jnp.sum(self._board(state) * 3 ** jnp.arange(9)).astype(jnp.int32)


class SelfPlayState(NamedTuple):
  game: pgx.State
  x: jax.Array  # int32[] pgx's id of player 0 (X, who moves first)
  last_move: jax.Array  # int32[] the square taken last (-1: none yet)
  spoken: jax.Array  # bool[2] each player has had a message


class TicTacToeSelfPlay:
  """Tic-tac-toe with the policy on both sides (see the module docstring).

  The two-player protocol of `rollout.self_play`: player 0 moves first (X);
  `to_move(state)` names the player whose reply `step` takes, `observe(state)`
  writes that player's next message.
  """

  num_players = 2
  evaluation_turns = 7  # the fixed-opponent game's: five moves and two invalid replies

  def __init__(self, tokenizer):
    # The fixed-opponent game's texts and reader; it is also the held-out opponent.
    self.evaluation_env = pieces = TicTacToe(tokenizer, opponent="random")
    self.pieces = pieces
    self.obs_width = pieces.intro.ids.shape[-1] + pieces.obs_width

  def sample_task(self, key: jax.Array) -> jax.Array:
    """int32[] the game's seed (pgx's start; the policy's samples make the games differ)."""
    return jax.random.randint(key, (), 0, jnp.iinfo(jnp.int32).max)

  def reset(self, key: jax.Array, task: jax.Array) -> SelfPlayState:
    del key
    game = self.pieces.game.init(jax.random.key(task))
    return SelfPlayState(game=game, x=game.current_player, last_move=jnp.int32(-1),
                         spoken=jnp.zeros((2,), bool))

  def to_move(self, state: SelfPlayState) -> jax.Array:
    return jnp.where(state.game.current_player == state.x, 0, 1).astype(jnp.int32)

  def observe(self, state: SelfPlayState) -> base.Tokens:
    """The message of the player to move: the intro the first time, else the opponent's
    last move; then the board from its side and the question."""
    p, player = self.pieces, self.to_move(state)
    first = ~state.spoken[player]
    intro = base.row(p.intro, player)
    status = base.row(p.status, jnp.clip(state.last_move, 0, 8))
    return base.concat(base.Tokens(intro.ids, intro.mask & first),
                       base.Tokens(status.ids, status.mask & ~first & (state.last_move >= 0)),
                       p._render(state, player == 0), base.row(p.question, 0))

  def step(self, state: SelfPlayState, action: base.Tokens) -> base.GameStep:
    player = self.to_move(state)
    number, found = base.last_number(self.pieces.reader, action)
    square = number - 1
    legal = state.game.legal_action_mask
    valid = found & (square >= 0) & (square < 9) & legal[jnp.clip(square, 0, 8)]
    moved = self.pieces.game.step(state.game, jnp.where(valid, square, jnp.argmax(legal)))
    game = jax.tree.map(lambda a, b: jnp.where(valid, a, b), moved, state.game)
    mover = jnp.arange(2) == player
    outcome = game.rewards[jnp.stack([state.x, 1 - state.x])]  # pgx's ids -> (X, O)
    rewards = jnp.where(valid, outcome, jnp.where(mover, -1.0, 0.0)).astype(jnp.float32)
    done = ~valid | game.terminated
    new = state._replace(game=game, last_move=jnp.where(valid, square, state.last_move),
                         spoken=state.spoken | mover)
    ended = lambda x: (done & valid & x).astype(jnp.float32)
    return base.GameStep(state=new, rewards=rewards, done=done, info={
        "success": ended(rewards > 0), "defeat": ended(rewards < 0), "draw": ended(rewards == 0),
        "invalid": (mover & ~valid).astype(jnp.float32)})


@registry.register("env", "tic_tac_toe_self_play")
def make_self_play(tokenizer) -> TicTacToeSelfPlay:
  """Tic-tac-toe with the policy on both sides (JAX, lax.scan)."""
  return TicTacToeSelfPlay(tokenizer)


@registry.register("env", "tic_tac_toe")
def make(tokenizer, **options) -> TicTacToe:
  """Tic-tac-toe (pgx's rules) as text against a fixed opponent (JAX, lax.scan)."""
  return TicTacToe(tokenizer, **options)
