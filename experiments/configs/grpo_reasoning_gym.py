r"""GRPO on a mix of reasoning-gym tasks, rewarded and graded by reasoning-gym's own scorers.

  python -m experiments.grpo --config=experiments/configs/grpo_reasoning_gym.py \
      --workdir=runs/grpo_reasoning_gym

Task: `reasoning_gym/<tasks>` (data/suites.py): the generators of the tasks in MIX, drawn
by weight, train and test split by seed with no test question in training. The prompt asks
for just the answer; the reward is the task's own `score_answer` on what the reply states
(partial credit as the task gives it) plus 0.2 for a short reply, the held-out accuracy
counts full credit (`reasoning_gym_solved_lenient`). Needs
`pip install 'jaxrl_agents[tasks]'`.

The mix: the tasks whose greedy held-out accuracy with the embedded model lies between
about 0.1 and 0.5 with this prompt (docs/evaluation.md, "Choosing the mix"). Other tasks:
`--config.task=reasoning_gym/gcd,lcm` (options in `--config.task_options.*`). Evaluate a
run with `tools.evaluate --workdir ... --format reasoning_gym_plain` (the strict reading
too: the whole reply is the answer).

Variants: `:tiny` (the tiny random model, 3 steps: every artifact).
"""

import ml_collections

from experiments.configs import grpo_arithmetic

# Chosen by measurement (benchmarks/task_difficulty.py --easy --template ..., docs/evaluation.md):
# greedy held-out accuracy of the embedded model with this prompt, lenient reading, 32
# questions a task: products (two 1-2 digit factors) 0.44, basic_arithmetic (two 1-2 digit
# terms) 0.28, syllogism 0.16; aiw, calendar_arithmetic, chain_sum 0.03, gcd, lcm,
# leg_counting, letter_counting, spell_backward and the others 0.
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
  # The reward and the accuracy read a tag if there is one, else what the last line states
  # ("12", "The answer is 12.", "3 * 4 = 12"), scored by the task's own score_answer; the
  # short-reply bonus moves the policy from explanations to answers (with the reward
  # alone, no gain in 10 minutes: docs/evaluation.md#learning).
  c.rewards = ml_collections.ConfigDict({"reasoning_gym_lenient": 1.0, "short_reply": 0.2})
  c.grader = "reasoning_gym_solved_lenient"
  c.eval_size = 200
  # Replies of up to 32 tokens: the answers this prompt asks for take 2-20; with 64, a
  # fifth to a third of the replies ran to the limit unanswered and steps took twice as
  # long (docs/evaluation.md#learning).
  c.max_new_tokens = 32
  # 8 prompts x 8 replies a step: with 4 prompts the gain spread from +12 to +31 points over
  # three seeds; 8 give each update twice the groups (docs/evaluation.md#learning).
  if variant != "tiny":
    c.prompts_per_step = 8
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
