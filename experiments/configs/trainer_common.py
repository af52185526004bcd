"""Config keys the offline trainers share (reward model, DPO, SFT, rejection sampling).

  add_schedule(c, ...)   the optimizer, the run length and the harness's schedule
  tiny_schedule(c)       the same for the `:tiny` smoke variants
  add_pair_data(c)       where preference pairs come from (`experiments/preference_data.py`)
  tiny_pair_data(c)      the same for the tiny random model
"""

import ml_collections

ANSWER_ONLY = "{question} Answer with just the number."


def add_task(c: ml_collections.ConfigDict, *, prompt_template: str = ANSWER_ONLY,
             grader_kwargs: bool = True) -> None:
  """The task block the offline trainers share: `task`'s questions (its `eval_split` held
  out) asked through the chat template with `prompt_template`, replies graded by `grader` (a
  registered reward: 1 accepts a reply) with `grader_kwargs` where the trainer reads them."""
  c.task = "arithmetic/mixed"
  c.eval_split = "test"
  c.prompt_template = prompt_template
  c.system_prompt = ""
  c.chat = True
  c.grader = "math_strict"
  if grader_kwargs:
    c.grader_kwargs = ml_collections.ConfigDict()


def add_pair_data(c: ml_collections.ConfigDict) -> None:
  # Pairs from your own JSONL ({"prompt", "chosen", "rejected"} per line); when
  # pairs_jsonl is empty they are generated from `task` (below).
  c.pairs_jsonl = ""
  c.eval_pairs_jsonl = ""  # held-out pairs (else the first eval_size training pairs)
  c.eval_size = 1000  # held-out pairs scored per evaluation (at most, of each kind)
  # Generated pairs: the model samples `group_size` replies per question, the
  # grader splits them into accepted and rejected. They are written to
  # `pairs_dir` (default <workdir>/pairs) and reused while the settings match.
  add_task(c)
  c.pairs_dir = ""
  c.generation = ml_collections.ConfigDict(dict(
      train_prompts=1000,  # training questions (the first of the train split)
      eval_prompts=100,    # held-out questions (the first of eval_split)
      group_size=8, temperature=0.5, max_new_tokens=24, max_pairs_per_prompt=4,
      batch_prompts=16,
      # Hard negatives per question: an accepted reply against itself with a wrong
      # answer swapped in (0: none), so the answer and not only the form decides.
      answer_swaps=0,
      # Pairs with no sampling (arithmetic tasks): the right answer stated in the reply's
      # form ("37 + 45 = 82") against a plausible wrong one, this many per question of
      # the first `stated_prompts` train questions (0: all) and of the held-out ones.
      stated_answers=0, stated_prompts=0,
      # That share of the stated pairs also gives one with a rejected reply's text after
      # the answer (right over wrong + text, right + text over wrong + text, right over
      # right + text), so appended text pays nothing; needs train_prompts >= 1.
      trailing_text=0.0))
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


def add_schedule(c: ml_collections.ConfigDict, *, steps: int, learning_rate: float,
                 warmup_updates: int = 10, decay: str = "cosine", eval_every: int = 50) -> None:
  """AdamW with clipping (`jaxrl_agents.train.optim`), `steps` steps, and the harness's keys."""
  c.steps = steps
  c.minibatches = 1
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=learning_rate, warmup_updates=warmup_updates, decay=decay,
      end_fraction=0.1 if decay != "constant" else 0.0, clock="updates", weight_decay=0.0,
      b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
  c.max_consecutive_nonfinite = 5
  c.time_budget_s = 0.0
  c.eval_every_s = 0.0
  # Devices (jaxrl_agents/parallel/sharding.py); all 1: one device.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
  c.layout = "auto"  # "list", "stacked" or "auto" by backend (grpo_arithmetic.py)
  c.remat = "auto"
  c.attention = "auto"  # models/attention.py (grpo_arithmetic.py)
  # LoRA adapters (models/lora.py; grpo_arithmetic.py); rank 0: train every weight.
  c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="all", dropout=0.0,
                                          base_dtype=""))
  c.eval_every = eval_every
  c.checkpoint_every = eval_every
  c.keep_checkpoints = 2
  c.sample_every = max(1, eval_every // 2)
  c.samples_per_log = 8
  c.tensorboard = True
  c.start_over = False
  # Modules of one's own to import before any name is checked, so the rewards, environments,
  # losses or models they register can be named here (docs/extending.md).
  c.imports = ()


def tiny_schedule(c: ml_collections.ConfigDict, steps: int = 4, eval_every: int = 2) -> None:
  """A few steps at a high constant rate, evaluated, checkpointed and sampled often. The
  rate is constant so a resume test may stop at any step (a decaying schedule depends on
  `steps`, which a resume refuses to change)."""
  c.steps = steps
  c.optimizer.update(dict(learning_rate=1e-3, warmup_updates=0, decay="constant",
                          end_fraction=0.0))
  c.eval_every = eval_every
  c.checkpoint_every = 1
  c.sample_every = 1
