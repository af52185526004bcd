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

The hyperparameters start from the main job's (learning rate 2e-5, temperature 0.8,
clip 0.2/0.28, token-mean, one update per rollout) and were changed by measurement:
8 prompts sampled, the 4 groups that vary trained (oversampling), the cosine decay over
the first half of the budget to a tenth of the peak. Expected (2-core CPU, 30 training
minutes a side): held-out 0.26 -> 0.76-0.81 against TRL's 0.64-0.78, speedup to TRL's
final 1.3-3.0 by machine and race. Every race and screen behind these choices:
docs/learning_race.md#how-the-race-config-was-chosen.
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_arithmetic.base_config(variant)
  c.task = "arithmetic/mixed"
  c.prompt_template = "{question}"
  c.rewards = ml_collections.ConfigDict({"last_integer": 1.0, "short_reply": 0.2})
  c.grader = "last_integer"
  c.group_size = 8
  c.oversample = 2  # sample 8 prompts, train on the 4 groups whose rewards vary
  c.max_new_tokens = 48
  c.eval_size = 100  # the whole test split
  c.steps = 100_000  # the time budget ends the run
  c.time_budget_s = 1800.0
  c.eval_every_s = 300.0
  c.eval_every = 0
  c.checkpoint_every = 10
  # Compile the packed update for the next two slot counts below each batch's in the
  # background: the same updates, less of the budget stopped for compiles (above).
  c.pack_compile_ahead = 2
  # Decode on with the unfinished rows alone, halving the batch down to 8 rows: the
  # trained policy's rollouts 1.56x faster on a 2-core Zen 3 (benchmarks/
  # decode_compaction.py), the same replies up to rounding.
  c.compact_min_rows = 8
  # Cosine decay over the first half of the time budget, whatever the machine's step
  # rate, then a tenth of the peak rate (over the whole budget to 0 until 2026-11-28).
  c.optimizer.decay = "cosine"
  c.optimizer.clock = "train_time"
  c.optimizer.decay_over = 0.5
  c.optimizer.end_fraction = 0.1
  if variant == "tiny":
    c.group_size = 4
    c.max_new_tokens = 16
    c.eval_size = 8
    c.time_budget_s = 20.0
    c.eval_every_s = 10.0
    grpo_arithmetic.tiny_reward(c)
  return c
