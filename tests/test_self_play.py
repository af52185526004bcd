"""Self-play: tic-tac-toe with the policy on both sides by hand, the scanned plies against a
Python loop that re-prefills each side's conversation, and role-conditioned advantages."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_steps import decode as _decode
from sampler_steps import prefill as _prefill

from experiments import grpo
from experiments.configs import grpo_tic_tac_toe_self_play
from jaxrl_agents import envs, types
from jaxrl_agents.envs import base
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.objectives import credit
from jaxrl_agents.rollout import env_loop, multiturn, scoring, self_play
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.train import metrics as metrics_lib


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def _text(tok, obs):
  return tok.decode(np.asarray(obs.ids)[np.asarray(obs.mask)].tolist())


def _action(tok, text, width=16):
  ids = tokenizer_lib.plain_ids(tok, text)[:width]
  return base.Tokens(jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32),
                     jnp.arange(width) < len(ids))


def _game(tok, env, moves):
  """(the message before each move, each step's result)."""
  state = env.reset(None, jnp.int32(5))
  messages, steps = [], []
  for move in moves:
    messages.append((int(env.to_move(state)), _text(tok, env.observe(state))))
    out = jax.jit(env.step)(state, _action(tok, move))
    steps.append(out)
    state = out.state
  return messages, steps


def test_a_win_by_hand_each_side_sees_the_board_from_its_side(tiny):
  tok = tiny.tokenizer
  env = envs.make("tic_tac_toe_self_play", tok)
  # X: 5, O: 1, X: 3, O: 2, X: 7 completes the diagonal 3-5-7.
  messages, steps = _game(tok, env, ["5", "I take 1", "3", "2", "7"])
  assert [p for p, _ in messages] == [0, 1, 0, 1, 0]
  x_first, o_first, x_second = (m for _, m in messages[:3])
  assert x_first.startswith("Tic-tac-toe. You are X") and "I took" not in x_first
  assert " 1 2 3\n 4 5 6\n 7 8 9\n" in x_first
  # O's first message: the intro and X's move on the board, no "I took" (as the fixed
  # opponent's game shows it); later messages name the opponent's move.
  assert o_first.startswith("Tic-tac-toe. You are O") and "I took" not in o_first
  assert " 1 2 3\n 4 X 6\n 7 8 9\n" in o_first
  assert x_second.startswith("I took square 1.\n O 2 3\n 4 X 6\n 7 8 9\n")
  assert "You are" not in x_second
  assert messages[3][1].startswith("I took square 3.\n O 2 X\n 4 X 6\n 7 8 9\n")
  np.testing.assert_array_equal([np.asarray(s.rewards) for s in steps],
                                [[0, 0]] * 4 + [[1, -1]])
  assert [bool(s.done) for s in steps] == [False] * 4 + [True]
  np.testing.assert_array_equal(steps[-1].info["success"], [1, 0])
  np.testing.assert_array_equal(steps[-1].info["defeat"], [0, 1])


def test_a_draw_and_a_forfeit_by_hand(tiny):
  tok = tiny.tokenizer
  env = envs.make("tic_tac_toe_self_play", tok)
  _, steps = _game(tok, env, ["5", "1", "9", "3", "2", "8", "7", "4", "6"])
  np.testing.assert_array_equal(steps[-1].rewards, [0, 0])
  assert bool(steps[-1].done) and not any(bool(s.done) for s in steps[:-1])
  np.testing.assert_array_equal(steps[-1].info["draw"], [1, 1])
  # O names a taken square: O forfeits (-1), X is not rewarded for it (0).
  _, steps = _game(tok, env, ["5", "5"])
  np.testing.assert_array_equal(steps[-1].rewards, [0, -1])
  assert bool(steps[-1].done)
  np.testing.assert_array_equal(steps[-1].info["invalid"], [0, 1])
  np.testing.assert_array_equal(steps[-1].info["success"], [0, 0])


class Relay:
  """A two-player test game where every reply is a move: it ends after `length` plies (task
  1's games one ply earlier), and the task (0 or 1) says which player wins. Messages of
  three widths (padding inside the blocks); info counts each player's moves."""

  num_players = 2

  def __init__(self, tok, length):
    self.pieces = base.piece_table(tok, ["Your move.", "Your move, second player: the first "
                                         "one has moved.", "Again."])
    self.obs_width = self.pieces.ids.shape[-1]
    self.length = length

  def sample_task(self, key):
    return jax.random.randint(key, (), 0, 2)

  def reset(self, key, task):
    del key
    return jnp.int32(0), task

  def to_move(self, state):
    return state[0] % 2

  def observe(self, state):
    return base.row(self.pieces, jnp.minimum(state[0], 2))

  def step(self, state, action):
    del action
    ply, winner = state
    done = ply + 1 >= self.length - winner
    outcome = jnp.where(jnp.arange(2) == winner, 1.0, -1.0)
    return base.GameStep(state=(ply + 1, winner), rewards=jnp.where(done, outcome, 0.0),
                         done=done, info={"moves": (jnp.arange(2) == ply % 2).astype(jnp.float32)})


def _sampling(tok, temperature, n=5):
  return sampler_lib.SamplingConfig(max_new_tokens=n, temperature=temperature,
                                    stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                    pad_id=tok.pad_token_id)


def _reference(model, env, template, tasks, rng, sampling, group_size, num_plies):
  """The same games one ply at a time in Python: each side's conversation kept as a token
  list, the mover's message appended, every row prefilled afresh and decoded with the
  ply's key. Returns (each row's stream, each ply's replies per row)."""
  reset_rng, rng = jax.random.split(rng)
  games = len(tasks) * group_size
  keys = jax.random.split(reset_rng, games)
  states = [env.reset(keys[g], tasks[g // group_size]) for g in range(games)]
  rows = [list(template.opening) for _ in range(2 * games)]
  spoken, done = [False] * (2 * games), [False] * games
  stop, replies = sampling.stop_tokens, []
  step = jax.jit(env.step)
  for k in range(num_plies):
    moving = [False] * (2 * games)
    for g in range(games):
      if done[g]:
        continue
      i = 2 * g + int(env.to_move(states[g]))
      obs = env.observe(states[g])
      message = [int(t) for t, m in zip(obs.ids, obs.mask, strict=True) if m]
      if spoken[i]:
        to_user = list(template.to_user)
        if not (to_user[0] in stop and rows[i][-1] == to_user[0]):
          message = to_user + message
        else:
          message = to_user[1:] + message
      rows[i] += message + list(template.to_reply)
      spoken[i] = moving[i] = True
    width = max(len(r) for r in rows)
    ids, mask = tokenizer_lib.pad_left(rows, 0, width)
    context = _prefill(model.params, model.cfg, jnp.asarray(ids), jnp.asarray(mask),
                       cache_len=width + sampling.max_new_tokens)
    out, _ = _decode(model.params, model.cfg, context, jax.random.fold_in(rng, k),
                     sampling, active=jnp.asarray(moving))
    ply = []
    for i in range(2 * games):
      reply = [int(t) for t in np.asarray(out.tokens[i])[: int(out.lengths[i])]]
      ply.append(reply if moving[i] else [])
      if moving[i]:
        rows[i] += reply
        g = i // 2
        result = step(states[g], base.Tokens(out.tokens[i], out.mask[i]))
        states[g] = result.state
        done[g] = bool(result.done)
    replies.append(ply)
  return rows, replies


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scanned_plies_equal_a_python_loop_that_reprefills_each_side(tiny, temperature):
  tok = tiny.tokenizer
  env = Relay(tok, length=5)
  template = multiturn.turn_template(tok, system="Play well.")
  tasks = jnp.asarray([0, 1], jnp.int32)
  sampling, rng = _sampling(tok, temperature), jax.random.key(7)
  eps = self_play.rollout(tiny.params, tiny.cfg, env, template, tasks, rng, sampling,
                          group_size=2, num_plies=6)
  rows, replies = _reference(tiny, env, template, tasks, rng, sampling, 2, 6)
  traj = eps.traj.check()
  tokens, valid = np.asarray(traj.tokens), np.asarray(traj.valid)
  policy, turn_id = np.asarray(traj.policy_mask), np.asarray(traj.turn_id)
  for i, row in enumerate(rows):
    assert tokens[i][valid[i]].tolist() == row  # each side's own stream, token for token
  for k, ply in enumerate(replies):
    for i, reply in enumerate(ply):
      assert tokens[i][policy[i] & (turn_id[i] == k)].tolist() == reply
  # Player 0 moves at even plies, player 1 at odd ones: task 0's games take 5 plies (3 and
  # 2 moves), task 1's 4 (2 and 2); after its game ends a row writes nothing.
  live = np.asarray(traj.turn_mask)
  np.testing.assert_array_equal(live[0:4:2], [[1, 0, 1, 0, 1, 0]] * 2)
  np.testing.assert_array_equal(live[1:4:2], [[0, 1, 0, 1, 0, 0]] * 2)
  np.testing.assert_array_equal(live[4::2], [[1, 0, 1, 0, 0, 0]] * 2)
  np.testing.assert_array_equal(live[5::2], [[0, 1, 0, 1, 0, 0]] * 2)
  start, width = traj.reply_spans[3]
  assert not valid[4:, start + width:].any()  # task 1's games are over after ply 3
  # Each side's outcome sits on its last move: task 0's games player 0 wins, task 1's player 1.
  rewards = np.asarray(traj.turn_rewards)
  np.testing.assert_array_equal(np.asarray(traj.rewards), [1, -1, 1, -1, -1, 1, -1, 1])
  assert rewards[0, 4] == 1 and rewards[1, 3] == -1 and rewards[4, 2] == -1
  assert np.count_nonzero(rewards) == 8
  np.testing.assert_array_equal(eps.roles, [0, 1] * 4)
  np.testing.assert_array_equal(eps.info["moves"], [3, 2, 3, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(eps.info["unfinished"], [0] * 8)
  assert (policy == (turn_id >= 0)).all()


def test_logprobs_recomputed_on_self_play_trajectories_equal_the_sampling_ones(tiny):
  """The idle plies' padding in each side's cache is invisible: scoring the Trajectory in
  one pass gives the log-probs the sampler drew with (f32, 1e-4)."""
  tok = tiny.tokenizer
  eps = self_play.rollout(tiny.params, tiny.cfg, Relay(tok, length=4),
                          multiturn.turn_template(tok), jnp.asarray([0, 1, 1]),
                          jax.random.key(1), _sampling(tok, 1.0, n=6), group_size=2,
                          num_plies=4)
  traj = eps.traj.check()
  recomputed, _ = jax.jit(scoring.policy_logprobs, static_argnames="cfg")(tiny.params, tiny.cfg,
                                                                          traj)
  policy = np.asarray(traj.policy_mask)
  assert policy.sum() > 20
  np.testing.assert_allclose(np.asarray(recomputed)[policy],
                             np.asarray(traj.sampling_logprobs)[policy], atol=1e-4)


def test_a_game_cut_by_the_ply_limit_ends_unrewarded(tiny):
  tok = tiny.tokenizer
  eps = self_play.rollout(tiny.params, tiny.cfg, Relay(tok, length=9),
                          multiturn.turn_template(tok), jnp.asarray([0]), jax.random.key(1),
                          _sampling(tok, 1.0, n=3), group_size=1, num_plies=3)
  np.testing.assert_array_equal(eps.traj.rewards, [0, 0])
  np.testing.assert_array_equal(eps.info["unfinished"], [1, 1])
  np.testing.assert_array_equal(eps.turns, [2, 1])
  np.testing.assert_array_equal(eps.roles, [-1, -1])  # no outcome: nothing to credit


def test_tic_tac_toe_self_play_rollout_counts_forfeits_and_roles(tiny):
  """The tiny random model names no square: the first side forfeits at once, the second
  never moves (role -1, no policy tokens)."""
  tok = tiny.tokenizer
  env = envs.make("tic_tac_toe_self_play", tok)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 2))
  eps = self_play.rollout(tiny.params, tiny.cfg, env, multiturn.turn_template(tok), tasks,
                          jax.random.key(1), _sampling(tok, 1.0, n=3), group_size=2,
                          num_plies=9)
  traj = eps.traj.check()
  invalid = np.asarray(eps.info["invalid"])
  roles, policy = np.asarray(eps.roles), np.asarray(traj.policy_mask)
  rewards, info = np.asarray(traj.rewards), {k: np.asarray(v) for k, v in eps.info.items()}
  assert invalid[0::2].sum() >= 1
  for g in range(4):
    x, o = 2 * g, 2 * g + 1
    assert roles[x] == 0 and info["unfinished"][x] == 0
    if invalid[x]:  # X forfeited on its first reply: O never moved, nothing to credit
      assert roles[o] == -1 and not policy[o].any()
      assert rewards[x] == -1 and rewards[o] == 0
      assert info["success"][o] == 0 and info["defeat"][x] == 0  # a forfeit is no game
    # A finished game: the two sides' outcomes are a win and a loss, a draw, or a forfeit.
    assert (rewards[x], rewards[o]) in {(1, -1), (-1, 1), (0, 0), (-1, 0), (0, -1)}


def _rollout(rewards, roles):
  b = len(rewards)
  traj = types.Rollout(traj=None, examples=[{}] * b, prompts=[""] * b, completions=[""] * b,
                         rewards=np.asarray(rewards, np.float32), components={},
                         correct=np.zeros(b, np.float32), roles=np.asarray(roles, np.int32))
  return traj


def test_role_advantages_match_a_hand_loop_and_carry_the_baseline_across_steps():
  s = grpo.settings_from_config(grpo_tic_tac_toe_self_play.get_config("tiny"))
  baseline = grpo.role_baseline(s).init()
  b = {0: 0.0, 1: 0.0}
  steps = [([1, -1, -1, 1, 0, 0, -1, 0], [0, 1, 0, 1, 0, 1, 0, -1]),
           ([1, -1, 1, -1, -1, 1, 0, 0], [0, 1, 0, 1, 0, 1, 0, 1])]
  for rewards, roles in steps:
    adv, baseline = grpo.role_advantages(s, _rollout(rewards, roles), baseline)
    expected = []
    for r, p in zip(rewards, roles, strict=True):  # read, then update (credit's convention)
      if p < 0:
        expected.append(0.0)
        continue
      expected.append(r - b[p])
      b[p] = 0.95 * b[p] + 0.05 * r
    np.testing.assert_allclose(adv, expected, atol=1e-6)
    np.testing.assert_allclose(baseline.baseline, [b[0], b[1]], atol=1e-6)
  np.testing.assert_array_equal(baseline.count, [8, 7])
  # The same as the library's function over both steps' rows in order.
  all_r = jnp.asarray(sum((r for r, _ in steps), []), jnp.float32)
  all_p = jnp.asarray(sum((p for _, p in steps), []))
  _, final = credit.role_conditioned_advantages(all_r, all_p, jnp.zeros(2), 2, 0.95,
                                                valid=all_p >= 0)
  np.testing.assert_allclose(baseline.baseline, final, atol=1e-6)


def test_role_advantages_refuse_a_rollout_without_roles():
  s = grpo.settings_from_config(grpo_tic_tac_toe_self_play.get_config("tiny"))
  r = _rollout([1.0, -1.0], [0, 1])
  r.roles = None
  with pytest.raises(ValueError, match="needs each row's role"):
    grpo.role_advantages(s, r, grpo.role_baseline(s).init())


def test_self_play_configs_are_refused_where_they_mean_nothing(tiny):
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.turn_credit.name = "gigpo"
  with pytest.raises(ValueError, match="turn_credit 'gigpo' is not defined"):
    grpo.validate(config)
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.advantage_kwargs.decay = 1.0
  with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
    grpo.validate(config)
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.env, config.task = "", "arithmetic"
  config.env_reply_rewards = {}  # (a single-turn run refuses them first, by name)
  with pytest.raises(ValueError, match="self-play's: set config.env"):
    grpo.validate(config)
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.advantage = "grpo"
  with pytest.raises(ValueError, match="two-player game: self-play trains it"):
    env_loop.make(config, tiny, grpo.episode_credit(config))
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.env = "tic_tac_toe"
  with pytest.raises(ValueError, match="'tic_tac_toe' is not a two-player game"):
    env_loop.make(config, tiny, grpo.episode_credit(config))
  with pytest.raises(ValueError, match="needs a 2-player environment"):
    self_play.check_env(envs.make("tic_tac_toe", tiny.tokenizer))


@pytest.mark.slow
def test_tiny_self_play_run_writes_both_sides_and_resumes_exactly(tmp_path, crashed_copy):
  """The role baselines live in the train state: a run stopped after step 2 and resumed
  logs the same records (baselines included) as the uninterrupted run."""
  config = grpo_tic_tac_toe_self_play.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 4, 2, 2
  full = str(tmp_path / "full")
  grpo.train(config, full, progress=False)
  records = lambda w, kind: [r for r in metrics_lib.read_jsonl(os.path.join(w, "metrics.jsonl"))
                             if r["kind"] == kind]
  train = records(full, "train")
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  for key in ("player0/invalid", "player1/success", "game_plies", "role_baseline/player0",
              "role_baseline/player1", "unfinished"):
    assert key in train[0], key
  # The first mover forfeits most games: its baseline falls below zero and keeps falling.
  baselines = [r["role_baseline/player0"] for r in train]
  assert baselines[0] < 0 and baselines == sorted(baselines, reverse=True)
  evals = records(full, "eval")  # against the fixed opponent, on either side
  assert [r["step"] for r in evals] == [0, 2, 4] and "defeat" in evals[0]
  samples = metrics_lib.read_jsonl(os.path.join(full, "samples.jsonl"))
  train_samples = [s for s in samples if s["kind"] == "train"]
  assert any("You are X" in s["completion"] for s in train_samples)
  # Each side's first message comes before its first reply: samples keep it apart.
  assert any(s.get("first_message", "").startswith("Tic-tac-toe. You are X")
             for s in train_samples)
  # The workdir as a crash after the checkpoint of step 2 leaves it, resumed.
  part = crashed_copy(full, tmp_path / "part", 2)
  grpo.train(config, part, progress=False)
  strip = lambda rs: [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k}
                      for r in rs]
  assert strip(records(part, "train")) == strip(train)


def test_a_sides_message_block_by_hand():
  """user_block's four cases: a first message (no closing, no header), a message after a
  reply that ended with the end-of-turn token (header only), one after a reply cut at the
  budget (closing token + header), and a row that is not moving (padding only)."""
  template = multiturn.TurnTemplate(opening=(1, 2), to_reply=(8, 9), to_user=(5, 6))
  obs = base.Tokens(jnp.asarray([[40, 41, 0]] * 4), jnp.asarray([[True, True, False]] * 4))
  block = multiturn.user_block(template, (5,), obs, jnp.asarray([True, True, True, False]),
                               ended=jnp.asarray([False, True, False, False]),
                               first=jnp.asarray([True, False, False, False]))
  rows = [np.asarray(block.ids[i])[np.asarray(block.mask[i])].tolist() for i in range(4)]
  assert rows == [[40, 41, 8, 9], [6, 40, 41, 8, 9], [5, 6, 40, 41, 8, 9], []]
  assert bool(block.mask[0, -1]) and not bool(block.mask[0, 0])  # left-padded
  # A template whose user header does not start with a stop token: always written whole.
  template = multiturn.TurnTemplate(opening=(1, 2), to_reply=(8, 9), to_user=(7, 6))
  two = base.Tokens(obs.ids[:2], obs.mask[:2])
  block = multiturn.user_block(template, (5,), two, jnp.asarray([True, True]),
                               ended=jnp.asarray([True, False]), first=jnp.asarray([False, True]))
  rows = [np.asarray(block.ids[i])[np.asarray(block.mask[i])].tolist() for i in range(2)]
  assert rows == [[7, 6, 40, 41, 8, 9], [40, 41, 8, 9]]
