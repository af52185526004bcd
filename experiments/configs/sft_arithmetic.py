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

from experiments.configs import grpo_arithmetic


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  c.jsonl_path = ""  # {"prompt", "completion"} rows; empty: the task's questions and answers
  c.eval_jsonl_path = ""  # held-out rows for the held-out NLL
  c.task = "arithmetic/mixed"
  c.eval_split = "test"
  c.eval_size = 100
  c.prompt_template = "{question} Answer with just the number."
  c.completion_template = "{answer}"
  c.system_prompt = ""
  c.chat = True
  # Held-out accuracy: greedy replies graded like the GRPO main job's.
  c.rewards = ml_collections.ConfigDict({"math_strict": 1.0})
  c.grader = "math_strict"
  c.reward_time_limit_s = 10.0
  c.max_new_tokens = 32
  c.eval_batch_size = 32

  c.max_len = 128
  c.aggregation = "token-mean"
  c.steps = 100
  c.batch_size = 16
  c.minibatches = 1
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=1e-5, warmup_updates=10, decay="cosine", end_fraction=0.1, clock="updates",
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
  c.max_consecutive_nonfinite = 5
  c.time_budget_s = 0.0
  c.eval_every_s = 0.0

  c.eval_every = 50
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  c.sample_every = 25
  c.samples_per_log = 8
  c.tensorboard = True
  c.start_over = False

  if variant == "tiny":
    c.model = "tiny"
    c.max_new_tokens = 16
    c.eval_size = 8
    c.eval_batch_size = 8
    c.max_len = 96
    c.steps = 4
    c.batch_size = 4
    c.optimizer.update(dict(learning_rate=1e-3, warmup_updates=0, decay="constant"))
    c.eval_every = 2
    c.checkpoint_every = 1
    c.sample_every = 1
    return grpo_arithmetic.tiny_reward(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c
