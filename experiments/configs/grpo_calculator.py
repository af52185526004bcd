r"""GRPO with a calculator tool: multiply 3-digit numbers, calling the tool when it helps.

A host environment (jaxrl_agents/envs/calculator.py) stepped by the host loop
(rollout/host_loop.py): each turn the agent either calls the calculator with
<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>
and reads the value in the next user message, or answers. Reward 1 for the
right product. Metrics add tool_call and tool_error (per episode), and the
loop's env_errors, env_timeouts and obs_truncated.

  python -m experiments.grpo --config=experiments/configs/grpo_calculator.py \
      --workdir=runs/grpo_calculator

One worked episode (the question, the call, the value, the answer) comes before
each question as earlier chat turns (`demonstrations`): without it SmolLM2-135M
never writes a tool call; with it, a few sampled replies in a hundred do, and
none of its greedy ones.

Variants: `:tiny` (the tiny random model, 2-digit factors, 2 turns: a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  return env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="calculator",
      options=dict(digits=3, example=True, demonstrations=1),
      tiny_options=dict(digits=2, example=True, demonstrations=1), max_turns=3, tiny_max_turns=2,
      max_new_tokens=48, tiny_max_new_tokens=8)
