"""Multi-turn episodes inside lax.scan against a plain Python loop that re-prefills the history."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_steps import decode as _decode
from sampler_steps import prefill as _prefill

from jaxrl_agents import envs
from jaxrl_agents.envs import base
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import multiturn, scoring
from jaxrl_agents.rollout import sampler as sampler_lib


@pytest.fixture(scope="module")
def tiny():
  return zoo.load("tiny")


def _sampling(tok, temperature, n=6):
  return sampler_lib.SamplingConfig(max_new_tokens=n, temperature=temperature,
                                    stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                    pad_id=tok.pad_token_id)


def _reference(model, env, template, tasks, rng, sampling, group_size, num_turns):
  """The same episodes, one turn at a time in Python: each turn prefills the whole history
  (only its real tokens) into a fresh cache and decodes with the turn's key."""
  reset_rng, rng = jax.random.split(rng)
  p = len(tasks)
  states, prompt = multiturn.prompt_tokens(env, template, tasks, jax.random.split(reset_rng, p))
  rows = [[int(t) for t, m in zip(prompt.ids[i // group_size], prompt.mask[i // group_size],
                                  strict=True)
           if m] for i in range(p * group_size)]
  states = [env.reset(None, tasks[i // group_size])[0] for i in range(p * group_size)]
  done = [False] * len(rows)
  replies, rewards, keys = [], [], []
  step = jax.jit(env.step)
  stop = sampling.stop_tokens
  for k in range(num_turns):
    width = max(len(r) for r in rows)
    ids, mask = tokenizer_lib.pad_left(rows, 0, width)
    context = _prefill(model.params, model.cfg, jnp.asarray(ids), jnp.asarray(mask),
                       cache_len=width + sampling.max_new_tokens)
    out, _ = _decode(model.params, model.cfg, context, jax.random.fold_in(rng, k),
                     sampling, active=~jnp.asarray(done))
    turn_replies, turn_rewards = [], []
    keys.append([-1 if done[i] else int(env.state_key(states[i])) for i in range(len(rows))])
    for i in range(len(rows)):
      reply = [int(t) for t in np.asarray(out.tokens[i])[: int(out.lengths[i])]]
      turn_replies.append(reply if not done[i] else [])
      if done[i]:
        turn_rewards.append(0.0)
        continue
      rows[i] += reply
      action = base.Tokens(out.tokens[i], out.mask[i])
      result = step(states[i], action)
      states[i] = result.state
      turn_rewards.append(float(result.reward))
      done[i] = bool(result.done) or k == num_turns - 1
      if not done[i]:
        to_user = list(template.to_user)
        if to_user[0] in stop and reply and reply[-1] == to_user[0]:
          to_user = to_user[1:]
        obs = [int(t) for t, m in zip(result.obs.ids, result.obs.mask, strict=True) if m]
        rows[i] += to_user + obs + list(template.to_reply)
    replies.append(turn_replies)
    rewards.append(turn_rewards)
  return rows, replies, np.asarray(rewards).T, np.asarray(keys).T


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scanned_episodes_equal_a_python_loop_that_reprefills_the_history(tiny, temperature):
  tok = tiny.tokenizer
  env = envs.make("guess_number", tok, low=1, high=4)
  template = multiturn.turn_template(tok, system="Play well.")
  tasks = jnp.asarray([2, 3], jnp.int32)
  sampling = _sampling(tok, temperature)
  rng = jax.random.key(3)
  eps = multiturn.rollout(tiny.params, tiny.cfg, env, template, tasks, rng, sampling,
                          group_size=3, num_turns=3)
  rows, replies, rewards, keys = _reference(tiny, env, template, tasks, rng, sampling, 3, 3)
  traj = eps.traj.check()
  tokens, valid = np.asarray(traj.tokens), np.asarray(traj.valid)
  for i, row in enumerate(rows):
    assert tokens[i][valid[i]].tolist() == row  # the same stream, token for token
  turn_id, policy = np.asarray(traj.turn_id), np.asarray(traj.policy_mask)
  for k, turn_replies in enumerate(replies):
    for i, reply in enumerate(turn_replies):
      assert tokens[i][policy[i] & (turn_id[i] == k)].tolist() == reply
  np.testing.assert_array_equal(np.asarray(traj.turn_rewards), rewards)
  # The state each turn was taken from, as the environment keys it (GiGPO's anchors).
  np.testing.assert_array_equal(np.asarray(eps.turn_keys), keys)
  # Environment and template tokens are never policy tokens.
  assert (policy == (turn_id >= 0)).all()
  assert policy.sum() == sum(len(r) for turn in replies for r in turn)


def test_scoring_only_the_reply_columns_changes_nothing(tiny):
  """Logits for the reply blocks only (the Trajectory's reply_spans) give the same
  log-probabilities, entropies and gradients as logits for every column after the prompt."""
  tok = tiny.tokenizer
  env = envs.make("guess_number", tok, low=1, high=4)
  eps = multiturn.rollout(tiny.params, tiny.cfg, env, multiturn.turn_template(tok),
                          jnp.asarray([1, 4]), jax.random.key(2), _sampling(tok, 1.0),
                          group_size=2, num_turns=3)
  spans = eps.traj.check()
  every = spans.replace(reply_spans=())
  assert len(scoring.scored_columns(spans)) == 3 * 6 < len(scoring.scored_columns(every))
  policy = np.asarray(spans.policy_mask)

  def total(params, traj):
    logp, entropy = scoring.policy_logprobs(params, tiny.cfg, traj, with_entropy=True,
                                            group_size=2)
    return jnp.sum(logp) + jnp.sum(jnp.where(traj.policy_mask, entropy, 0.0)), (logp, entropy)

  # Jitted: eager, each op of the forward and backward would compile on its own.
  step = jax.jit(jax.value_and_grad(total, has_aux=True))
  (a, (logp_a, ent_a)), grad_a = step(tiny.params, spans)
  (b, (logp_b, ent_b)), grad_b = step(tiny.params, every)
  np.testing.assert_allclose(np.asarray(logp_a), np.asarray(logp_b), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent_a)[policy], np.asarray(ent_b)[policy], atol=1e-5)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  for x, y in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
  bad = spans.replace(reply_spans=spans.reply_spans[1:])
  with pytest.raises(ValueError, match="outside its reply_spans"):
    bad.check()


def test_guess_number_tracks_what_the_answers_rule_out(tiny):
  env = envs.make("guess_number", tiny.tokenizer, low=1, high=16)
  state, _ = env.reset(None, jnp.int32(11))
  np.testing.assert_allclose(float(env.potential(state)), -1.0)  # 16 numbers: 4 bits missing
  for guess, (low, high) in [("8", (9, 16)), ("14", (9, 13)), ("no idea", (9, 13)),
                             ("2", (9, 13)), ("10", (11, 13)), ("12", (11, 11))]:
    ids = tiny.tokenizer.encode(guess, add_special_tokens=False)
    out = env.step(state, base.Tokens(jnp.asarray(ids + [0] * (16 - len(ids)), jnp.int32),
                                      jnp.arange(16) < len(ids)))
    state = out.state
    assert (int(state.low), int(state.high)) == (low, high), guess
    assert int(env.state_key(state)) == low * 17 + high
  np.testing.assert_allclose(float(env.potential(state)), 0.0, atol=1e-7)  # one number left
  right = jnp.asarray(tiny.tokenizer.encode("11", add_special_tokens=False))
  assert float(env.step(state, base.Tokens(right, jnp.ones(right.shape, bool))).reward) == 1.0


def test_logprobs_recomputed_on_the_trajectory_equal_the_sampling_ones(tiny):
  tok = tiny.tokenizer
  env = envs.make("guess_number", tok, low=1, high=4)
  template = multiturn.turn_template(tok)
  eps = multiturn.rollout(tiny.params, tiny.cfg, env, template, jnp.asarray([1, 4]),
                          jax.random.key(0), _sampling(tok, 1.0), group_size=2, num_turns=3)
  traj = eps.traj
  # Some episode went past its first turn (every row is live at turn 0).
  assert int(np.asarray(traj.turn_mask).sum()) > traj.turn_mask.shape[0]
  mask = np.asarray(traj.policy_mask)
  for group_size in (1, 2):  # the full forward and the shared-prompt one
    recomputed, _ = jax.jit(scoring.policy_logprobs, static_argnames=("cfg", "group_size"))(
        tiny.params, tiny.cfg, traj, group_size=group_size)
    np.testing.assert_allclose(np.asarray(recomputed)[mask],
                               np.asarray(traj.sampling_logprobs)[mask], atol=1e-4)


def test_guess_number_reads_the_last_number_and_answers(tiny):
  tok = tokenizer_lib.byte_level_tokenizer()
  env = envs.make("guess_number", tok, low=1, high=16)
  state, _ = env.reset(None, jnp.int32(7))

  def reply(text):
    ids = tok.encode(text)
    return base.Tokens(jnp.asarray(ids + [0] * (32 - len(ids))), jnp.arange(32) < len(ids))

  def obs_text(result):
    return tok.decode(np.asarray(result.obs.ids)[np.asarray(result.obs.mask)])

  step = jax.jit(env.step)
  for text, answer, invalid in [("5", "Higher.", 0), ("maybe 12.", "Lower.", 0),
                                ("no idea", "Answer with just a number from 1 to 16.", 1),
                                ("99999999999999", "Lower.", 0), ("٧", "Answer with", 1),
                                ("3 or 7", "Correct!", 0)]:
    result = step(state, reply(text))
    assert obs_text(result).startswith(answer), text
    assert float(result.info["invalid"]) == invalid
    assert bool(result.done) == (answer == "Correct!")


def test_a_template_that_rewrites_earlier_turns_never_changes_the_sampled_tokens(tiny):
  """A template that drops earlier replies' reasoning (as some chat models' do): rendering
  the conversation again would change the history; the rollout never renders it again."""
  tok = tokenizer_lib.byte_level_tokenizer()
  tok.chat_template = (
      "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
      "{{ '<|im_start|>assistant\\n' + m['content'].split('</t>')[-1] + '<|im_end|>\\n' }}"
      "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
      "{% endif %}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\\n' }}{% endif %}")
  env = envs.make("guess_number", tok, low=1, high=4)
  template = multiturn.turn_template(tok)
  eps = multiturn.rollout(tiny.params, tiny.cfg, env, template, jnp.asarray([1, 2]),
                          jax.random.key(1), _sampling(tok, 1.0, n=8), group_size=2, num_turns=3)
  rows, _, _, _ = _reference(tiny, env, template, jnp.asarray([1, 2]), jax.random.key(1),
                          _sampling(tok, 1.0, n=8), 2, 3)
  traj = eps.traj
  for i, row in enumerate(rows):
    assert np.asarray(traj.tokens)[i][np.asarray(traj.valid)[i]].tolist() == row
  # What re-rendering would have produced for an earlier reply with reasoning in it:
  messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a</t>3"},
              {"role": "user", "content": "Higher."}]
  assert "a</t>" not in tokenizer_lib.chat_prompt(tok, messages)


def test_turns_driven_from_python_give_the_scanned_episodes(tiny):
  tok = tiny.tokenizer
  env = envs.make("guess_number", tok, low=1, high=3)
  template = multiturn.turn_template(tok)
  args = (tiny.params, tiny.cfg, env, template, jnp.asarray([1, 3]), jax.random.key(5),
          _sampling(tok, 1.0, n=3))
  scanned = multiturn.rollout(*args, group_size=2, num_turns=4)
  stepped = multiturn.rollout_by_turn(*args, group_size=2, num_turns=4)
  for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(stepped), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_end_of_turn_token_is_written_once_whatever_ended_the_reply():
  """Rows: a reply that ended with <|im_end|>, one cut at the budget, one inactive."""
  tok = tokenizer_lib.byte_level_tokenizer()
  template = multiturn.turn_template(tok)
  end = template.to_user[0]
  assert end == tok.convert_tokens_to_ids("<|im_end|>")
  reply = base.Tokens(jnp.asarray([[65, end, 0], [65, 66, 67], [0, 0, 0]]),
                      jnp.asarray([[True, True, False], [True, True, True], [False] * 3]))
  obs = base.Tokens(jnp.asarray([[70, 0]] * 3), jnp.asarray([[True, False]] * 3))
  block = multiturn._env_block(template, (end,), reply, obs, jnp.asarray([True, True, False]))
  rows = [np.asarray(block.ids)[i][np.asarray(block.mask)[i]].tolist() for i in range(3)]
  rest = list(template.to_user[1:]) + [70] + list(template.to_reply)
  assert rows[0] == rest  # the reply's own <|im_end|> closes its turn
  assert rows[1] == [end] + rest  # cut at the budget: the turn is closed for it
  assert rows[2] == []  # a finished episode gets nothing
  assert np.asarray(block.mask)[:2, -1].all()  # left-padded: real tokens end the block


def test_reading_numbers_saturates_instead_of_wrapping_around():
  reader = base.NumberReader(value=jnp.asarray([-1, 429497, 0, 5]),
                             digits=jnp.asarray([0, 6, 4, 1]),
                             fresh=jnp.asarray([False, False, False, False]))
  for ids, expected in [([1, 2], base.NUMBER_CAP), ([1, 2, 3], base.NUMBER_CAP),
                        ([3, 1, 1], base.NUMBER_CAP), ([3, 0, 3], 5)]:
    action = base.Tokens(jnp.asarray(ids), jnp.ones(len(ids), bool))
    value, found = base.last_number(reader, action)
    assert bool(found) and int(value) == expected, (ids, int(value))


@pytest.mark.parametrize("name, options", [
    ("guess_number", dict(low=1, high=16)), ("frozen_lake", dict(size=3, slippery=True)),
    ("sokoban", dict(size=5, inner_walls=1)), ("tic_tac_toe", dict(opponent="random"))])
def test_every_jax_environment_plays_the_same_episodes_scanned_and_turn_by_turn(tiny, name,
                                                                                options):
  """Each registered JAX-native environment inside the scan (vmapped, traced) against the same
  turns driven from Python, with sampled replies and its random stream (slips, opponents)."""
  tok = tiny.tokenizer
  env = envs.make(name, tok, **options)
  tasks = jax.vmap(env.sample_task)(jax.random.split(jax.random.key(0), 2))
  args = (tiny.params, tiny.cfg, env, multiturn.turn_template(tok), tasks, jax.random.key(4),
          _sampling(tok, 1.0, n=4))
  a = multiturn.rollout(*args, group_size=2, num_turns=3)
  b = multiturn.rollout_by_turn(*args, group_size=2, num_turns=3)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  a.traj.check()


@pytest.mark.parametrize("text, expected", [
    ("-1", -1), ("square -1", -1), ("5-3", -3), ("- 3", 3), ("7", 7), ("a -12 b", -12),
    ("-1 then 4", 4), ("x-0", 0), ("--2", -2), ("no number", None)])
def test_a_minus_sign_right_before_a_number_makes_it_negative_as_the_host_reads_it(
    tiny, text, expected):
  import re

  reader = base.number_reader(tiny.tokenizer)
  ids = tiny.tokenizer.encode(text, add_special_tokens=False)
  value, found = base.last_number(reader, base.Tokens(jnp.asarray(ids), jnp.ones(len(ids), bool)))
  host = re.findall(r"-?[0-9]+", text)
  assert (int(value) if bool(found) else None) == expected
  assert (int(host[-1]) if host else None) == expected  # guess_number_host's reading


def test_tic_tac_toe_reads_minus_one_as_no_square(tiny):
  env = envs.make("tic_tac_toe", tiny.tokenizer, opponent="first")
  # the agent moves first: square 1 is free, so reading "-1" as 1 would be a legal move
  task = env.sample_task(jax.random.key(0))._replace(agent_first=jnp.bool_(True))
  state, _ = env.reset(jax.random.key(1), task)

  def play(text):
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    return env.step(state, base.Tokens(jnp.asarray(ids), jnp.ones(len(ids), bool)))

  assert float(play("1").info["invalid"]) == 0.0
  assert float(play("-1").info["invalid"]) == 1.0
