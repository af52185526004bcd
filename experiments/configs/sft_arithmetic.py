r"""Supervised fine-tuning of the embedded SmolLM2-135M on arithmetic answers.

  python -m experiments.sft --config=experiments/configs/sft_arithmetic.py \
      --workdir=runs/sft_arithmetic

Rows: your JSONL (`jsonl_path`, {"prompt", "completion"} per line), or the
`arithmetic/mixed` training questions with their answers as replies
(`completion_template`). Evaluation: greedy accuracy on the 100 held-out
questions (and the held-out NLL of `eval_jsonl_path`, when given).

Variants (`--config=...sft_arithmetic.py:VARIANT`):
  tiny   the tiny random model, a few small steps, every artifact (seconds).
"""

import ml_collections

from experiments.configs import grpo_arithmetic, trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  c.jsonl_path = ""  # {"prompt", "completion"} rows; empty: the task's questions and answers
  c.eval_jsonl_path = ""  # held-out rows for the held-out NLL
  # Held-out accuracy: greedy replies graded like the GRPO main job's.
  trainer_common.add_task(c, grader_kwargs=False)
  c.eval_size = 100
  c.completion_template = "{answer}"
  c.rewards = ml_collections.ConfigDict({"math_strict": 1.0})
  c.reward_time_limit_s = 10.0
  c.max_new_tokens = 32
  c.eval_batch_size = 32

  c.max_len = 128
  c.aggregation = "token-mean"
  c.batch_size = 16
  trainer_common.add_schedule(c, steps=100, learning_rate=1e-5, eval_every=50)

  if variant == "tiny":
    c.model = "tiny"
    c.max_new_tokens = 16
    c.eval_size = 8
    c.eval_batch_size = 8
    c.max_len = 96
    c.batch_size = 4
    trainer_common.tiny_schedule(c)
    return grpo_arithmetic.tiny_reward(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c
