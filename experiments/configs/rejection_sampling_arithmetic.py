r"""Rejection-sampling self-improvement (RAFT / ReST) on arithmetic, on the embedded SmolLM2-135M.

  python -m experiments.rejection_sampling \
      --config=experiments/configs/rejection_sampling_arithmetic.py \
      --workdir=runs/rs_arithmetic

Each round: 64 training questions, 8 replies each at temperature 0.8, the best
reply of each question kept when the strict grader accepts it, then 8
fine-tuning steps of 8 kept replies. Evaluation after every round: greedy
accuracy on the 100 held-out questions (as in the GRPO main job).

Variants (`--config=...rejection_sampling_arithmetic.py:VARIANT`):
  tiny   the tiny random model, two short rounds, every artifact (seconds).
"""

import ml_collections

from experiments.configs import grpo_arithmetic, trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  trainer_common.add_task(c, grader_kwargs=False)
  c.jsonl_path = ""  # your prompts: {"prompt": ..., "answer": ...} per line
  c.eval_jsonl_path = ""
  c.eval_size = 100
  # What ranks the replies: verifiable rewards, or a trained reward model
  # ({"reward_model": {"workdir": RUN}}); the grader gives the accuracy.
  c.rewards = ml_collections.ConfigDict({"math_strict": 1.0})
  c.reward_combinator = ml_collections.ConfigDict(dict(name="sum", min_gap=1.0, threshold=1.0))
  c.reward_time_limit_s = 10.0

  # Rounds: steps / steps_per_round of them.
  c.prompts_per_round = 64
  c.samples_per_prompt = 8
  c.keep_top = 1  # RAFT: the k best replies of each question...
  c.min_reward = 1.0  # ...whose reward reaches this (ReST's threshold)
  # A reply cut at max_new_tokens never ended; kept, it would teach stopping mid-reply.
  c.keep_unfinished = False
  c.max_new_tokens = 32
  c.temperature = 0.8
  c.top_p = 1.0
  c.top_k = 0
  c.steps_per_round = 8

  c.max_len = 128
  c.aggregation = "token-mean"
  c.batch_size = 8
  trainer_common.add_schedule(c, steps=40, learning_rate=1e-5, warmup_updates=0,
                              decay="constant", eval_every=8)  # evaluated every round
  c.sample_every = 1  # only a round's first step has samples: its kept replies
  c.eval_batch_size = 32

  if variant == "tiny":
    c.model = "tiny"
    c.prompts_per_round = 4
    c.samples_per_prompt = 4
    c.min_reward = 0.0
    c.keep_unfinished = True  # the random model rarely samples its stop token
    c.max_new_tokens = 16
    c.steps_per_round = 2
    c.batch_size = 4
    c.max_len = 96
    c.eval_size = 8
    c.eval_batch_size = 8
    trainer_common.tiny_schedule(c)
    return grpo_arithmetic.tiny_reward(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c
