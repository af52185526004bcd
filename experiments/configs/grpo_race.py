r"""GRPO for the learning race against TRL's GRPOTrainer (benchmarks/learning_race.py).

The race's task and rewards, shared with the TRL side: arithmetic/mixed
(one- and two-digit addition and subtraction, multiplication tables) asked as
plain questions through the chat template; reward 1 when the last integer of
the reply is the answer plus 0.2 for a reply under 40 characters; groups of 8,
at most 48 new tokens; held-out accuracy is the last-integer grader on greedy
replies. Training stops after `time_budget_s` of training time (rollouts and
updates; evaluation excluded) and evaluates every `eval_every_s`.

  python -m experiments.grpo --config=experiments/configs/grpo_race.py --workdir=DIR \
      [--config.time_budget_s=1800]

The hyperparameters below differ from TRL's race settings (2 prompts x 8,
learning rate 5e-6, temperature 1.0, DAPO token-mean loss): they start from
the main job's measured settings (experiments/configs/grpo_arithmetic.py: 4
prompts x 8, learning rate 2e-5, temperature 0.8, clip 0.2/0.28, token-mean).
No sweep has been run yet. Measured in one 30-minute race on a 2-core CPU
(README, "Learning race"): held-out accuracy 0.26 -> 0.52 (5 min) -> 0.66 (10)
-> 0.71 (15) -> 0.64 (30), against TRL's 0.26 -> 0.71 at 30 minutes; entropy
collapses to ~0.04 nats per token after 15 minutes.
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_arithmetic.get_config(variant)
  c.task = "arithmetic/mixed"
  c.prompt_template = "{question}"
  c.rewards = ml_collections.ConfigDict({"last_integer": 1.0, "short_reply": 0.2})
  c.grader = "last_integer"
  c.group_size = 8
  c.oversample = 2  # sample 8 prompts, train on the 4 groups whose rewards vary
  c.max_new_tokens = 48
  c.eval_size = 200  # the whole test split (100 questions)
  c.steps = 100_000  # the time budget ends the run
  c.time_budget_s = 1800.0
  c.eval_every_s = 300.0
  c.eval_every = 0
  c.checkpoint_every = 10
  # Cosine decay over the time budget, whatever the machine's step rate.
  c.optimizer.decay = "cosine"
  c.optimizer.clock = "train_time"
  c.optimizer.end_fraction = 0.0
  if variant == "tiny":
    c.group_size = 4
    c.max_new_tokens = 16
    c.eval_size = 8
    c.time_budget_s = 20.0
    c.eval_every_s = 10.0
  return c
