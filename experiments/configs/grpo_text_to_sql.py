r"""GRPO on text-to-SQL: answer questions about a generated sqlite database with one query.

A host environment (jaxrl_agents/envs/text_to_sql.py) stepped by the host loop
(rollout/host_loop.py): each turn the agent runs a query with
<sql>SELECT ...</sql> and reads its first rows in the next user message, or
answers with <answer>SELECT ...</answer>. Reward 1 when the answer's result
equals the gold query's (env_kwargs.reward="partial": the F1 of their rows).
Only single read-only SELECTs run (sqlglot checks them; the database is opened
read-only with an authorizer and a time limit). Metrics add sql_call,
sql_error, refused, invalid and partial_match per episode.

  python -m experiments.grpo --config=experiments/configs/grpo_text_to_sql.py \
      --workdir=runs/grpo_text_to_sql

Variants: `:tiny` (the tiny random model, 2 databases, 2 turns of 8 tokens: a smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="text_to_sql",
      options=dict(databases=8, reward="execution"),
      tiny_options=dict(databases=2, reward="execution"), max_turns=4, tiny_max_turns=2,
      max_new_tokens=64, tiny_max_new_tokens=8)
  c.env_obs_tokens = 160  # ten rows of names and a header
  return c
