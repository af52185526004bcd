"""What every RL experiment script needs: config checks, model, data, rewards, logging."""

from __future__ import annotations

import logging
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import data as data_lib
from jaxrl_agents import registry
from jaxrl_agents import rewards as rewards_lib
from jaxrl_agents.models import attention, lora, transformer, zoo
from jaxrl_agents.objectives import policy_objective as policy_objective_lib
from jaxrl_agents.parallel import distributed, sharding
from jaxrl_agents.rewards import learned as learned_rewards
from jaxrl_agents.rewards import time_limit
from jaxrl_agents.rollout import self_play, single_turn
from jaxrl_agents.train import compilation_cache, harness, overlap
from jaxrl_agents.train import host_memory as host_memory_lib
from jaxrl_agents.train import optim as optim_lib
from jaxrl_agents.train import workdir as workdir_lib

# The experiments' config keys a resumed run may change, and the values that reproduce runs
# made before a key existed (`harness.ResumeRules`; the harness adds its own, the schedule's).
RESUME_RULES = harness.ResumeRules(
    resumable=frozenset({
        # A safety limit: it changes a result only for a reply whose reward stalls.
        "reward_time_limit_s",
        # When programs compile, not what they compute.
        "pack_compile_ahead",
        # Decoding's row count as replies finish: the same replies up to float rounding.
        "compact_min_rows",
        # The log-probabilities in chunks of columns: the same values up to float rounding.
        "logprob_chunk",
        # How attention is computed, not what: the same values up to float rounding.
        "attention",
        # Prompt padding: the same values up to float rounding.
        "min_prompt_width",
        # What the held-out evaluation also measures, not what is trained.
        "eval_sampling.k", "eval_sampling.temperature", "eval_sampling.top_p", "eval_task"}),
    backward_defaults={
        "prompt_overflow": "error", "env": "", "turn_credit.name": "episode",
        "turn_credit.gamma": 1.0, "turn_credit.step_weight": 1.0, "potential_shaping": False,
        "env_answer_tokens": 32, "generation.answer_swaps": 0, "layout": "list",
        "remat": "none", "overlap": False, "off_policy.correction": "none",
        "off_policy.cap": 2.0, "pack_replies": False, "pack_below": 1.0,
        "optimizer.decay_over": 1.0, "drop_tied_groups": False,
        "skip_zero_advantage_rows": False, "pack_compile_ahead": 0, "compact_min_rows": 0,
        "ema_decay": 0.0, "resample_rounds": 0, "logprob_chunk": 0,
        "attention": "auto", "continuous_slots": 0, "lora.rank": 0, "lora.alpha": 16.0,
        "lora.targets": "all", "lora.dropout": 0.0, "lora.base_dtype": "",
        "min_prompt_width": 0, "eval_sampling.k": 0, "eval_sampling.temperature": 0.8,
        "eval_sampling.top_p": 1.0, "eval_task": ""})


def setup_logging() -> None:
  """INFO logs on stderr (stdout stays free for results); quiet third-party loggers."""
  logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "jax._src", "tensorflow_datasets", "grain"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def validate_common(config) -> None:
  """Checks names and sizes shared by all RL experiments before anything loads or compiles."""
  harness.validate_run_keys(config)  # first: it imports the user's modules (config.imports)
  for name in config.rewards:
    registry.get("reward", name)
  make_rewards(config)  # options and the combinator
  shaping = config.get("reward_shaping", None)
  if shaping and shaping.name not in ("none", "par"):
    raise ValueError(f"reward_shaping.name must be 'none' or 'par', got {shaping.name!r}")
  if shaping and shaping.name == "par" and shaping.references < 1:
    raise ValueError(f"reward_shaping.references must be >= 1, got {shaping.references}")
  registry.get("reward", config.grader)
  lora.spec_from_config(config.get("lora"))  # bad adapter settings fail before anything loads
  lora_base_dtype(config)
  _validate_off_policy(config)
  if config.model not in zoo.names() and not config.model.endswith((".gguf",)):
    import os

    if not os.path.isdir(config.model):
      raise ValueError(f"unknown model {config.model!r}: not a preset ({', '.join(zoo.names())})"
                       ", a Hugging Face directory or a .gguf file")
  if not config.temperature > 0:
    raise ValueError(f"config.temperature must be > 0 for RL rollouts, got {config.temperature}")
  _validate_episodes(config)
  for key in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs",
              "minibatches", "checkpoint_every", "keep_checkpoints"):
    if config[key] < 1:
      raise ValueError(f"config.{key} must be >= 1, got {config[key]}")
  if config.get("oversample", 1) < 1:
    raise ValueError(f"config.oversample must be >= 1 (1 turns it off), got {config.oversample}")
  for key in ("time_budget_s", "eval_every_s"):
    if config.get(key, 0) < 0:
      raise ValueError(f"config.{key} must be >= 0 (0 turns it off), got {config[key]}")
  _validate_rates(config)
  if config.get("prompt_overflow", "error") not in single_turn.PROMPT_OVERFLOW:
    raise ValueError(f"config.prompt_overflow must be one of {single_turn.PROMPT_OVERFLOW}, "
                     f"got {config.prompt_overflow!r}")
  clock = config.optimizer.get("clock", "updates")
  if clock not in optim_lib.CLOCKS:
    raise ValueError(f"config.optimizer.clock must be one of {optim_lib.CLOCKS}, got {clock!r}")
  if config.optimizer.decay not in optim_lib.SCHEDULES:
    raise ValueError(f"config.optimizer.decay must be one of {optim_lib.SCHEDULES}, "
                     f"got {config.optimizer.decay!r}")
  optim_lib.check_decay_over(config.optimizer.get("decay_over", 1.0),
                             name="config.optimizer.decay_over")
  if clock == "train_time" and not config.get("time_budget_s", 0):
    raise ValueError("config.optimizer.clock='train_time' decays the learning rate over the "
                     "time budget: set config.time_budget_s > 0 (or use clock='updates')")
  _validate_decoding(config)
  batch = config.prompts_per_step * config.group_size
  if batch % config.minibatches:
    raise ValueError(f"prompts_per_step * group_size = {batch} is not divisible by "
                     f"minibatches = {config.minibatches}")
  if config.get("share_prompt", False) and (config.prompts_per_step % config.minibatches):
    raise ValueError(f"share_prompt keeps each prompt's group in one minibatch: "
                     f"prompts_per_step = {config.prompts_per_step} is not divisible by "
                     f"minibatches = {config.minibatches} (or set share_prompt=False)")


def _validate_rates(config) -> None:
  """The learning rate and the KL coefficient: finite, in range."""
  kl = config.get("kl_coef", 0.0)
  if not (isinstance(kl, int | float) and math.isfinite(kl) and kl >= 0):
    raise ValueError(f"config.kl_coef must be a finite number >= 0 (0: no KL term), got {kl!r}")
  optim_lib.check_learning_rate(config.optimizer.learning_rate, "config.optimizer.learning_rate")


def _validate_decoding(config) -> None:
  """config.continuous_slots: a row count, and not with the static batch's compaction;
  config.min_prompt_width: a token count."""
  width = config.get("min_prompt_width", 0)
  if not (isinstance(width, int) and 0 <= width <= 1 << 20):
    raise ValueError(f"config.min_prompt_width must be a whole number of tokens >= 0 (0: "
                     f"each batch's longest prompt), got {width!r}")
  slots = config.get("continuous_slots", 0)
  if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
    raise ValueError(f"config.continuous_slots must be 0 (static batches) or the number of "
                     f"rows decoding at once, got {slots!r}")
  if slots and config.get("compact_min_rows", 0):
    raise ValueError("config.continuous_slots and config.compact_min_rows both shorten "
                     "decoding's finished rows: set one of them to 0")


def load_model(config) -> zoo.Model:
  """The policy model; on `config.mesh` (more than one device) its weights load sharded,
  laid out by `config.layout` (registry kind "layout", models/layouts.py: "stacked" runs
  its layers as one lax.scan, rematerialized by `config.remat`; for accelerators), its
  attention computed by `config.attention` (models/attention.py)."""
  layout, remat = config.get("layout", "list"), config.get("remat", "none")
  attention_name = config.get("attention", "auto")
  attention.check_name(attention_name)  # a bad name fails before the weights load
  if layout != "auto":
    registry.check_name("layout", layout, "layout")
  if remat != "auto" and remat not in transformer.REMAT_POLICIES:
    raise ValueError(f"remat must be one of {sorted(transformer.REMAT_POLICIES)} or 'auto', "
                     f"got {remat!r}")
  if remat not in ("none", "auto") and layout == "list":
    raise ValueError(f"remat={remat!r} applies to the stacked layout; set layout='stacked'")
  model = zoo.load(config.model, dtype=config.dtype, param_dtype=lora_base_dtype(config),
                   mesh=sharding.for_config(config))
  layout, remat = resolve_layout(layout, remat, model.cfg)
  for key, value in (("layout", layout), ("remat", remat)):
    if key in config:  # the run records, and a resume compares, what "auto" chose
      config[key] = value
  if isinstance(model.cfg, transformer.TransformerConfig):
    model.cfg = model.cfg.replace(attention=attention_name)
  elif attention_name not in ("auto", "xla"):
    raise ValueError(f"attention={attention_name!r} is the project's transformer's; "
                     f"config.model {config.model!r} computes its own attention")
  try:
    model = registry.get("layout", layout)(model, remat=remat)
  except ValueError as e:
    raise ValueError(f"{e} (config.model {config.model!r})") from None
  spec = lora.spec_from_config(config.get("lora"))
  if spec is not None:  # adapters on the laid-out weights (models/lora.py)
    model = lora.wrap(model, spec, jax.random.fold_in(init_key(config), 0x10A))
  return model


def lora_base_dtype(config) -> str | None:
  """The storage dtype of a LoRA run's frozen base (config.lora.base_dtype), else None (the
  default: float32; every weight of a full fine-tuning run trains in float32)."""
  block = config.get("lora")
  if lora.spec_from_config(block) is None or not block.get("base_dtype", ""):
    return None
  if block.base_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"lora.base_dtype must be 'float32', 'bfloat16' or '' (float32), got "
                     f"{block.base_dtype!r}")
  return block.base_dtype


def resolve_layout(layout: str, remat: str, cfg, backend: str | None = None
                   ) -> tuple[str, str]:
  """(layout, remat) with "auto" chosen: the per-layer list on CPU (faster there) and for
  models that cannot stack, layers stacked and rematerialized ("full") on accelerators,
  where long rows need the memory (docs/long_sequences.md). Asks for the backend only
  for "auto" (after `jax.distributed.initialize`, as the trainers load models)."""
  if layout == "auto":
    backend = jax.default_backend() if backend is None else backend
    stackable = isinstance(cfg, transformer.TransformerConfig)
    layout = "stacked" if backend != "cpu" and stackable else "list"
  if remat == "auto":
    remat = "full" if layout == "stacked" else "none"
  return layout, remat


def task_examples(config):
  """(train source, held-out examples) for the configured task or JSONL file."""
  if config.jsonl_path:
    examples = _jsonl_examples(config.jsonl_path)
    if config.get("eval_jsonl_path"):
      return examples, _jsonl_examples(config.eval_jsonl_path)[: config.eval_size]
    logging.getLogger(__name__).warning(
        "no eval_jsonl_path: evaluating on the first %d training prompts (not held out)",
        config.eval_size)
    return examples, examples[: config.eval_size]
  # A suite's options (data/suites.py: reasoning-gym's sizes, seeds, weights, configs).
  options = config.get("task_options", None)
  options = options.to_dict() if hasattr(options, "to_dict") else dict(options or {})
  train = data_lib.load_task(config.task, "train", **options)
  if config.get("eval_task"):  # held-out questions from another task, at its defaults
    held_out = data_lib.load_task(config.eval_task, config.eval_split)
  else:
    held_out = data_lib.load_task(config.task, config.eval_split, **options)
  n = min(config.eval_size, len(held_out))
  return train, [held_out[i] for i in range(n)]


def _jsonl_examples(path: str) -> list[dict]:
  """A JSONL prompt file's rows, each also under "question" when it has none: the configs'
  prompt templates name the tasks' field ("{question} ..."), JSONL rows name theirs
  "prompt", and either template then works on either source."""
  rows = data_lib.load_jsonl(path)
  return [row if "question" in row else {**row, "question": row["prompt"]} for row in rows]


def reward_weights(config) -> dict[str, float]:
  """{reward name: weight} of config.rewards, in its order ({name: w} or {name: {weight: w}})."""
  return {name: float(v.get("weight", 1.0) if hasattr(v, "items") else v)
          for name, v in config.rewards.items()}


def make_rewards(config):
  """(reward_fn -> (total, components), grader -> f32[B]).

  Both score each completion within config.reward_time_limit_s (0: no limit) in
  a worker process, so one reply that stalls a reward costs that reply's
  reward (0), not the run; `time_limit.timeouts(reward_fn)` counts them. A
  learned reward (`rewards.learned`, e.g. "reward_model") is scored in this
  process, on the device, and added to the verifiable rewards' weighted sum.
  """
  limit = config.get("reward_time_limit_s", 0.0)
  if limit < 0:
    raise ValueError(f"config.reward_time_limit_s must be >= 0 (0 turns it off), got {limit}")
  spec = config.get("reward_combinator", None)
  combinator = spec.name if spec else "sum"  # registry kind "reward_combinator"
  registry.check_name("reward_combinator", combinator, "reward_combinator.name")
  learned_spec = {k: v for k, v in config.rewards.items() if learned_rewards.is_learned(k)}
  verifiable_spec = {k: v for k, v in config.rewards.items() if k not in learned_spec}
  if trains_reward_model(config) and "reward_model" in learned_spec:
    # GRPO scores it with the train state's copy (experiments/reward_beside.py).
    options = learned_spec.pop("reward_model")
    learned_rewards.check_workdir(options.get("workdir", "") if hasattr(options, "items") else "")
  if learned_spec and combinator != "sum":
    raise ValueError(f"a learned reward ({sorted(learned_spec)}) adds to the weighted sum; "
                     f"reward_combinator {combinator!r} needs rewards in [0, 1]: use 'sum'")
  for name, options in list(learned_spec.items()):
    options = dict(options.items()) if hasattr(options, "items") else {"weight": options}
    learned_rewards.check_workdir(options.get("workdir", ""))
    # The reward model reads the prompt the policy saw, made by this experiment's template.
    options.setdefault("prompt_template", config.get("prompt_template", ""))
    learned_spec[name] = options
  grade = registry.get("reward", config.grader)
  if limit:
    grade = time_limit.TimeLimited(grade, limit)
  learned = rewards_lib.from_config(learned_spec) if learned_spec else None
  if not verifiable_spec:
    return (learned or no_rewards,
            lambda completions, examples: np.asarray(grade(completions, examples)))
  weighted = rewards_lib.from_config(verifiable_spec)  # options bound, names checked
  reward_fn = registry.get("reward_combinator", combinator)(
      weighted, **registry.options("reward_combinator", combinator, spec or {}))
  if limit:
    reward_fn = time_limit.TimeLimited(reward_fn, limit)
  if learned is not None:
    reward_fn = rewards_lib.SumOfRewards(reward_fn, learned)
  return reward_fn, lambda completions, examples: np.asarray(grade(completions, examples))


def frozen_reward_models(config) -> dict:
  """{description: () -> params} of the trained reward models config.rewards scores with
  (`harness.run`'s `frozen`): a resume whose reward model changed (its run trained on, or
  another workdir at that path) is refused. One trained beside the policy is not frozen."""
  frozen = {}
  for name, options in config.rewards.items():
    if not learned_rewards.is_learned(name) or (name == "reward_model"
                                                 and trains_reward_model(config)):
      continue
    options = dict(options.items()) if hasattr(options, "items") else {}
    # The reward's own call (`rewards.learned.reward_model_reward`) loads with these
    # arguments: the same cached model is digested and scores.
    args = (options.get("workdir", ""), options.get("batch_size", 32), options.get("step", 0),
            options.get("aggregate", ""))
    frozen[f"{name} ({args[0]})"] = lambda args=args: learned_rewards.load(*args).params
  return frozen


def supervised_update(update, mesh, state, batch, rng, progress: float, truncated: int):
  """The offline trainers' update on one encoded batch: its rows split over the mesh's
  devices, the jitted `update(state, batch, rng, progress)`, its metrics as floats with the
  count of sequences cut to fit (`sequences_truncated`). -> (state, record)."""
  batch = sharding.shard_batch(batch, mesh)
  state, metrics = update(state, batch, rng, jnp.float32(progress))
  record = {k: float(v) for k, v in jax.device_get(metrics).items()}
  record["sequences_truncated"] = truncated
  return state, record


def trains_reward_model(config) -> bool:
  """Whether the run trains its "reward_model" reward beside the policy
  (config.reward_model_beside, `experiments/reward_beside.py`)."""
  beside = config.get("reward_model_beside", None)
  return bool(beside) and beside.pairs_per_step > 0


def no_rewards(completions, examples=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Zero reward and no components: the collector's share when the only reward is a reward
  model trained beside the policy (the algorithm adds its scores)."""
  del examples
  return np.zeros(len(completions), np.float32), {}


def rollout_prompts(config) -> int:
  """Prompts sampled per step: prompts_per_step x oversample (the update keeps prompts_per_step)."""
  return config.prompts_per_step * config.get("oversample", 1)


def check_prompt_lengths(config, model: zoo.Model, examples, path: str) -> int:
  """Fails naming the first JSONL row whose prompt leaves less than max_new_tokens of the
  model's context (prompt_overflow "error"); returns how many would be truncated."""
  limit = single_turn.context_limit(model, config.max_new_tokens)
  overflow = config.get("prompt_overflow", "error")
  system = config.get("system_prompt") or None
  too_long = 0
  for i, ex in enumerate(examples):
    try:
      too_long += int(single_turn.encode_examples(
          model.tokenizer, [ex], config.prompt_template, chat=config.chat, system=system,
          limit=limit, overflow=overflow)[2].sum())
    except ValueError as e:
      raise ValueError(f"{path}:{i + 1}: {str(e).replace('prompt 0 has', 'the prompt has')}"
                       ) from None
  if too_long:
    logging.getLogger(__name__).warning("%s: %d prompts will be truncated to fit the context",
                                        path, too_long)
  return too_long


def episodes(config, model: zoo.Model, credit=None):
  """(collect, evaluate, data) of the episodes the config names: an environment's
  (`env_loop.make`, with what the trainer's credit asks of them: `env_loop.Credit`), or a
  task's prompts with their rewards (`single_turn.single_turn_collector`).

  collect(params, examples, rng) -> (types.Rollout, extra scalars); evaluate(params) ->
  (record, samples), or None; data: the loader whose batches `collect` takes (its position
  is checkpointed).
  """
  if config.get("env"):
    from jaxrl_agents.rollout import env_loop

    if config.get("continuous_slots", 0):
      raise ValueError("config.continuous_slots is for single-turn rollouts; an environment's "
                       "episodes decode their turns in static batches (set it to 0)")
    collect, evaluate, data = env_loop.make(config, model, credit)
    return collect, evaluate if config.eval_size else None, data
  train_source, eval_examples = task_examples(config)
  if config.jsonl_path:  # user data: every prompt checked before anything compiles
    check_prompt_lengths(config, model, train_source, config.jsonl_path)
    if config.get("eval_jsonl_path"):
      check_prompt_lengths(config, model, eval_examples, config.eval_jsonl_path)
  loader = data_lib.make_loader(train_source, batch_size=rollout_prompts(config),
                                seed=config.seed)
  reward_fn, grader = make_rewards(config)
  # With several processes each scores its share of the rows (one process: unchanged).
  reward_fn, grader = distributed.split_rows(reward_fn), distributed.split_rows(grader)
  collect, evaluate = single_turn.single_turn_collector(config, model, reward_fn=reward_fn,
                                                    grader=grader, eval_examples=eval_examples)
  if evaluate is not None and config.get("eval_sampling", {}).get("k", 0):
    evaluate = with_sampled_evaluation(evaluate, config, model, eval_examples)
  return collect, evaluate, loader


def with_sampled_evaluation(evaluate, config, model: zoo.Model, eval_examples):
  """`evaluate` (greedy) followed by the evaluation harness's sampled metrics on the same
  held-out questions: config.eval_sampling.k replies a question at its temperature and
  top-p, graded by config.grader; pass@1, pass@k (the unbiased estimator), maj@k and
  mean@k join the record, each with its standard error (evaluation/harness.py)."""
  from jaxrl_agents.evaluation import harness as eval_harness

  sampled = config.eval_sampling
  fmt = eval_harness.TaskFormat(template=config.prompt_template, graders=(config.grader,),
                                system=config.get("system_prompt") or None, chat=config.chat)
  settings = eval_harness.EvalSettings(
      greedy=False, k=sampled.k, temperature=sampled.temperature, top_p=sampled.top_p,
      max_new_tokens=config.max_new_tokens, batch_size=config.eval_batch_size,
      seed=config.seed, grader_time_limit_s=config.get("reward_time_limit_s", 10.0))

  def evaluate_with_samples(params):
    record, samples = evaluate(params)
    result, _ = eval_harness.evaluate(params, model, eval_examples, fmt, settings,
                                      progress=False)
    metrics = result["graders"][config.grader]
    k = sampled.k
    for name, key in (("pass@1", "pass@1"), (f"pass@{k}", "pass@k"), (f"maj@{k}", "maj@k"),
                      (f"mean@{k}", "mean@k")):
      if key not in metrics:
        continue  # maj@k needs the grader's answer reading (harness.READERS)
      record[name] = metrics[key]["mean"]
      record[f"{name}_se"] = metrics[key]["se"]
    record["sampled_eval_time_s"] = result["seconds"]["sampled"]
    return record, samples

  return evaluate_with_samples


COMPILATION_CACHE_NAME = compilation_cache.CACHE_NAME


def enable_compilation_cache(setting: str, workdir: str) -> str | None:
  """Turns on JAX's persistent compilation cache: `setting` is a directory, "auto"
  (COMPILATION_CACHE_NAME in the workdir's parent, shared by the runs there) or "none".
  Returns the directory used, or None. The cache never changes a result: an entry is
  keyed by the program, the compiler flags and the JAX version.

  The directory must be private to this user (train/compilation_cache.py: an entry is
  code the run executes). A named one that is not is an error; under "auto" the run
  uses the user's own cache directory instead, with a warning."""
  if setting == "none":
    return None
  log = logging.getLogger(__name__)
  directory = setting
  if setting == "auto":
    parent = os.path.dirname(os.path.abspath(workdir.rstrip("/")))
    directory = os.path.join(parent, COMPILATION_CACHE_NAME)
  reason = compilation_cache.private_cache_dir(directory)
  if reason and setting != "auto":
    raise ValueError(f"--compilation_cache={setting}: refused, {reason}; a cache entry is a "
                     "program the run executes, so only you may write its directory. Name "
                     "a private directory or pass --compilation_cache=none")
  if reason:
    fallback = compilation_cache.default_private_dir()
    fallback_reason = compilation_cache.private_cache_dir(fallback)
    log.warning("compilation cache: not using %s (%s)%s", directory, reason,
                f"; using {fallback}" if not fallback_reason else
                f"; {fallback} is not private either ({fallback_reason}): caching off")
    if fallback_reason:
      return None
    directory = fallback
  jax.config.update("jax_compilation_cache_dir", directory)
  # Cache every program that took a tenth of a second (the default, 1 s, would skip most
  # of an experiment's many small programs).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  log.info("compilation cache: %s", directory)
  return directory


def main(train_fn, host_memory: str = "system") -> None:
  """The command line of an experiment script: `--config=FILE[:VARIANT] --workdir=DIR`.

  `host_memory` is the `--host_memory` flag's default: "retain" for an experiment whose
  update has large temporaries (jaxrl_agents/train/host_memory.py says when that pays).

  Flags are defined here, at run time, not at import: the experiment modules
  can then be imported together (tests, notebooks) without duplicate flags.
  `lock_config` makes a mistyped `--config.key` an error before anything runs.
  """
  from absl import app, flags
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                           lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, "run directory (resumes if it has checkpoints)")
  cache = flags.DEFINE_string(
      "compilation_cache", "auto", "directory of JAX's persistent compilation cache, shared by "
      "runs: a rerun or a resume loads its programs instead of compiling them. 'auto': "
      f"{COMPILATION_CACHE_NAME}/ beside the workdir; 'none': off")
  host_memory_flag = flags.DEFINE_enum(
      "host_memory", host_memory, ["system", "retain"], "'retain': glibc's malloc keeps "
      "freed memory for reuse (one arena, no mmap, no trimming), so each step does not "
      "fault its temporaries in anew; 'system': glibc's defaults")
  flags.mark_flags_as_required(["config", "workdir"])

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    retain = host_memory_flag.value == "retain"
    retained = retain and host_memory_lib.retain_freed_memory()  # before XLA's threads start
    setup_logging()
    if retain and not retained:
      logging.getLogger(__name__).warning("--host_memory=retain could not be applied (it "
                                          "sets glibc's malloc options)")
    logging.getLogger(__name__).info("host memory: %s",
                                     "freed memory retained" if retained else "system malloc")
    # A model directory or an export given as the workdir is refused before a run writes.
    workdir_lib.check_not_foreign(workdir.value)
    distributed.initialize_from_env()  # several processes, when launched as such
    # Every process started with the same flags, before any of them computes anything.
    distributed.check_same_config(harness.flat_config(config.value))
    enable_compilation_cache(cache.value, workdir.value)
    train_fn(config.value, workdir.value)

  app.run(run)


def _validate_reply_rewards(config) -> None:
  """config.env_reply_rewards: registered host rewards with options they take."""
  spec = dict(config.get("env_reply_rewards", {}))
  learned = [name for name in spec if learned_rewards.is_learned(name)]
  if learned:
    raise ValueError(f"config.env_reply_rewards: {learned} score with a model; an "
                     "environment run's reply rewards are host functions of the replies' text")
  if spec:
    rewards_lib.from_config(spec)  # unknown names and options named


def _validate_episodes(config) -> None:
  """Where the episodes come from: an environment (its name and sizes) or a task's prompts."""
  if config.get("env"):
    registry.get("env", config.env)
    if config.get("max_turns", 1) < 1:
      raise ValueError(f"config.max_turns must be >= 1, got {config.max_turns}")
    if config.get("oversample", 1) != 1:
      raise ValueError("config.oversample draws extra prompts from a dataset; an environment "
                       "run draws its tasks each step: set oversample = 1")
    shaping = config.get("reward_shaping", None)
    if shaping and shaping.name != "none":
      raise ValueError("config.reward_shaping shapes single-turn replies' rewards; an "
                       "environment run's reward is its return: set reward_shaping.name='none'")
    for key in ("env_obs_tokens", "env_step_timeout_s", "env_answer_tokens"):
      if key in config and not config[key] > 0:
        raise ValueError(f"config.{key} must be > 0, got {config[key]}")
    _validate_reply_rewards(config)
  elif config.get("env_reply_rewards"):
    raise ValueError("config.env_reply_rewards scores an environment's episodes; a "
                     "single-turn run's rewards are config.rewards")
  elif not config.task and not config.jsonl_path:
    raise ValueError("set config.task (a registered task), config.jsonl_path or config.env")
  eval_task = config.get("eval_task", "")
  if eval_task and (config.get("env") or config.jsonl_path):
    raise ValueError("config.eval_task replaces config.task's held-out questions; with an "
                     "environment or JSONL data set it to ''")
  if eval_task == "gsm8k" and "gsm_symbolic" in config.task:
    # GSM-Symbolic (Mirzadeh et al. 2024) made its templates from GSM8K test questions:
    # reasoning-gym's generate_0 is the test question "Emily can peel 6 shrimp a minute...".
    raise ValueError("config.task draws reasoning-gym's gsm_symbolic, whose templates are "
                     "GSM8K test questions: GSM8K would not be held out (train on another "
                     "task, or evaluate on gsm_symbolic's own test split)")
  sampled = config.get("eval_sampling", None)
  if sampled is not None:
    k = sampled.get("k", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"config.eval_sampling.k must be 0 (greedy only) or the number of "
                       f"sampled replies a held-out question, got {k!r}")
    if k and config.get("env"):
      raise ValueError("config.eval_sampling samples single-turn replies to held-out "
                       "questions; an environment run evaluates greedy episodes (set k=0)")
    if k and not (sampled.temperature > 0 and 0 < sampled.top_p <= 1):
      raise ValueError(f"config.eval_sampling needs temperature > 0 and top_p in (0, 1], got "
                       f"{sampled.temperature} and {sampled.top_p}")


def _validate_off_policy(config) -> None:
  """The overlap's and the off-policy correction's limits (jaxrl_agents/train/overlap.py)."""
  if config.get("overlap", False):
    overlap.check_supported(config, sharding.for_config(config))
  correction = config.get("off_policy", None)
  if not correction or correction.correction == "none":
    return
  if config.get("top_p", 1.0) < 1.0 or config.get("top_k", 0) > 0:
    # The sampler records log-probs under the truncated distribution, the update scores
    # the untruncated one: every ratio would be the kept mass, not the policies' lag.
    raise ValueError(f"off_policy.correction {correction.correction!r} needs untruncated "
                     f"sampling (top_p=1, top_k=0; got {config.get('top_p')}, "
                     f"{config.get('top_k')}): the ratio to the sampler's log-probs would "
                     "measure the truncation")
  if config.get("policy_loss") == "gspo":
    raise ValueError("off_policy.correction weights tokens; GSPO's ratio is per sequence: "
                     "use correction='none' with gspo")


def init_key(config) -> jax.Array:
  """The key a train state is initialised from (a value head, a critic): a stream of the
  seed's of its own, apart from the steps' keys (which the harness derives from the step)."""
  return jax.random.fold_in(jax.random.key(config.seed), 0x5EED)


def policy_token_budget(config) -> int:
  """The most policy tokens an episode can hold: max_new_tokens per turn, times max_turns for
  an environment run, of which a self-play side (advantage "rae") moves every other ply
  (Dr. GRPO's normalizer; the budget `truncated_frac` compares with)."""
  turns = int(config.get("max_turns", 1)) if config.get("env") else 1
  if config.get("advantage", None) == self_play.ADVANTAGE:
    turns = -(-turns // self_play.PLAYERS)
  return int(config.max_new_tokens) * turns


def objective_settings(config) -> policy_objective_lib.PolicyObjective:
  """The PolicyObjective (objectives/policy_objective.py) of an RL experiment's config."""
  control = config.get("token_control", None)
  correction = config.get("off_policy", None)
  return policy_objective_lib.PolicyObjective(
      policy_loss=config.policy_loss,
      loss_kwargs=policy_objective_lib.loss_hyperparameters(config.policy_loss, config.loss_kwargs),
      aggregation=config.aggregation,
      normalizer=float(policy_token_budget(config)),
      kl=config.kl_estimator,
      kl_on=config.kl_coef > 0,
      entropy_coef=float(config.entropy_coef),
      temperature=float(config.temperature),
      token_control=control.name if control else "none",
      token_control_frac=float(control.frac) if control else 0.0,
      token_control_per_sequence=bool(control.per_sequence) if control else False,
      off_policy_correction=correction.correction if correction else "none",
      off_policy_cap=float(correction.cap) if correction else 2.0)
