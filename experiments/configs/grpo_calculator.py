r"""GRPO with a calculator tool: multiply 3-digit numbers, calling the tool when it helps.

A host environment (jaxrl_agents/envs/calculator.py) stepped by the host loop
(rollout/host_loop.py): each turn the agent either calls the calculator with
<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>
and reads the value in the next user message, or answers. Reward 1 for the
right product. Metrics add tool_call and tool_error (per episode), and the
loop's env_errors, env_timeouts and obs_truncated.

  python -m experiments.grpo --config=experiments/configs/grpo_calculator.py \
      --workdir=runs/grpo_calculator

Variants: `:tiny` (the tiny random model, 2-digit factors, 2 turns: a smoke test).
"""

import ml_collections

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = grpo_arithmetic.get_config(variant)
  c.env = "calculator"
  c.env_kwargs = ml_collections.ConfigDict(dict(digits=3))
  c.max_turns = 3
  c.env_step_timeout_s = 10.0  # a step slower than this ends its episode (counted)
  c.env_obs_tokens = 64  # a longer tool answer is cut (counted as obs_truncated)
  c.task = ""
  c.max_new_tokens = 48  # per turn
  c.prompts_per_step = 4
  c.group_size = 8
  c.eval_size = 64
  c.eval_batch_size = 32
  c.temperature = 1.0
  if variant == "tiny":
    c.env_kwargs = ml_collections.ConfigDict(dict(digits=2))
    c.max_turns = 2
    c.max_new_tokens = 8
    c.prompts_per_step = 2
    c.eval_size = 4
    c.eval_batch_size = 4
  return c
