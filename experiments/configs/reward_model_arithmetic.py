r"""A Bradley-Terry outcome reward model for arithmetic answers, on the embedded SmolLM2-135M.

  python -m experiments.reward_model \
      --config=experiments/configs/reward_model_arithmetic.py --workdir=runs/rm_arithmetic

Pairs: the embedded model answers each question `group_size` times
(temperature 0.5); a reply the strict grader accepts is preferred to one it
rejects, and (answer_swaps) a right reply is preferred to itself with a wrong
number swapped in. Training pairs come from `train_prompts` questions of the
`arithmetic/mixed` train split, held-out pairs from its 100 test questions,
whose `group_size` replies are also the best-of-N candidates: each evaluation
reports the reward model's pick among them against the greedy reply.

Variants (`--config=...reward_model_arithmetic.py:VARIANT`):
  stated_answers  no sampled training pairs: one stated-answer pair per train question
         ("37 + 45 = 82" over "37 + 45 = 72", `generation.stated_answers`), 300 steps
         with the top 16 layers trained; held-out pairs and best-of-N as above.
  reads_the_number  the stated pairs beside the model's own: 300 sampled questions
         (their pairs and two answer swaps each), a stated pair per train question,
         and for half of those a pair with a rejected reply appended
         (`generation.trailing_text`), so text after the answer does not pay; 300
         steps. The reward model for GRPO with a learned reward alone.
  tiny   the tiny random model, a few small steps, every artifact (seconds).
"""

import ml_collections

from experiments.configs import trainer_common


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  trainer_common.add_pair_data(c)
  # Sampled pairs alone mostly differ in form (a wrong reply rambles, a right one
  # states "a + b = c"), and a policy trained on a reward model of them learned to
  # state any number in that form. Two hard negatives per question: a right reply
  # against itself with a wrong number.
  c.generation.answer_swaps = 2

  # The reward model: the policy model's backbone and a scalar head, read at the
  # reply's end-of-turn token ("last") or averaged over the sequence ("mean").
  # frozen_layers: the embedding and the first k layers get no gradient (and no
  # backward pass). The head learns at head_learning_rate (the optimizer's rate is the
  # backbone's).
  c.reward_model = ml_collections.ConfigDict(dict(
      pooling="last", frozen_layers=20, max_len=128, head_scale=0.0, head_learning_rate=1e-3))
  c.margin = 0.0  # Bradley-Terry margin (Llama 2's); 0 is the plain loss

  c.pairs_per_step = 16
  trainer_common.add_schedule(c, steps=150, learning_rate=1e-5, eval_every=50)

  # Best-of-N on the held-out questions at each evaluation (generated pairs only).
  c.vote_temperature = 1.0  # softmax temperature of the reward-weighted vote

  if variant == "tiny":
    return _tiny(c)
  if variant == "stated_answers":
    return _stated_answers(c)
  if variant == "reads_the_number":
    return _reads_the_number(_stated_answers(c))
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'stated_answers', "
                     "'reads_the_number', 'tiny' or none")
  return c


def _stated_answers(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A reward model that reads the number: trained only on right-vs-wrong statements of the
  answer, which need no sampling, so there are as many as there are questions."""
  c.generation.train_prompts = 0
  c.generation.answer_swaps = 0
  c.generation.stated_answers = 1
  # Stated replies are short; telling a right sum from a wrong one takes more than the
  # top third of the layers.
  c.reward_model.update(dict(frozen_layers=14, max_len=64))
  trainer_common.add_schedule(c, steps=300, learning_rate=3e-5, eval_every=75)
  return c


def _reads_the_number(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Stated pairs alone let a policy win with text after the equation, and sampled pairs
  beside them (150 steps) left a reward model that knew the form but not the number: this
  mix, with trailing-text pairs, for 300 steps."""
  c.generation.update(dict(train_prompts=300, answer_swaps=2, trailing_text=0.5))
  c.reward_model.max_len = 96  # a reply with text after it keeps its equation
  c.eval_every = 150
  return c


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The tiny random model, a few small steps, every artifact."""
  trainer_common.tiny_pair_data(c)
  c.reward_model.frozen_layers = 1
  c.reward_model.max_len = 96
  c.pairs_per_step = 4
  trainer_common.tiny_schedule(c)
  return c
