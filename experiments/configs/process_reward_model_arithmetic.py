r"""A process reward model for step-by-step arithmetic, on the embedded SmolLM2-135M.

  python -m experiments.process_reward_model \
      --config=experiments/configs/process_reward_model_arithmetic.py --workdir=runs/prm

Rows: the embedded model answers each question `group_size` times, one step
per line; each step is labelled with the fraction of `continuations` replies
sampled from it that the strict grader accepts (the last step with the reply's
own verdict). Held-out rows come from the test split's questions, whose
replies are also the best-of-N candidates.

Variants (`--config=...process_reward_model_arithmetic.py:VARIANT`):
  tiny   the tiny random model, a few small steps, every artifact (seconds).
"""

import ml_collections

from experiments.configs import trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  # Step-labelled rows from your own JSONL ({"prompt", "steps", "values"} per line);
  # when steps_jsonl is empty they are generated from `task` and written to
  # `steps_dir` (default <workdir>/steps), reused while the settings match.
  c.steps_jsonl = ""
  c.eval_steps_jsonl = ""
  c.eval_size = 400  # held-out rows scored per evaluation (at most)
  trainer_common.add_task(c, prompt_template=(
      "{question} Work it out step by step, one step per line, and end with "
      "'The answer is N.'"))
  c.steps_dir = ""
  c.step_separator = "\n"
  c.max_steps = 6  # steps past it join the last
  c.generation = ml_collections.ConfigDict(dict(
      train_prompts=300, eval_prompts=100, group_size=4, temperature=0.7, max_new_tokens=64,
      continuations=4,  # Monte-Carlo replies per step
      batch_prompts=16))
  c.score_batch_size = 32

  # The process reward model: the policy model's backbone and a scalar head, read
  # at each step's last token. See reward_model_arithmetic.py.
  c.reward_model = ml_collections.ConfigDict(dict(
      frozen_layers=20, max_len=192, head_scale=0.0, head_learning_rate=1e-3))

  c.rows_per_step = 16
  trainer_common.add_schedule(c, steps=150, learning_rate=1e-5, eval_every=50)

  if variant == "tiny":
    return _tiny(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny' or none")
  return c


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The tiny random model, a few small steps, every artifact. Its replies are graded on
  length (under 6 characters), which varies within most groups."""
  c.model = "tiny"
  c.task = "arithmetic/add1"
  c.grader = "short_reply"
  c.grader_kwargs = ml_collections.ConfigDict(dict(max_chars=6))
  c.step_separator = " "  # the random model writes spaces more often than newlines
  c.max_steps = 4
  c.generation.update(dict(train_prompts=8, eval_prompts=4, group_size=2, temperature=1.0,
                           max_new_tokens=8, continuations=2, batch_prompts=8))
  c.eval_size = 8
  c.score_batch_size = 8
  c.reward_model.frozen_layers = 1
  c.reward_model.max_len = 96
  c.rows_per_step = 4
  trainer_common.tiny_schedule(c)
  return c
