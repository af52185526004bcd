r"""GRPO on a mix of reasoning-gym tasks, rewarded and graded by reasoning-gym's own scorers.

  python -m experiments.grpo --config=experiments/configs/grpo_reasoning_gym.py \
      --workdir=runs/grpo_reasoning_gym

Task: `reasoning_gym/<tasks>` (data/suites.py): the generators of the tasks in MIX, drawn
by weight, train and test split by seed with no test question in training. The prompt asks
for the answer inside <answer></answer> tags; the reward is the task's own `score_answer`
on the last tag (partial credit as the task gives it), the held-out accuracy counts full
credit (`reasoning_gym_solved`). Needs `pip install 'jaxrl_agents[tasks]'`.

The mix: the tasks whose greedy held-out accuracy with the embedded model lies between
about 0.1 and 0.5 (docs/evaluation.md, "Choosing the mix"). Other tasks:
`--config.task=reasoning_gym/gcd,lcm` (options in `--config.task_options.*`).

Variants: `:tiny` (the tiny random model, 3 steps: every artifact).
"""

import ml_collections

from experiments.configs import grpo_arithmetic

# Chosen by measurement (benchmarks/task_difficulty.py, docs/evaluation.md): greedy
# held-out accuracy of the embedded model, lenient reading, 24-48 questions a task:
# gcd (values to 100) 0.29-0.42, calendar_arithmetic 0.12-0.38, syllogism 0.17-0.25,
# products (two 1-2 digit factors) 0-0.12 with this prompt (0.25-0.50 with others, on 8
# questions); chain_sum, leg_counting, letter_counting, spell_backward and most others
# 0-0.04 even at easy levels.
MIX = "reasoning_gym/products,basic_arithmetic,syllogism"
LEVELS = {"products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
          "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                               "operators": ["+", "-", "*"], "allow_parentheses": False,
                               "allow_negation": False}}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_arithmetic.get_config("tiny" if variant == "tiny" else None)
  if variant not in (None, "tiny"):
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  c.task = MIX
  # reasoning-gym's split sizes and seeds (data/suites.py): the test split first, the
  # training split drawn with another seed, the test questions left out of it.
  c.task_options = ml_collections.ConfigDict(dict(
      train_size=5000, train_seed=0, test_size=200, test_seed=1_000_003, configs=LEVELS))
  c.prompt_template = "{question}\nAnswer with just the answer."
  # The embedded model does not write the tags (0 of 672 replies): the reward and the
  # accuracy read the tag, else what the last line states ("The answer is 6.", "... = 6"),
  # scored by the task's own score_answer; the strict (tag-only) figure comes from
  # `tools.evaluate` on the run.
  c.rewards = ml_collections.ConfigDict({"reasoning_gym_lenient": 1.0, "short_reply": 0.2})
  c.grader = "reasoning_gym_solved_lenient"
  c.eval_size = 200
  # Replies of up to 32 tokens: the answers this prompt asks for take 2-20; with 64, a
  # fifth to a third of the replies ran to the limit unanswered and steps took twice as
  # long (docs/evaluation.md#learning).
  c.max_new_tokens = 32
  # The mix's prompts are 44-79 tokens: every batch padded to 80 columns compiles the
  # sampler and the update for one prompt width, not three.
  c.min_prompt_width = 80
  # 30 minutes of training (rollouts and updates), held-out evaluations every 10 minutes
  # and at the end; the learning rate's cosine decay runs over the 30 minutes.
  c.time_budget_s = 1800.0
  c.steps = 1000
  c.eval_every, c.eval_every_s = 0, 600.0
  c.optimizer.clock = "train_time"
  if variant == "tiny":
    c.task_options.update(train_size=64, test_size=8)
    c.time_budget_s, c.steps, c.eval_every, c.eval_every_s = 0.0, 3, 2, 0.0
    c.optimizer.clock = "updates"
    c.eval_size = 8
    c.max_new_tokens = 16
    # the tiny random model never answers: the short-reply reward gives its groups variance
    c.rewards = ml_collections.ConfigDict(
        {"reasoning_gym_lenient": 1.0, "short_reply": {"weight": 0.2, "max_chars": 12}})
  return c
