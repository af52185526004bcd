r"""Best-of-8 and voting on the 100 held-out arithmetic questions, with any reward.

  python -m experiments.best_of_n --config=experiments/configs/best_of_n_arithmetic.py \
      --workdir=runs/bon_arithmetic

By default the reward is the strict grader itself (best-of-8 is then pass@8);
`:reward_model` chooses with a trained reward model instead
(--config.rewards.reward_model.workdir=RUN). `policy_workdir` evaluates a
trained policy instead of the model as loaded.

Variants: reward_model (above); tiny (the tiny random model, seconds).
"""

import ml_collections

from experiments.configs import trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Modules of one's own to import before any name is checked, so the rewards, environments,
  # losses or models they register can be named here (docs/extending.md).
  c.imports = ()
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"
  c.policy_workdir = ""
  trainer_common.add_task(c)
  c.eval_size = 100
  c.rewards = ml_collections.ConfigDict({"math_strict": 1.0})
  c.reward_time_limit_s = 10.0
  c.generation = ml_collections.ConfigDict(dict(
      group_size=8, temperature=0.5, max_new_tokens=24, batch_prompts=16))
  c.vote_temperature = 1.0
  if variant == "reward_model":
    c.rewards = ml_collections.ConfigDict(
        {"reward_model": {"weight": 1.0, "workdir": "runs/rm_arithmetic", "step": 0}})
  elif variant == "tiny":
    c.model = "tiny"
    c.task = "arithmetic/add1"
    c.eval_size = 8
    # The random model never answers right: grade (and choose) on length instead.
    c.grader = "short_reply"
    c.grader_kwargs = ml_collections.ConfigDict(dict(max_chars=6))
    c.rewards = ml_collections.ConfigDict({"short_reply": {"weight": 1.0, "max_chars": 6}})
    c.generation.update(dict(group_size=4, temperature=1.0, max_new_tokens=8, batch_prompts=8))
  elif variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'reward_model', 'tiny' or none")
  return c
