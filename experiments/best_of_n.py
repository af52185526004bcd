r"""Best-of-N and voting at evaluation time, with any reward (verifiable or learned).

  python -m experiments.best_of_n --config=experiments/configs/best_of_n_arithmetic.py \
      --workdir=runs/bon_arithmetic [--config.policy_workdir=runs/grpo_arithmetic]

The policy (the model as loaded, or the newest checkpoint of a training run in
`policy_workdir`) answers each held-out question greedily and
`generation.group_size` times at `generation.temperature`; `config.rewards`
(any registered rewards, a trained reward model among them:
`{"reward_model": {"workdir": RUN}}`) scores the sampled replies, and the
grader decides which are right. Written to the workdir:

  best_of_n.json   accuracy of the best-of-N pick, the reward-weighted and the plain
                   majority vote, a random reply, the greedy reply and pass@N
  samples.jsonl    each question's replies, verdicts, rewards and picks

This is an evaluation, not a training run: it has no checkpoints, and running it
again overwrites its two files.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from experiments import common, preference_data
from jaxrl_agents import data as data_lib
from jaxrl_agents import registry
from jaxrl_agents.rewards import best_of_n
from jaxrl_agents.train import checkpointing


def validate(config) -> None:
  registry.import_modules(config.get("imports", ()))  # user modules register names first
  common.make_rewards(config)  # names, options, a learned reward's workdir
  preference_data.grader(config)
  g = config.generation
  if g.group_size < 1 or g.batch_prompts < 1 or g.max_new_tokens < 1:
    raise ValueError("generation.group_size, batch_prompts and max_new_tokens must be >= 1")
  if not g.temperature > 0:
    raise ValueError(f"generation.temperature must be > 0 to sample, got {g.temperature}")
  if config.vote_temperature <= 0:
    raise ValueError(f"vote_temperature must be > 0, got {config.vote_temperature}")


def evaluate(config, workdir: str, progress: bool = True) -> dict:
  """Runs the evaluation; returns (and writes) the figures."""
  validate(config)
  model = common.load_model(config)
  params = model.params
  if config.policy_workdir:
    params, _, step = checkpointing.latest_policy_params(config.policy_workdir)
    params = jax.tree.map(jax.numpy.asarray, params)
  source = data_lib.load_task(config.task, config.eval_split)
  examples = [source[i] for i in range(min(config.eval_size, len(source)))]
  g = config.generation
  prompts, replies, ok = preference_data.sample_replies(
      model, examples, config=config, temperature=g.temperature, group_size=g.group_size,
      seed=config.seed, desc="replies", progress=progress, params=params)
  _, greedy, greedy_ok = preference_data.sample_replies(
      model, examples, config=config, temperature=0.0, group_size=1, seed=0,
      desc="greedy replies", progress=progress, params=params)
  reward_fn, _ = common.make_rewards(config)
  total, _ = reward_fn(replies, [ex for ex in examples for _ in range(g.group_size)])
  n = g.group_size
  rewards = np.asarray(total, np.float32).reshape(-1, n)
  read = preference_data.ANSWER_READERS.get(config.grader)
  answers = None if read is None else [[read(r) for r in replies[i * n:(i + 1) * n]]
                                       for i in range(len(examples))]
  result = best_of_n.selection_accuracy(rewards, ok.reshape(-1, n), greedy_correct=greedy_ok,
                                        answers=answers,
                                        vote_temperature=config.vote_temperature)
  result.update(policy=config.policy_workdir or config.model, rewards=config.rewards.to_dict())
  if config.policy_workdir:
    result["policy_step"] = step
  os.makedirs(workdir, exist_ok=True)
  picks = best_of_n.best_of_n(rewards)
  with open(os.path.join(workdir, "samples.jsonl"), "w") as f:
    for i, ex in enumerate(examples):
      f.write(json.dumps({"prompt": prompts[i * n], "answer": str(ex.get("answer")),
                          "replies": replies[i * n:(i + 1) * n],
                          "correct": ok[i * n:(i + 1) * n].tolist(),
                          "rewards": rewards[i].tolist(), "best_of_n": int(picks[i]),
                          "greedy": greedy[i], "greedy_correct": float(greedy_ok[i])}) + "\n")
  with open(os.path.join(workdir, "best_of_n.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  def _main(config, workdir):
    print(json.dumps(evaluate(config, workdir), indent=2))
  common.main(_main)
