"""The RL trainer's rollouts and evaluation over a JAX-native environment (`config.env`).

An RL experiment's train step takes a collector (params, examples, rng -> Rollout) and an
evaluator (`experiments/common.py`'s `episodes`); this module makes them for multi-turn episodes
(`rollout.multiturn`): each step draws `prompts_per_step` tasks from the step's
key, plays `group_size` episodes of each, and hands the Trajectory to the
algorithm as any rollout. The reward is the episode's return (the sum of its
turn rewards); "accuracy" is the environment's success rate. Evaluation plays a
fixed set of held-out tasks greedily.

`config.env_reply_rewards` (registered rewards, as `config.rewards` names them) score
the agent's replies of each training episode, concatenated, and are added to its
return: a length penalty, a format term. The `:tiny` smoke configs use one, so
that the tiny random model's rewards vary and its update has a gradient.

Metrics added to each train and eval record: `episode_turns`, the per-episode
means of the environment's info entries (`invalid`, `success`, ...), and per
turn `turn<k>/reward_mean` and `turn<k>/active` (the fraction of episodes that
reached turn k; the analysis notebook's heatmaps read `turn<k>/...`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import envs, types
from jaxrl_agents import rewards as rewards_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.objectives import credit
from jaxrl_agents.parallel import distributed
from jaxrl_agents.rollout import host_loop, multiturn, self_play, single_turn
from jaxrl_agents.rollout import records as records_lib

# Held-out tasks come from this key, whatever the run's seed: runs compare on the same tasks.
EVAL_TASKS_KEY = 20_261_125


class NoData:
  """The data stream of an environment run: tasks come from the step's key, so it has no state."""

  def __next__(self):
    return None

  def get_state(self) -> dict:
    return {}

  def set_state(self, state) -> None:
    del state


def _text(tok, ids: np.ndarray, mask: np.ndarray) -> str:
  return tok.decode(ids[mask].tolist(), skip_special_tokens=False)


def episode_details(tok, traj) -> list[dict]:
  """Per episode, for samples.jsonl: each turn's reply and environment text (and, where a
  message comes before the first reply, as in self-play, that message), and the stream's
  real tokens with their policy mask and turn ids."""
  tokens, valid = distributed.to_host(traj.tokens), distributed.to_host(traj.valid)
  policy, turn_id = distributed.to_host(traj.policy_mask), distributed.to_host(traj.turn_id)
  lp, out = traj.prompt_width, []
  for row in range(tokens.shape[0]):
    turns, current, before = [], None, []
    for col in np.flatnonzero(valid[row][lp:]) + lp:
      if policy[row, col] and (current is None or current["turn"] != turn_id[row, col]):
        current = {"turn": int(turn_id[row, col]), "reply": [], "env": []}
        turns.append(current)
      if current is not None:
        current["reply" if policy[row, col] else "env"].append(int(tokens[row, col]))
      else:  # a message before the first reply (self-play: a side's first message)
        before.append(int(tokens[row, col]))
    first = {"first_message": tok.decode(before, skip_special_tokens=False)} if before else {}
    out.append({
        **first,
        "turns": [{"reply": tok.decode(t["reply"], skip_special_tokens=False),
                   "env": tok.decode(t["env"], skip_special_tokens=False)} for t in turns],
        "tokens": tokens[row][valid[row]].tolist(),
        "policy_mask": policy[row][valid[row]].astype(int).tolist(),
        "turn_id": turn_id[row][valid[row]].tolist()})
  return out


def to_rollout(tok, eps: multiturn.Episodes, labels: list[str], group_size: int = 1,
               failed: np.ndarray | None = None, details_traj=None,
               failures: list | None = None, shaping_gamma: float | None = None,
               information_gain: bool = False, reply_reward=None) -> types.Rollout:
  """The Episodes as an `types.Rollout`: rewards are returns, `correct` the success flag;
  `labels` names each row's task (samples.jsonl's "answer").

  With `shaping_gamma`, the turn rewards the update reads are potential-shaped
  (`shape_turn_rewards`): turn-level credit and PPO's GAE read them. The episode
  rewards (GRPO's group advantage) stay the environment's returns: with a
  discount below 1 a shaped sum would not telescope, and staying put would pay.
  Both are logged ("return", "shaped_return").

  With `information_gain` (IGPO), the turn rewards the update reads are the
  gains in the policy's probability of the gold answer
  (`credit.igpo_turn_rewards` of `eps.answer_logp`), the return on each
  episode's last turn; the sum of the gains is logged as "information_gain".

  With `reply_reward` (`reply_rewards`), each episode's reward is its return plus that
  score of its replies; the score and its parts are logged as "reply/<name>".

  Rows an environment failure ended (`failed`) are out of the loss already; their
  reward becomes the mean of their group's other returns, so that they move
  neither the group's baseline nor its spread (an infrastructure failure is not a
  lesson for the policy's siblings either).
  """
  traj = eps.traj
  tokens, valid = distributed.to_host(traj.tokens), distributed.to_host(traj.valid)
  lp = traj.prompt_width
  returns = distributed.to_host(traj.rewards).astype(np.float32)
  components = {"return": returns}
  traj = _credited_turn_rewards(eps, returns, shaping_gamma, information_gain, components)
  info = {k: distributed.to_host(v).astype(np.float32) for k, v in eps.info.items()}
  correct = (info["success"] > 0).astype(np.float32) if "success" in info \
      else (returns > 0).astype(np.float32)
  rewards = returns
  if reply_reward is not None:
    policy = distributed.to_host(traj.policy_mask) & valid
    score, parts = reply_reward([tok.decode(row[m].tolist(), skip_special_tokens=True)
                                 for row, m in zip(tokens, policy, strict=True)])
    rewards = returns + score
    components.update({f"reply/{k}": np.asarray(v, np.float32) for k, v in parts.items()})
  if failed is not None and failed.any():
    rewards = _neutral_failed(rewards, failed, group_size)
  return types.Rollout(
      traj=traj, examples=[{"answer": label} for label in labels],
      prompts=[_text(tok, row[:lp], m[:lp]) for row, m in zip(tokens, valid, strict=True)],
      completions=[_text(tok, row[lp:], m[lp:]) for row, m in zip(tokens, valid, strict=True)],
      rewards=rewards, components=components, correct=correct,
      turn_keys=distributed.to_host(eps.turn_keys),
      roles=None if eps.roles is None else distributed.to_host(eps.roles).astype(np.int32),
      details=[{**d, "failure": f} for d, f in zip(
          episode_details(tok, traj if details_traj is None else details_traj),
          failures or [None] * rewards.shape[0], strict=True)])


def _credited_turn_rewards(eps: multiturn.Episodes, returns: np.ndarray,
                           shaping_gamma: float | None, information_gain: bool,
                           components: dict):
  """The trajectory with the turn rewards the update reads (`to_rollout`: potential-shaped,
  or IGPO's information gains, or the environment's), logging what they add to
  `components`."""
  traj = eps.traj
  if shaping_gamma is not None:
    traj = traj.replace(turn_rewards=shape_turn_rewards(eps, shaping_gamma))
    components["shaped_return"] = distributed.to_host(traj.rewards).astype(np.float32)
  if information_gain:
    traj = traj.replace(turn_rewards=credit.igpo_turn_rewards(
        eps.answer_logp, traj.turn_mask, jnp.asarray(returns)))
    # The gains the update uses: every turn's but the last (whose score, after the
    # episode ended, means nothing), i.e. the turn rewards less the return on the last.
    played = distributed.to_host(traj.turn_mask).any(1)
    components["information_gain"] = (distributed.to_host(traj.turn_rewards).sum(-1)
                                      - np.where(played, returns, 0.0)).astype(np.float32)
  return traj


def reply_rewards(config):
  """config.env_reply_rewards as replies -> (f32[B] weighted sum, {name: f32[B]}), or None."""
  spec = dict(config.get("env_reply_rewards", {}))
  # experiments/common.py checked the names (host rewards only) and their options.
  return rewards_lib.from_config(spec) if spec else None


def shape_turn_rewards(eps: multiturn.Episodes, gamma: float) -> jax.Array:
  """Potential-based shaping of the turn rewards: r_k + gamma phi(s_{k+1}) - phi(s_k).

  phi is the environment's `potential` of the state each turn starts from; the
  state after the last turn is terminal (phi = 0). The discounted shaped return
  from turn k is the return minus phi(s_k) ("Policy invariance under reward
  transformations", Ng, Harada and Russell): the discount must be the one the
  credit uses (the trainer's `Credit.shaping_gamma`), or the shaping changes what is learned.
  """
  phi = eps.turn_potentials
  after = jnp.concatenate([phi, jnp.zeros_like(phi[:, :1])], axis=1)  # not live: 0
  return credit.potential_based_shaping(eps.traj.turn_rewards, after, gamma,
                                        eps.traj.turn_mask)


def _neutral_failed(rewards: np.ndarray, failed: np.ndarray, group_size: int) -> np.ndarray:
  """Failed rows' rewards replaced by the mean of their group's healthy rows (0 if none)."""
  grouped, bad = rewards.reshape(-1, group_size).copy(), failed.reshape(-1, group_size)
  healthy = np.where(bad, 0.0, grouped).sum(1) / np.maximum((~bad).sum(1), 1)
  grouped[bad] = np.broadcast_to(healthy[:, None], grouped.shape)[bad]
  return grouped.reshape(-1)


def episode_metrics(eps: multiturn.Episodes) -> dict[str, float]:
  """Episode length, info means and per-turn reward / reach."""
  out = {"episode_turns": float(np.mean(distributed.to_host(eps.turns)))}
  for name, values in eps.info.items():
    out[name] = float(np.mean(distributed.to_host(values)))
  rewards = distributed.to_host(eps.traj.turn_rewards)
  live = distributed.to_host(eps.traj.turn_mask)
  for k in range(rewards.shape[1]):
    out[f"turn{k}/active"] = float(live[:, k].mean())
    out[f"turn{k}/reward_mean"] = float(rewards[live[:, k], k].mean()) if live[:, k].any() \
        else 0.0
  return out


def _labels(tasks, group_size: int) -> list[str]:
  """A JAX task batch's first leaf, one string per row (task-major, G rows each)."""
  first = distributed.to_host(jax.tree.leaves(tasks)[0])
  return [str(t) for t in np.repeat(first, group_size, axis=0).tolist()]


def _eval_record(r: types.Rollout, eps: multiturn.Episodes) -> dict[str, float]:
  return {"accuracy": float(r.correct.mean()), "reward_mean": float(r.rewards.mean()),
          **episode_metrics(eps)}


# Counts over the batch (summed across evaluation batches, not averaged).
_COUNTERS = ("env_errors", "env_timeouts", "obs_truncated", "env_calls_stuck")


def _weighted(records: list[tuple[int, dict]]) -> dict[str, float]:
  """Batch records averaged with their sizes as weights (counters summed), and the count."""
  total = sum(n for n, _ in records)
  keys = sorted({k for _, rec in records for k in rec})
  out = {k: sum(rec.get(k, 0.0) for _, rec in records) if k in _COUNTERS
         else sum(n * rec.get(k, 0.0) for n, rec in records) / total for k in keys}
  return {**out, "num_examples": total}


def make(config, model: zoo.Model, credit_: Credit | None = None):
  """(collect, evaluate, data) of config.env's episodes (env_kwargs, max_turns), with what
  the trainer's credit asks of them (`Credit`; None: episode-level credit)."""
  credit_ = credit_ or Credit()
  tok = model.tokenizer
  env = envs.make(config.env, tok, **dict(config.get("env_kwargs", {})))
  _check_credit(credit_, env, config.env)
  shaping, igpo = credit_.shaping_gamma, credit_.information_gain
  two_players = getattr(env, "num_players", 1) > 1
  if two_players != credit_.self_play:
    raise ValueError(
        f"{config.env!r} is a two-player game: self-play trains it with GRPO's advantage "
        f"{self_play.ADVANTAGE!r}" if two_players else
        f"advantage {self_play.ADVANTAGE!r} is self-play's; {config.env!r} is not a "
        "two-player game")
  replies = reply_rewards(config)
  if getattr(env, "host", False):
    return _make_host(config, model, env, igpo, replies)
  if two_players:
    return _make_self_play(config, model, env, replies)
  template = multiturn.turn_template(tok, config.get("system_prompt") or None,
                                     getattr(env, "preamble", ()))
  sampling = single_turn.sampling_from_config(config, tok)
  sample_tasks = jax.jit(jax.vmap(env.sample_task))

  def collect(params, examples, rng):
    del examples
    tasks, play_rng = _step_tasks(config, sample_tasks, rng)
    eps = multiturn.rollout(params, model.cfg, env, template, tasks, play_rng, sampling,
                            group_size=config.group_size, num_turns=config.max_turns,
                            score_answers=igpo)
    return to_rollout(tok, eps, _labels(tasks, config.group_size), shaping_gamma=shaping,
                      information_gain=igpo, reply_reward=replies), episode_metrics(eps)

  return collect, _evaluator(config, model, env, template, config.max_turns), NoData()


def _step_tasks(config, sample_tasks, rng: jax.Array) -> tuple[Any, jax.Array]:
  """The step's `prompts_per_step` tasks, drawn from its key, and the key to play them with."""
  task_rng, play_rng = jax.random.split(rng)
  return sample_tasks(jax.random.split(task_rng, config.prompts_per_step)), play_rng


def _evaluator(config, model: zoo.Model, env, template: multiturn.TurnTemplate, turns: int):
  """evaluate(params) -> (record, samples): greedy episodes of the fixed held-out tasks."""
  tok = model.tokenizer
  greedy = single_turn.sampling_from_config(config, tok, greedy=True)
  sample_tasks = jax.jit(jax.vmap(env.sample_task))
  eval_tasks = sample_tasks(jax.random.split(jax.random.key(EVAL_TASKS_KEY), config.eval_size))

  def evaluate(params):
    records, samples = [], []
    for start in range(0, config.eval_size, config.eval_batch_size):
      n = min(config.eval_batch_size, config.eval_size - start)
      # One compiled batch shape: the last batch is padded with its first task.
      rows = np.minimum(np.arange(start, start + config.eval_batch_size), start + n - 1)
      rows[n:] = start
      tasks = jax.tree.map(lambda x, rows=rows: x[rows], eval_tasks)
      eps = multiturn.rollout(params, model.cfg, env, template, tasks, jax.random.key(0), greedy,
                              group_size=1, num_turns=turns)
      eps = jax.tree.map(lambda x, n=n: x[:n], eps)
      r = to_rollout(tok, eps, _labels(jax.tree.map(lambda x, n=n: x[:n], tasks), 1))
      records.append((n, _eval_record(r, eps)))
      samples += records_lib.rollout_samples(r)
    return _weighted(records), samples

  return evaluate


def _make_self_play(config, model: zoo.Model, env, replies=None):
  """(collect, evaluate, data) for a two-player game (`rollout.self_play`).

  Training plays G games of each of `prompts_per_step` tasks with the policy on
  both sides (`max_turns` plies); evaluation plays the game's fixed opponent
  (`env.evaluation_env`, `env.evaluation_turns` turns) greedily, on either side.
  """
  self_play.check_env(env)
  tok = model.tokenizer
  template = multiturn.turn_template(tok, config.get("system_prompt") or None)
  sampling = single_turn.sampling_from_config(config, tok)
  sample_tasks = jax.jit(jax.vmap(env.sample_task))

  def collect(params, examples, rng):
    del examples
    tasks, play_rng = _step_tasks(config, sample_tasks, rng)
    eps = self_play.rollout(params, model.cfg, env, template, tasks, play_rng, sampling,
                            group_size=config.group_size, num_plies=config.max_turns)
    seeds = np.repeat(distributed.to_host(jax.tree.leaves(tasks)[0]),
                      config.group_size * self_play.PLAYERS, axis=0)
    labels = [f"game {s} player {i % self_play.PLAYERS}" for i, s in enumerate(seeds.tolist())]
    return to_rollout(tok, eps, labels, reply_reward=replies), self_play_metrics(eps)

  evaluation = env.evaluation_env
  eval_template = multiturn.turn_template(tok, config.get("system_prompt") or None,
                                          getattr(evaluation, "preamble", ()))
  return collect, _evaluator(config, model, evaluation, eval_template,
                             env.evaluation_turns), NoData()


def self_play_metrics(eps: multiturn.Episodes) -> dict[str, float]:
  """`episode_metrics`, each info entry per player too (`player<p>/<name>`, over the rows
  of that side), and `game_plies`, the moves of both sides per game."""
  out = episode_metrics(eps)
  player = np.arange(eps.turns.shape[0]) % self_play.PLAYERS
  for name, values in eps.info.items():
    for p in range(self_play.PLAYERS):
      out[f"player{p}/{name}"] = float(np.mean(distributed.to_host(values)[player == p]))
  plies = distributed.to_host(eps.turns).reshape(-1, self_play.PLAYERS).sum(1)
  out["game_plies"] = float(plies.mean())
  return out


@dataclasses.dataclass(frozen=True)
class Credit:
  """What the trainer's credit assignment asks of the episodes (the trainer reads its own
  keys, e.g. GRPO's turn_credit or PPO's gae_level, into this).

  Attributes:
    name: the credit as the trainer's config names it, for errors ("turn_credit 'gigpo'").
    state_keys: every turn's environment-state key (GiGPO's step groups): the
      environment must have `state_key`.
    information_gain: the gold answer scored before every turn and after the last
      (IGPO's turn rewards): the environment must have `answer`.
    shaping_gamma: potential-based shaping of the turn rewards with this discount per turn
      (the credit's own); None: off. The environment must have `potential`.
    self_play: the trainer's advantage is self-play's (a two-player game must have it).
  """

  name: str = "episode credit"
  state_keys: bool = False
  information_gain: bool = False
  shaping_gamma: float | None = None
  self_play: bool = False


def _check_credit(credit_: Credit, env, env_name: str) -> None:
  """Refuses credit the environment cannot serve."""
  if credit_.state_keys and not hasattr(env, "state_key"):
    raise ValueError(f"{credit_.name} groups turns by environment state; {env_name!r} "
                     "has no state_key")
  if credit_.information_gain and not hasattr(env, "answer"):
    raise ValueError(f"{credit_.name} scores the gold answer after every turn; "
                     f"{env_name!r} has no answer(task)")
  if credit_.shaping_gamma is not None and not hasattr(env, "potential"):
    raise ValueError(f"potential_shaping needs the environment's potential; {env_name!r} "
                     "has none")


def _make_host(config, model: zoo.Model, env, igpo: bool, replies=None):
  """(collect, evaluate, data) for a host environment (`rollout.host_loop`)."""
  tok = model.tokenizer
  sampling = single_turn.sampling_from_config(config, tok)
  greedy = single_turn.sampling_from_config(config, tok, greedy=True)
  system = config.get("system_prompt") or None
  options = dict(num_turns=config.max_turns, obs_tokens=config.get("env_obs_tokens", 64),
                 step_timeout_s=config.get("env_step_timeout_s", 10.0), system=system,
                 answer_tokens=config.get("env_answer_tokens", 32))

  def play(params, tasks, rng, how, group_size, training=False):
    out = host_loop.rollout(params, model.cfg, tok, env, tasks, rng, how,
                            group_size=group_size, score_answers=igpo and training, **options)
    labels = [str(t) for t in tasks for _ in range(group_size)]
    return to_rollout(tok, out.episodes, labels, group_size, out.failed, out.unmasked,
                      out.failures, information_gain=igpo and training,
                      reply_reward=replies if training else None), out

  def collect(params, examples, rng):
    del examples
    task_rng, play_rng = jax.random.split(rng)
    host_rng = np.random.default_rng(np.asarray(jax.random.key_data(task_rng)).tolist())
    tasks = [env.sample_task(host_rng) for _ in range(config.prompts_per_step)]
    r, out = play(params, tasks, play_rng, sampling, config.group_size, training=True)
    return r, {**episode_metrics(out.episodes), **out.counters}

  eval_rng = np.random.default_rng(EVAL_TASKS_KEY)
  eval_tasks = [env.sample_task(eval_rng) for _ in range(config.eval_size)]

  def evaluate(params):
    records, samples = [], []
    for start in range(0, config.eval_size, config.eval_batch_size):
      tasks = eval_tasks[start:start + config.eval_batch_size]
      r, out = play(params, tasks, jax.random.key(0), greedy, 1)
      records.append((len(tasks), {**_eval_record(r, out.episodes), **out.counters}))
      samples += records_lib.rollout_samples(r)
    return _weighted(records), samples

  return collect, evaluate, NoData()
