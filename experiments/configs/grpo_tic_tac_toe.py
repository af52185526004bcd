r"""GRPO on tic-tac-toe (pgx) against a fixed opponent, the board as text.

Each turn the agent sees the board (free squares numbered 1-9) and answers
with a square; the opponent (a random legal move, seeded by the task) answers
at once (jaxrl_agents/envs/tic_tac_toe.py). Reward 1 for a win, -1 for a loss,
0 for a draw. Every step draws `prompts_per_step` games (who moves first and
the opponent's seed) and plays `group_size` episodes of each; GiGPO compares
the moves made from the same board.

  python -m experiments.grpo --config=experiments/configs/grpo_tic_tac_toe.py \
      --workdir=runs/grpo_tic_tac_toe

A game takes at most 5 of the agent's moves; the 7 turns allow two invalid
replies. The always-the-first-free-square opponent: --config.env_kwargs.opponent=first.

Variants: `:tiny` (the tiny random model, 3 turns of 2 tokens: a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="tic_tac_toe",
      options=dict(opponent="random"), tiny_options=dict(opponent="random"), max_turns=7,
      tiny_max_turns=3, max_new_tokens=8, tiny_max_new_tokens=2)
  c.turn_credit.name, c.turn_credit.gamma = "gigpo", 0.95
  return c
