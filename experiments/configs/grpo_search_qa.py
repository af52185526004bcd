r"""GRPO on multi-hop questions with a BM25 search tool over invented documents.

A host environment (jaxrl_agents/envs/search_qa.py) stepped by the host loop:
each turn the agent searches with <search>words</search> and reads the best
matching documents in the next user message, or answers with
<answer>...</answer>. The companies, people and cities are invented, so an
answer needs the documents; a question needs two or three of them in turn.
Reward 1 for the right answer (normalized exact match); metrics add search,
empty_search, invalid and answer_f1 per episode.

  python -m experiments.grpo --config=experiments/configs/grpo_search_qa.py \
      --workdir=runs/grpo_search_qa

Variants: `:tiny` (the tiny random model, 2 knowledge bases, 2 turns of 8 tokens: a
smoke test).
"""

import ml_collections

from experiments.configs import env_common, grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = env_common.set_env(
      grpo_arithmetic.base_config(variant), variant, env="search_qa",
      options=dict(knowledge_bases=8), tiny_options=dict(knowledge_bases=2), max_turns=4,
      tiny_max_turns=2, max_new_tokens=32, tiny_max_new_tokens=8)
  c.env_obs_tokens = 96  # two documents
  return c
