r"""GRPO on guess-the-number, a multi-turn game played inside `lax.scan`.

The environment names a range; each turn the agent guesses and is told
"Higher." or "Lower." (jaxrl_agents/envs/guess_number.py). Reward 1 on the turn
the guess is right; the episode ends then or after `max_turns` turns. Every
step draws `prompts_per_step` secret numbers and plays `group_size` episodes of
each (rollout/multiturn.py); GRPO compares the episodes of one number.

  python -m experiments.grpo --config=experiments/configs/grpo_guess_number.py \
      --workdir=runs/grpo_guess_number

Variants: `:tiny` (the tiny random model, numbers 1-4, 3 turns of 2 tokens:
a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # Bisection needs ceil(log2(high - low + 2)) turns: 5 for 1-16, 3 for 1-4.
  return env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="guess_number",
      options=dict(low=1, high=16), tiny_options=dict(low=1, high=4), max_turns=5,
      tiny_max_turns=3, max_new_tokens=8, tiny_max_new_tokens=2)
