r"""GRPO on arithmetic with the embedded SmolLM2-135M-Instruct.

Task: one- and two-digit addition and subtraction and multiplication tables
(`arithmetic/mixed`), plain questions through the chat template with the
instruction "Answer with just the number."; reward 1 when the strict grader
accepts the reply's final answer, plus 0.2 for a reply under 40 characters.

  python -m experiments.grpo --config=experiments/configs/grpo_arithmetic.py \
      --workdir=runs/grpo_arithmetic

Exploration: the policy gradient goes only through the 20% highest-entropy tokens and
the learning rate decays to 0 over the run (cosine), chosen by
`benchmarks/entropy_control.py` (docs/main_job.md#keeping-the-policy-exploring).
Expected on a 2-core CPU (three seeds): held-out strict accuracy on the 100-question
test split 0.32 before training, 0.57-0.74 after 50 steps (standard error ~5 points),
in 4-10 minutes of training by CPU generation; every measurement: docs/main_job.md.
Other GRPO and PPO configs build on `base_config` (no token control, a constant rate).

Variants (`--config=...grpo_arithmetic.py:VARIANT`):
  reward_model   a trained reward model is the only reward (its run in
         --config.rewards.reward_model.workdir, default runs/rm_reads); KL 0.1, the entropy
         gate, 30 training minutes (docs/reward_models.md).
  reward_model_beside  the same, with the reward model trained beside the policy on the
         grader's (or the group majority's) labels (experiments/reward_beside.py).
  lora   the main job training rank-16 LoRA adapters (lr 2e-4), the base frozen:
         0.56-0.66 held-out at step 50 over three seeds (docs/lora.md).
  tiny   the tiny random model, 3 prompts x 4 rollouts: every artifact in about 20 s.
Every objective of the library is a key below (docs/objectives.md, "From a config").
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  """The main job (no variant) or a variant of it (see the module docstring)."""
  c = base_config(None if variant == "lora" else variant)
  if variant in (None, "reward_model", "lora"):
    # Exploration controls chosen by measurement (benchmarks/entropy_control.py,
    # docs/main_job.md#keeping-the-policy-exploring): the gradient only through the 20%
    # highest-entropy policy tokens, and the learning rate decayed to 0 over the run.
    c.token_control.update(name="entropy_gate", frac=0.2)
    c.optimizer.decay = "cosine"
    # Decoding on with the unfinished rows, and the packed update programs compiled
    # ahead in the background: the same replies and updates (seed 0 on a 2-core AMX
    # Xeon, 2026-12-02: every step's reward and both evaluations identical), 502 s of
    # training against 536 s (docs/main_job.md).
    c.compact_min_rows = 8
    c.pack_compile_ahead = 2
  if variant == "reward_model":
    # Against a learned reward they keep the policy from settling on one confident near
    # miss; the decay runs over the 30 training minutes. Measured with
    # `reward_model_arithmetic.py:reads_the_number` (docs/reward_models.md): 0.32 -> 0.36 /
    # 0.54 / 0.50 at 30 minutes in seeds 0 / 1 / 2.
    c.optimizer.clock = "train_time"
  if variant == "lora":
    # The main job training rank-16 adapters on every linear weight, the base frozen
    # (models/lora.py). The rate chosen by measurement on a 2-core EPYC (docs/lora.md):
    # held-out at step 50, seed 0: 0.58 / 0.73 / 0.42 with 1e-4 / 3e-4 / 1e-3; over seeds
    # 0 / 1 / 2, 3e-4 gave 0.73 / 0.52 / 0.10 (seed 2 settled on short wrong replies) and
    # 2e-4 gave 0.66 / 0.63 / 0.56.
    c.lora.update(rank=16, alpha=32.0)
    c.optimizer.learning_rate = 2e-4
  return c


def base_config(variant: str | None = None) -> ml_collections.ConfigDict:
  """Every key of a GRPO run with neutral objective defaults (no token control, a constant
  learning rate): what the other GRPO and PPO configs build on."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"

  _task_and_rewards(c)
  _rollout(c)
  _objective(c)
  _optimizer(c)
  _devices_and_run(c)

  if variant == "tiny":
    return _tiny(c)
  if variant == "reward_model":
    # A trained reward model is the only reward; the grader still measures accuracy.
    c.rewards = ml_collections.ConfigDict(
        {"reward_model": {"weight": 1.0, "workdir": "runs/rm_reads", "step": 0}})
    # The policy finds what the reward model overrates (a wrong number in the right
    # form, text after the answer) within minutes: a KL penalty to the initial policy
    # slows that (get_config adds the main job's exploration controls).
    c.kl_coef = 0.1
    c.time_budget_s = 1800.0
    c.eval_every, c.eval_every_s = 0, 600.0
    c.steps = 1000
    return c
  if variant == "reward_model_beside":
    return _reward_model_beside(c)
  if variant:
    raise ValueError(f"unknown variant {variant!r}; expected 'tiny', 'reward_model', "
                     "'reward_model_beside', 'lora' or none")
  return c


def _task_and_rewards(c: ml_collections.ConfigDict) -> None:
  """The prompts, their template, the rewards and the grader."""
  # Data: a registered task ("arithmetic/<config>", "countdown") or a JSONL file.
  c.task = "arithmetic/mixed"
  c.jsonl_path = ""  # your own prompts: {"prompt": ..., "answer": ...} per line
  c.eval_jsonl_path = ""  # held-out prompts for a JSONL run (else it evaluates on training rows)
  c.eval_split = "test"
  # Held-out questions from another task than the training one ("gsm8k" while training on
  # a generator of similar problems; at that task's default options). "": config.task's.
  c.eval_task = ""
  c.eval_size = 100  # the whole test split
  c.prompt_template = "{question} Answer with just the number."
  c.system_prompt = ""
  c.chat = True
  # A prompt that leaves less than max_new_tokens of the model's context: "error"
  # (names it, before anything compiles for JSONL data) or "truncate" (drops the
  # start of its longest message; counted as "prompts_truncated").
  c.prompt_overflow = "error"
  # Prompts are left-padded to the batch's longest, rounded up to 16 columns: a task whose
  # prompts vary in length compiles the sampler and the update once per width. A width
  # here pads every batch to at least it (one program; longer prompts still fit).
  c.min_prompt_width = 0

  # Rewards: registered reward names -> weights; the grader gives the accuracy.
  c.rewards = ml_collections.ConfigDict({"math_strict": 1.0, "short_reply": 0.2})
  c.grader = "math_strict"
  # How the rewards make the total: "sum" (weighted), "lexicographic" (the first
  # decides, then the second...; components in [0, 1] at least `min_gap` apart) or
  # "gated" (the second counts only where the first is >= `threshold`).
  c.reward_combinator = ml_collections.ConfigDict(dict(name="sum", min_gap=1.0, threshold=1.0))
  # Seconds the rewards (and the grader) may spend on one completion, scored in a worker
  # process; one that runs over scores 0, is logged as "reward_timeouts", and the step goes
  # on (jaxrl_agents/rewards/time_limit.py). 0 turns the limit off (scored in-process).
  c.reward_time_limit_s = 10.0
  # "par" (Preference As Reward): the training reward becomes mean_m sigmoid(r - r_m) over
  # `references` replies of the initial policy to the same prompt (sampled each step).
  c.reward_shaping = ml_collections.ConfigDict(dict(name="none", references=2))
  # Train the "reward_model" reward beside the policy (experiments/reward_beside.py): each
  # step, a Bradley-Terry step on up to pairs_per_step pairs of the step's replies, labelled
  # by the grader or (labels="majority", no verifier) by each group's most common answer.
  # pairs_per_step 0: the reward model stays as loaded.
  c.reward_model_beside = ml_collections.ConfigDict(dict(
      pairs_per_step=0, labels="grader", learning_rate=1e-5, head_learning_rate=1e-4))


def _rollout(c: ml_collections.ConfigDict) -> None:
  """How many prompts and replies a step samples, and how."""
  c.steps = 50
  c.prompts_per_step = 4  # groups per update
  c.group_size = 8
  # Sample oversample x prompts_per_step prompts per step and train on the
  # prompts_per_step groups whose rewards vary (groups.kept_groups).
  c.oversample = 1
  # DAPO's dynamic sampling: while fewer than prompts_per_step of the sampled groups have
  # reward variance, sample up to this many more batches of prompts and keep the varied
  # groups (groups.resample_until_varied; 0: off).
  c.resample_rounds = 0
  # Leave the groups whose rewards tie (zero advantage) out of the update's token mean
  # and its packed tokens (rollout.groups.without_tied_groups).
  c.drop_tied_groups = False
  # Leave the rows whose advantages are all 0 out of the update's compute, scaling the
  # loss so the step is the one of training on them (rollout.groups.
  # without_zero_advantage_rows; needs no KL, entropy bonus or token control).
  c.skip_zero_advantage_rows = False
  c.max_new_tokens = 32
  c.temperature = 0.8
  c.top_p = 1.0
  c.top_k = 0
  # 0, or decoding goes on with just the unfinished rows once at most half are left,
  # halving down to this many rows (SamplingConfig.compact_min_rows): the same replies up
  # to float rounding, the long replies no longer paying for the finished rows.
  c.compact_min_rows = 0
  # 0, or the rollout's rows (and the evaluation's examples) decode this many at a time
  # through continuous batching (jaxrl_agents/rollout/continuous.py): a row that is done
  # takes the next queued one, so long-tailed reply lengths stop costing padding. Each
  # row draws from its own key (another sample stream than the static batch's); one
  # device; the project's transformer.
  c.continuous_slots = 0


def _objective(c: ml_collections.ConfigDict) -> None:
  """The advantage, the policy loss and its controls, KL, packing, the average."""
  # Objective (names from the registry; see docs/objectives.md). The advantage is a
  # "group_advantage" over the total rewards, or a "component_advantage" (gdpo) over
  # the rewards' components weighted as in c.rewards.
  c.advantage = "grpo"
  c.advantage_kwargs = ml_collections.ConfigDict()
  c.policy_loss = "ppo"
  # Each loss's own hyperparameters: the selected loss reads its entry only, so
  # switching to gspo gets GSPO's clip range; dual_clip 0 is off (else c > 1).
  c.loss_kwargs = ml_collections.ConfigDict(dict(
      ppo=dict(eps_low=0.2, eps_high=0.28, dual_clip=0.0),
      gspo=dict(eps_low=3e-4, eps_high=4e-4),
      cispo=dict(eps_high=0.2)))
  c.aggregation = "token-mean"
  # Gradient only for some policy tokens: "covariance_clip" drops the `frac` with the
  # largest log-prob/advantage covariance, "entropy_gate" keeps the `frac` of highest
  # entropy; ranked over the batch, or within each sequence.
  c.token_control = ml_collections.ConfigDict(dict(name="none", frac=0.0, per_sequence=False))
  # KL to the frozen initial policy: kl_coef > 0 turns it on. kl_estimator: a sampled-
  # token estimator (k1, k2, k3) or "forward" (exact KL(ref || pi) over the vocabulary).
  c.kl_coef = 0.0
  c.kl_estimator = "k3"
  # The coefficient's controller: "fixed" (kl_coef), "adaptive" (starts at kl_coef,
  # tracks `target` in the logged kl's units over `horizon` samples) or "accuracy"
  # (beta_min + (kl_coef - beta_min) * accuracy^shape).
  c.kl_controller = ml_collections.ConfigDict(dict(
      name="fixed", target=0.1, horizon=1000.0, beta_min=0.0, shape=2.0))
  c.entropy_coef = 0.0
  c.epochs = 1
  c.minibatches = 1
  # Each group's prompt goes through the model once per update, not once per
  # completion (same gradient up to float rounding; tests/test_scoring.py).
  c.share_prompt = True
  # With share_prompt, GRPO's update runs only the reply tokens, packed into one
  # stream, not B rows of the longest reply's width: the same values
  # (tests/test_scoring.py), less time per step (docs/grpo_iteration.md#packed-replies),
  # for a few more compiles as replies shorten (rollout/shapes.py: half octaves; a packed
  # batch is padded to max_new_tokens columns, so one program per slot count). Rows
  # in multi-turn blocks stay padded.
  c.pack_replies = True
  # ...only where its slots are at most this fraction of the padded rows' reply
  # columns; elsewhere the padded program (one per reply width) serves. 1.0: always.
  # 0.5 measured against 1.0 (docs/grpo_iteration.md#packed-replies): fewer compiled
  # programs for the same update time, the main job's training 6% shorter over three seeds.
  c.pack_below = 0.5
  # After each update, compile the packed programs for this many slot counts below the
  # batch's, and the padded program at the next narrower reply width, in the background
  # while the next rollout samples (experiments/grpo.py, GRPOSettings.pack_compile_ahead):
  # the same results, compiled before they are needed.
  c.pack_compile_ahead = 0
  # Evaluate (and export) the exponential moving average of the policy's parameters over
  # updates, with this weight on the previous average (GRPOSettings.ema_decay); the
  # rollouts sample the policy itself. 0: off, the policy is evaluated.
  c.ema_decay = 0.0


def _optimizer(c: ml_collections.ConfigDict) -> None:
  """AdamW's schedule, the overlapped rollout and its off-policy correction."""
  # decay ("constant", "cosine", "linear") runs on `clock`: applied updates, or
  # "train_time", the fraction of time_budget_s spent (for time-budgeted runs). It spans
  # the first `decay_over` of the clock; the rate then holds at end_fraction x peak.
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=2e-5, warmup_updates=0, decay="constant", end_fraction=0.0, clock="updates",
      decay_over=1.0,
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
  c.max_consecutive_nonfinite = 5

  # Sample step t+1's rollout while step t's update runs, with the policy that update
  # starts from (one step off-policy; jaxrl_agents/train/overlap.py). One process, one device;
  # GRPO only; the train state keeps a second copy of the policy.
  c.overlap = False
  # Tokens drawn by another policy than the one updated (the overlap's, or a sampler whose
  # numerics differ): "none", "tis" (advantage x min(rho, cap)) or "mis" (tokens with rho
  # outside [1/cap, cap] leave the policy-gradient term); rho = pi / sampling policy
  # (losses/off_policy.py). Needs top_p=1, top_k=0; not with gspo.
  c.off_policy = ml_collections.ConfigDict(dict(correction="none", cap=2.0))


def _devices_and_run(c: ml_collections.ConfigDict) -> None:
  """Devices, layout, time budget, logging, evaluation and checkpoints."""
  # Devices (jaxrl_agents/parallel/sharding.py): rows split over data x fsdp, weights and
  # optimizer moments over fsdp (and tensor); -1 takes the devices left over. All
  # 1: one device.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
  # Layers as a per-layer list (fastest on CPU) or "stacked" under one lax.scan (for
  # accelerators: compile time independent of depth), the scanned layer rematerialized
  # in the backward pass by `remat` ("none", "full", "dots"). "auto": the list on CPU
  # (and for models that cannot stack), stacked with remat "full" on accelerators
  # (docs/long_sequences.md); the run records what "auto" chose.
  c.layout = "auto"
  c.remat = "auto"
  # How attention is computed (jaxrl_agents/models/attention.py): "auto" is the einsums
  # on CPU, cuDNN's fused kernel for bfloat16 on a GPU, and the chunked online softmax
  # (memory linear in the row) otherwise; or "xla", "chunked", "cudnn", "triton", "mosaic".
  c.attention = "auto"
  # LoRA (jaxrl_agents/models/lora.py): rank > 0 trains low-rank adapters on the weights
  # `targets` names ("attention", "mlp", "all", or path regexes, comma-separated), the
  # base frozen (no optimizer moments, no gradient), the KL reference the base itself;
  # the update's scale is alpha / rank; base_dtype "bfloat16" stores the frozen base in
  # half the memory ("": float32). 0: every weight trains.
  c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="all", dropout=0.0,
                                          base_dtype=""))
  # > 0: GRPO's log-probabilities from the hidden states this many columns at a time,
  # never the whole [B, N, V] vocabulary logits (192 KiB a token at SmolLM2's V, f32):
  # for long replies, with layout "stacked" and remat "full" (measured in
  # docs/long_sequences.md). 0: all at once.
  c.logprob_chunk = 0

  # Wall-clock: stop after this much training time (rollouts and updates,
  # evaluation excluded), and evaluate each time it crosses a multiple of
  # eval_every_s; 0 turns either off.
  c.time_budget_s = 0.0
  c.eval_every_s = 0.0

  # Logging, evaluation, checkpoints.
  c.eval_every = 25
  c.eval_batch_size = 32
  # Beside the greedy accuracy, k sampled replies a held-out question through the
  # evaluation harness (evaluation/harness.py): pass@1, pass@k, maj@k and mean@k with their
  # standard errors in each evaluation record. 0: greedy only.
  c.eval_sampling = ml_collections.ConfigDict(dict(k=0, temperature=0.8, top_p=1.0))
  c.checkpoint_every = 10
  c.keep_checkpoints = 3
  c.sample_every = 5
  c.samples_per_log = 8
  c.tensorboard = True
  # A workdir holds one run. True moves a previous run's files (checkpoints,
  # logs, config.json) to <workdir>/previous/<time>/ and starts afresh; a
  # workdir whose logs no checkpoint can continue is refused without it.
  c.start_over = False
  # Modules of one's own to import before any name is checked, so the rewards, environments,
  # losses or models they register can be named here (docs/extending.md).
  c.imports = ()


def _reward_model_beside(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The reward model alone as the policy's reward, trained beside it on its fresh replies."""
  c.rewards = ml_collections.ConfigDict(
      {"reward_model": {"weight": 1.0, "workdir": "runs/rm_arithmetic", "step": 0}})
  c.reward_model_beside.pairs_per_step = 8
  c.kl_coef = 0.1
  c.time_budget_s = 1800.0
  c.eval_every, c.eval_every_s = 0, 600.0
  c.steps = 1000
  return c


def _tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The smoke-test variant: the tiny random model, a few small steps, every artifact."""
  c.model = "tiny"
  c.steps = 3
  c.prompts_per_step = 3
  c.group_size = 4
  c.max_new_tokens = 16
  c.eval_size = 8
  c.eval_batch_size = 8
  c.eval_every = 2
  c.checkpoint_every = 1
  c.sample_every = 1
  c.optimizer.learning_rate = 1e-3
  return tiny_reward(c)


def tiny_reward(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Makes short_reply count replies under 12 characters, for the tiny random model.

  That model never answers right, and its 16-byte replies always fit the usual
  40 characters: with a constant reward every advantage and gradient is zero,
  and a smoke test could not tell a working update from a broken one. Its
  replies decode to 1-16 characters, so at 12 nearly every group's rewards vary.
  """
  rewards = c.rewards.to_dict()
  rewards["short_reply"] = {"weight": 0.2, "max_chars": 12}
  c.rewards = ml_collections.ConfigDict(rewards)
  return c
