r"""GRPO self-play on tic-tac-toe: the policy plays both sides, role-conditioned advantages.

Each game is two conversations, one per side (rollout/self_play.py): a side
sees the board from its own side and the opponent's last move, and answers
with a square; a reply naming no free square forfeits the game (-1 for that
side, 0 for the other). The outcome is +1 / -1 / 0 per side. The advantage is
SPIRAL's role-conditioned one ("rae"): each side's return less an exponential
moving average of that side's returns, carried in the train state, so X's
first-mover edge is not credited to X's moves.

  python -m experiments.grpo --config=experiments/configs/grpo_tic_tac_toe_self_play.py \
      --workdir=runs/grpo_tic_tac_toe_self_play

Every step plays 2 x 8 games (prompts_per_step x group_size; 32 rows, both
sides); a game takes at most 9 plies. The held-out evaluation plays the fixed random
opponent of `grpo_tic_tac_toe` greedily (64 games, half as X, half as O): its
success is the win rate against a player outside the policy.

Variants: `:tiny` (the tiny random model, 4 plies of 2 tokens: a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="tic_tac_toe_self_play", options={},
      tiny_options={}, max_turns=9, tiny_max_turns=4, max_new_tokens=8, tiny_max_new_tokens=2)
  c.prompts_per_step = 2  # tasks are only seeds: all games start from the empty board
  c.share_prompt = False  # the prompt is the template's opening only: nothing to share
  # Every row holds all 9 plies' columns (about 825 on SmolLM2), half of them the other
  # side's padding: with 8 rows a minibatch the update asked for 28 GB; 4 rows halve it.
  if variant != "tiny":
    c.minibatches = 8
  c.advantage = "rae"
  c.advantage_kwargs = ml_collections.ConfigDict(dict(decay=0.95))
  return c
