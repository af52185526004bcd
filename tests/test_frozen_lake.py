"""FrozenLake: reading moves, the lake's rules by hand, slipping odds, maps, and the scan."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_env_smoke

from experiments import grpo
from experiments.configs import grpo_frozen_lake
from jaxrl_agents import envs
from jaxrl_agents.envs import base, frozen_lake
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.train import metrics as metrics_lib

WIDTH = 24


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m-instruct"])
def tok(request):
  if request.param == "tiny":
    return zoo.load("tiny").tokenizer
  return request.getfixturevalue("smollm2").tokenizer


def _action(tok, text):
  ids = tokenizer_lib.plain_ids(tok, text)[:WIDTH]
  return base.Tokens(jnp.asarray(ids + [0] * (WIDTH - len(ids)), jnp.int32),
                     jnp.arange(WIDTH) < len(ids))


@pytest.mark.parametrize("text, move", [
    ("down", 1), ("I will go Right.", 2), ("left, no: UP", 3), ("Up then left", 0),
    ("  down\n", 1), ("Move: right", 2)])
def test_the_last_move_named_is_read(tok, text, move):
  reader = base.keyword_reader(tok, frozen_lake.MOVES)
  index, found = jax.jit(base.last_keyword)(reader, _action(tok, text))
  assert bool(found) and int(index) == move, text


@pytest.mark.parametrize("text", ["", "stay", "<|im_end|>", "1234", "l e f t"])
def test_no_move_is_read_from_a_reply_without_one(tok, text):
  reader = base.keyword_reader(tok, frozen_lake.MOVES)
  _, found = base.last_keyword(reader, _action(tok, text))
  assert not bool(found), text


def _render(tok, obs):
  return tok.decode(np.asarray(obs.ids)[np.asarray(obs.mask)].tolist())


def test_a_worked_game_is_the_environment_s_own_game(tok):
  """The demonstration's messages are what the environment says when its moves are played
  (text rendering == token rendering), the moves are a shortest path, and the last one
  reaches the goal."""
  env = envs.make("frozen_lake", tok, size=4, hole_prob=0.3, demonstrations=2)
  messages = env.preamble
  assert len(messages) % 2 == 0 and env.preamble[0]["role"] == "user"
  games = [i for i, m in enumerate(messages) if m["content"].startswith("Grid game.")]
  assert games[0] == 0 and len(games) == 2
  step = jax.jit(env.step)
  for start, end in zip(games, games[1:] + [len(messages)], strict=True):
    game = messages[start:end]
    grid = game[0]["content"].split("\n")[1:5]
    holes = np.asarray([[cell == "H" for cell in line.split()] for line in grid])
    assert holes.any() and frozen_lake.shortest_path(holes) is not None
    state, obs = env.reset(jax.random.key(0), jnp.asarray(holes))
    assert _render(tok, obs) == game[0]["content"]
    moves = [m["content"] for m in game[1::2]]
    assert len(moves) == len(frozen_lake.shortest_path(holes)) >= 6
    for i, move in enumerate(moves):
      result = step(state, _action(tok, move))
      state = result.state
      if i < len(moves) - 1:
        assert _render(tok, result.obs) == game[2 + 2 * i]["content"]
        assert not bool(result.done)
    assert float(result.reward) == 1.0 and bool(result.done)


def test_shortest_paths_by_hand():
  open_map = np.zeros((3, 3), bool)
  assert len(frozen_lake.shortest_path(open_map)) == 4
  wall = np.asarray([[0, 1, 0], [0, 1, 0], [0, 0, 0]], bool)
  assert frozen_lake.shortest_path(wall) == [1, 1, 2, 2]  # down, down, right, right
  assert frozen_lake.shortest_path(np.asarray([[0, 1], [1, 0]], bool)) is None


def test_the_classic_lake_by_hand(tok):
  env = envs.make("frozen_lake", tok, classic=True)
  step = jax.jit(env.step)
  state, obs = env.reset(jax.random.key(0), env.sample_task(jax.random.key(0)))
  assert _render(tok, obs).endswith(" X . . .\n . H . H\n . . . H\n H . . G\nYour move? "
                                    "Say left, down, right or up.")
  # Up from the start bumps into the edge; then down, down, right, down, right, right.
  path = [("up", 0, "You bumped into the edge."), ("down", 4, "You went down."),
          ("down", 8, "You went down."), ("right", 9, "You went right."),
          ("down", 13, "You went down."), ("right", 14, "You went right."),
          ("right", 15, "You reached the goal!")]
  for i, (move, pos, said) in enumerate(path):
    out = step(state, _action(tok, move))
    state = out.state
    assert int(state.pos) == pos and _render(tok, out.obs).startswith(said), (move, pos)
    assert int(env.state_key(state)) == pos
    last = i == len(path) - 1
    assert float(out.reward) == float(last) and bool(out.done) == last
  np.testing.assert_allclose(float(env.potential(state)), 0.0)
  # From the start, right then down lands in the hole at (1, 1): the episode ends with 0.
  state, _ = env.reset(jax.random.key(0), env.sample_task(jax.random.key(0)))
  np.testing.assert_allclose(float(env.potential(state)), -1.0)
  state = step(state, _action(tok, "right")).state
  out = step(state, _action(tok, "down"))
  assert bool(out.done) and float(out.reward) == 0.0 and float(out.info["fell"]) == 1.0
  assert _render(tok, out.obs).startswith("You fell into a hole.")
  bad = step(state, _action(tok, "sideways"))
  assert float(bad.info["invalid"]) == 1.0 and int(bad.state.pos) == int(state.pos)
  assert not bool(bad.done)


def test_slippery_moves_go_the_intended_way_a_third_of_the_time(tok):
  env = envs.make("frozen_lake", tok, size=4, hole_prob=0.0, slippery=True)
  state, _ = env.reset(jax.random.key(0), jnp.zeros((4, 4), bool))
  state = state._replace(pos=jnp.int32(5))  # (1, 1): every move lands somewhere new
  keys = jax.random.split(jax.random.key(1), 3000)
  action = _action(tok, "down")
  pos = jax.vmap(lambda k: env.step(state._replace(key=k), action).state.pos)(keys)
  counts = {int(p): int(c) for p, c in zip(*np.unique(np.asarray(pos), return_counts=True),
                                           strict=True)}
  # down -> (2, 1) = 9; sideways: left (1, 0) = 4, right (1, 2) = 6; never up (1).
  assert set(counts) == {4, 6, 9}, counts
  for p in (4, 6, 9):  # 1000 expected each; 5 standard deviations is about 130
    assert abs(counts[p] - 1000) < 130, counts


def test_sampled_maps_have_a_path_and_free_corners(tok):
  env = envs.make("frozen_lake", tok, size=5, hole_prob=0.3)
  maps = np.asarray(jax.vmap(env.sample_task)(jax.random.split(jax.random.key(2), 200)))
  assert not maps[:, 0, 0].any() and not maps[:, -1, -1].any()
  assert 0.15 < maps.mean() < 0.35  # holes are drawn, and some maps are rejected
  # One program for the 200 maps (called one by one, each call traced and compiled anew).
  assert np.all(jax.jit(jax.vmap(frozen_lake.reachable))(jnp.asarray(maps)))
  wall = np.zeros((3, 3), bool)
  wall[1, :] = True
  assert not bool(frozen_lake.reachable(jnp.asarray(wall)))
  wall[1, 2] = False
  assert bool(frozen_lake.reachable(jnp.asarray(wall)))


def test_bad_options_are_refused(tok):
  with pytest.raises(ValueError, match="size"):
    envs.make("frozen_lake", tok, size=1)
  with pytest.raises(ValueError, match="hole_prob"):
    envs.make("frozen_lake", tok, hole_prob=1.0)
  with pytest.raises(ValueError, match="classic map is 4x4"):
    envs.make("frozen_lake", tok, size=5, classic=True)
  for one_map in (dict(classic=True), dict(hole_prob=0.0)):  # the worked game = the task
    with pytest.raises(ValueError, match="would be the task itself"):
      envs.make("frozen_lake", tok, demonstrations=1, **one_map)


@pytest.mark.slow
def test_tiny_frozen_lake_run_writes_its_episodes(tmp_path):
  config = grpo_frozen_lake.get_config("tiny")
  config.steps, config.eval_every, config.checkpoint_every = 2, 2, 2
  grpo.train(config, str(tmp_path), progress=False)
  records = metrics_lib.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
  train = [r for r in records if r["kind"] == "train"]
  assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)
  for key in ("fell", "invalid", "success", "episode_turns", "reward/shaped_return_mean"):
    assert key in train[0], key
  samples = metrics_lib.read_jsonl(os.path.join(str(tmp_path), "samples.jsonl"))
  assert any(" X" in turn["env"] for s in samples if s["kind"] == "train"
             for turn in s["turns"])
  test_env_smoke.assert_the_update_had_a_gradient(tmp_path)
