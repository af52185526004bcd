"""Config keys the preference trainers share: where their pairs come from.

`add_pair_data(c)` sets them; see `experiments/preference_data.py`.
"""

import ml_collections


def add_pair_data(c: ml_collections.ConfigDict) -> None:
  # Pairs from your own JSONL ({"prompt", "chosen", "rejected"} per line); when
  # pairs_jsonl is empty they are generated from `task` (below).
  c.pairs_jsonl = ""
  c.eval_pairs_jsonl = ""  # held-out pairs (else the first eval_size training pairs)
  c.eval_size = 1000  # held-out pairs scored per evaluation (at most)
  # Generated pairs: the model samples `group_size` replies per question, the
  # grader splits them into accepted and rejected. They are written to
  # `pairs_dir` (default <workdir>/pairs) and reused while the settings match.
  c.task = "arithmetic/mixed"
  c.eval_split = "test"
  c.prompt_template = "{question} Answer with just the number."
  c.system_prompt = ""
  c.chat = True
  c.grader = "math_strict"  # a registered reward: 1 accepts a reply
  c.grader_kwargs = ml_collections.ConfigDict()
  c.pairs_dir = ""
  c.generation = ml_collections.ConfigDict(dict(
      train_prompts=1000,  # training questions (the first of the train split)
      eval_prompts=100,    # held-out questions (the first of eval_split)
      group_size=8, temperature=0.5, max_new_tokens=24, max_pairs_per_prompt=4,
      batch_prompts=16))
  c.score_batch_size = 32  # sequences per forward pass when scoring held-out data


def tiny_pair_data(c: ml_collections.ConfigDict) -> None:
  """The tiny random model never answers right, so its replies are graded on length (under 6
  characters), which varies within most groups."""
  c.model = "tiny"
  c.task = "arithmetic/add1"
  c.grader = "short_reply"
  c.grader_kwargs = ml_collections.ConfigDict(dict(max_chars=6))
  c.generation.update(dict(train_prompts=16, eval_prompts=8, group_size=4, temperature=1.0,
                           max_new_tokens=8, max_pairs_per_prompt=2, batch_prompts=8))
  c.eval_size = 16
  c.score_batch_size = 8
