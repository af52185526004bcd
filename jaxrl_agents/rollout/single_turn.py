"""One-turn rollouts: task examples -> prompts -> tokens -> sampled completions -> Trajectory.

The K = 1 case of a rollout: the prompt, then one completion. Sampling is
kept apart from rewarding: `sample` returns the episodes with zero rewards,
and the caller scores the decoded completions (`types.with_outcome`), so
evaluation and training share this path and only training pays for rewards.
"""

from __future__ import annotations

import dataclasses
import functools
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agents import types
from jaxrl_agents.data.loader import padded_batches
from jaxrl_agents.data.prompts import format_prompts
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.objectives import credit
from jaxrl_agents.parallel import distributed, sharding
from jaxrl_agents.rewards import time_limit
from jaxrl_agents.rollout import continuous, shapes
from jaxrl_agents.rollout import sampler as sampler_lib
from jaxrl_agents.types import Collect, RewardFn, Rollout

MIN_REPLY_WIDTH = 8  # the narrowest trimmed reply width (`trimmed_width`)


@dataclasses.dataclass
class Samples:
  """Sampled episodes with their text.

  Attributes:
    traj: the Trajectory (device arrays), B = P * G rows, prompt-major, its
      columns after the prompt trimmed to `trimmed_width`; rewards zero.
    examples: the B task examples (each prompt's repeated G times).
    prompts: the B user messages.
    completions: the B decoded completions.
    prompts_truncated: bool[P] which unique prompts were shortened to fit the context
      (overflow "truncate").
  """

  traj: types.Trajectory
  examples: list[Mapping[str, Any]]
  prompts: list[str]
  completions: list[str]
  prompts_truncated: np.ndarray | None = None


# What happens to a prompt that leaves too little context for the completion
# budget: "error" stops with a message naming it, "truncate" drops tokens from
# the start of its longest message content (the chat template's tokens stay)
# and counts it in the metrics.
PROMPT_OVERFLOW = ("error", "truncate")


def fit_prompt(ids: list[int], spans: Sequence[tuple[int, int]], limit: int, overflow: str,
               index: int) -> tuple[list[int], bool]:
  """(ids of at most `limit` tokens, whether it was shortened) of one encoded prompt."""
  if overflow not in PROMPT_OVERFLOW:
    raise ValueError(f"prompt_overflow must be one of {PROMPT_OVERFLOW}, got {overflow!r}")
  if len(ids) <= limit:
    return ids, False
  excess = len(ids) - limit
  start, end = max(spans, key=lambda se: se[1] - se[0], default=(0, 0))
  too_long = (f"prompt {index} has {len(ids)} tokens; with the completion budget it needs more "
              f"than the model's context allows ({limit} prompt tokens at most)")
  if overflow == "error":
    raise ValueError(f"{too_long}. Shorten it, lower max_new_tokens, or set "
                     "prompt_overflow='truncate'")
  if end - start < excess:
    raise ValueError(f"{too_long}, and cutting its longest message ({end - start} tokens) "
                     f"cannot remove {excess}: shorten the system prompt or the template, or "
                     "lower max_new_tokens")
  return ids[:start] + ids[start + excess:], True


def template_ids(tokenizer, template: str, example: Mapping[str, Any]
                 ) -> tuple[list[int], list[tuple[int, int]]]:
  """(ids, [start, end) span of each field) of a raw (chat=False) prompt.

  The template is the experiment's own text and may hold control tokens (a
  hand-written chat format for a base model); the example's fields are data,
  encoded as plain text (`tokenizer.plain_ids`).
  """
  formatter = string.Formatter()
  ids, spans = [], []
  for literal, field, spec, conversion in formatter.parse(template):
    if literal:
      ids += tokenizer.encode(literal, add_special_tokens=False)
    if field is None:
      continue
    value = formatter.convert_field(formatter.get_field(field, (), example)[0], conversion)
    spec = formatter.vformat(spec, (), example) if spec else ""  # "{x:>{width}}" nests
    content = tokenizer_lib.plain_ids(tokenizer, formatter.format_field(value, spec))
    spans.append((len(ids), len(ids) + len(content)))
    ids += content
  return ids, spans


def _fit_all(rows, limit: int | None, overflow: str, pad_id: int, min_width: int = 0):
  ids, truncated = [], []
  for i, (row, spans) in enumerate(rows):
    if limit is not None:
      row, cut = fit_prompt(row, spans, limit, overflow, i)
    else:
      cut = False
    ids.append(row)
    truncated.append(cut)
  return (*_pad_prompts(ids, pad_id, min_width), np.asarray(truncated, bool))


def encode(tokenizer, prompts: Sequence[str], *, chat: bool, system: str | None,
           limit: int | None = None, overflow: str = "error", min_width: int = 0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-padded int32[B, Lp] tokens and mask of prompt strings (Lp: `shapes.prompt_width`
  of the longest, at least `min_width`), and bool[B] which were truncated to `limit` tokens
  (PROMPT_OVERFLOW). The strings are data: special-token text in them stays text."""
  rows = [tokenizer_lib.encode_chat(tokenizer, p, system) if chat
          else (ids := tokenizer_lib.plain_ids(tokenizer, p), [(0, len(ids))]) for p in prompts]
  return _fit_all(rows, limit, overflow, tokenizer.pad_token_id, min_width)


def encode_examples(tokenizer, examples: Sequence[Mapping[str, Any]], template: str, *,
                    chat: bool, system: str | None, limit: int | None = None,
                    overflow: str = "error", min_width: int = 0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`encode` of task examples through the prompt template: with chat, the formatted
  message is the user turn's content; without, the template's text keeps its markup and
  only the fields are plain text (`template_ids`)."""
  if chat:
    return encode(tokenizer, format_prompts(examples, template), chat=True, system=system,
                  limit=limit, overflow=overflow, min_width=min_width)
  format_prompts(examples, template)  # names a missing field
  rows = [template_ids(tokenizer, template, ex) for ex in examples]
  return _fit_all(rows, limit, overflow, tokenizer.pad_token_id, min_width)


def context_limit(model: zoo.Model, max_new_tokens: int) -> int:
  """The most prompt tokens that leave room for `max_new_tokens` in the model's context."""
  return model.cfg.max_seq_len - max_new_tokens


def _pad_prompts(ids: list[list[int]], pad_id: int, min_width: int = 0):
  width = shapes.prompt_width(max(max(len(s) for s in ids), min_width))
  return tokenizer_lib.pad_left(ids, pad_id, width)


def split_for_sampling(tokens: np.ndarray, mask: np.ndarray, pad_id: int,
                       min_width: int = 0) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
  """(shared prefix or None, suffix tokens, suffix mask) of `encode`'s prompts for `generate`.

  The chat template's system prompt starts every prompt: the sampler prefills
  it once for the batch (`prefix_tokens`) and the rows only their own part. With
  `min_width` (`encode`'s), the suffixes fill the prompts' width less the prefix: a
  fixed prompt width gives the sampler one shape per prefix length.
  """
  ids = [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]
  prefix, suffixes = sampler_lib.split_shared_prefix(ids)
  if not prefix:
    return None, tokens, mask
  suffix_width = tokens.shape[1] - len(prefix) if min_width else 0
  return np.asarray(prefix, np.int32), *_pad_prompts(suffixes, pad_id, suffix_width)


def trimmed_width(lengths: np.ndarray, max_new_tokens: int,
                  minimum: int = MIN_REPLY_WIDTH) -> int:
  """Completion columns the update needs: the longest completion, bucketed to a power of two.

  The update costs in proportion to prompt + completion columns; short replies
  in a 48-token budget would otherwise pay for 48. Power-of-two buckets keep
  the number of update shapes (compilations) to a handful.
  """
  return min(max_new_tokens, shapes.power_of_two(int(np.max(lengths)), minimum=minimum))


def _encode_for_sampling(model: zoo.Model, examples, sampling: sampler_lib.SamplingConfig,
                         template: str, chat: bool, system: str | None, overflow: str,
                         min_width: int = 0):
  """`encode_examples` with the prompts fitted to leave room for the reply budget."""
  return encode_examples(model.tokenizer, examples, template, chat=chat, system=system,
                         limit=context_limit(model, sampling.max_new_tokens), overflow=overflow,
                         min_width=min_width)


def likely_trajectory(model: zoo.Model, examples: Sequence[Mapping[str, Any]], *,
                      group_size: int, sampling: sampler_lib.SamplingConfig, template: str,
                      chat: bool, system: str | None, overflow: str = "error",
                      min_prompt_width: int = 0) -> types.Trajectory:
  """The shapes (`jax.ShapeDtypeStruct`s) `sample`'s trajectory will most likely have, before
  sampling: the prompts' width, and the whole reply budget (an untrained policy's longest
  reply in a group usually reaches it). What the update can compile for ahead of time
  (`precompile.py`)."""
  tokens, _, _ = _encode_for_sampling(model, examples, sampling, template, chat, system,
                                      overflow, min_prompt_width)
  rows, n = len(examples) * group_size, sampling.max_new_tokens
  spec = lambda width, dtype: jax.ShapeDtypeStruct((rows, width), dtype)
  return jax.eval_shape(types.single_turn, spec(tokens.shape[1], jnp.int32),
                        spec(tokens.shape[1], jnp.bool_), spec(n, jnp.int32),
                        spec(n, jnp.bool_), spec(n, jnp.float32))


def sample(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], rng: jax.Array, *,
           group_size: int, sampling: sampler_lib.SamplingConfig, template: str, chat: bool,
           system: str | None, overflow: str = "error", continuous_slots: int = 0,
           min_prompt_width: int = 0) -> Samples:
  """Samples `group_size` completions per example (one prefill per example).

  Rows are example-major: rows [i * G, (i + 1) * G) are example i's group.
  Prompts are checked against the model's context first (`overflow`: PROMPT_OVERFLOW),
  and padded to at least `min_prompt_width` columns (one compiled shape for prompts of
  several lengths).
  `continuous_slots` > 0: the rows decode that many at a time through continuous
  batching (`rollout/continuous.py`), each row drawing from its own key, a row that is
  done making room for the next.
  """
  unique_prompts = format_prompts(examples, template)
  unique_tokens, unique_mask, truncated = _encode_for_sampling(
      model, examples, sampling, template, chat, system, overflow, min_prompt_width)
  if continuous_slots:
    out = _sample_continuous(params, model, unique_tokens, unique_mask, rng, group_size,
                             sampling, continuous_slots)
  else:
    prefix, gen_tokens, gen_mask = split_for_sampling(unique_tokens, unique_mask,
                                                      model.tokenizer.pad_token_id,
                                                      min_prompt_width)
    # On a mesh the prompts' rows split over data x fsdp like the params' batch (each
    # device samples its share; jit propagates the layout to the completions).
    gen_tokens, gen_mask = sharding.shard_batch((gen_tokens, gen_mask),
                                                sharding.mesh_of(params))
    out = sampler_lib.generate(params, model.cfg, jnp.asarray(gen_tokens),
                               jnp.asarray(gen_mask), rng, sampling,
                               samples_per_prompt=group_size,
                               prefix_tokens=None if prefix is None else jnp.asarray(prefix))
  host_tokens, lengths = distributed.to_host(out.tokens), distributed.to_host(out.lengths)
  n = trimmed_width(lengths, sampling.max_new_tokens)
  traj = types.single_turn(
      jnp.asarray(np.repeat(unique_tokens, group_size, axis=0)),
      jnp.asarray(np.repeat(unique_mask, group_size, axis=0)),
      out.tokens[:, :n], out.mask[:, :n], out.sampling_logprobs[:, :n])
  return Samples(
      traj=traj,
      examples=[ex for ex in examples for _ in range(group_size)],
      prompts=[p for p in unique_prompts for _ in range(group_size)],
      completions=tokenizer_lib.decode_completions(model.tokenizer, host_tokens, lengths,
                                                   sampling.stop_tokens),
      prompts_truncated=truncated)


def _sample_continuous(params, model: zoo.Model, tokens: np.ndarray, mask: np.ndarray,
                       rng: jax.Array, group_size: int, sampling: sampler_lib.SamplingConfig,
                       slots: int) -> sampler_lib.SampleOutput:
  """`sample`'s completions through `continuous.generate`: one device (its refills move
  rows between slots, which a mesh would move between devices)."""
  mesh = sharding.mesh_of(params)
  if mesh is not None and mesh.size > 1:
    raise ValueError(f"continuous_slots={slots} decodes on one device; the policy is on a "
                     f"mesh of {mesh.size} devices (set continuous_slots=0)")
  rows = len(tokens) * group_size
  return continuous.generate(
      params, model.cfg, jnp.asarray(tokens), jnp.asarray(mask), jax.random.split(rng, rows),
      dataclasses.replace(sampling, compact_min_rows=0), slots=min(slots, rows),
      samples_per_prompt=group_size)


# ----------------------------------------------------------------------------
# The single-turn collector: prompts -> rewarded replies (a types.Rollout), and greedy
# evaluation of held-out prompts.


def rollout(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], rng: jax.Array, *,
            group_size: int, sampling: sampler_lib.SamplingConfig, template: str, chat: bool,
            system: str | None, reward_fn: RewardFn,
            grader: Callable[[Sequence[str], Sequence[Mapping]], np.ndarray],
            overflow: str = "error", continuous_slots: int = 0,
            min_prompt_width: int = 0) -> Rollout:
  """`single_turn.sample`, then the rewards and the grader's verdicts of the completions."""
  s = sample(params, model, examples, rng, group_size=group_size, sampling=sampling,
             template=template, chat=chat, system=system, overflow=overflow,
             continuous_slots=continuous_slots, min_prompt_width=min_prompt_width)
  total, components = reward_fn(s.completions, s.examples)
  total = np.asarray(total, np.float32)
  return Rollout(traj=types.with_outcome(s.traj, total), examples=s.examples, prompts=s.prompts,
                 completions=s.completions, rewards=total,
                 components={k: np.asarray(v, np.float32) for k, v in components.items()},
                 correct=np.asarray(grader(s.completions, s.examples), np.float32),
                 prompts_truncated=int(s.prompts_truncated.sum()))


def par_shaped(r: Rollout, reference_rewards: np.ndarray, group_size: int) -> Rollout:
  """The rollout with PAR-shaped rewards: mean_m sigmoid(r - r_ref_m) over M reference replies.

  "Reward Shaping to Mitigate Reward Hacking in RLHF" (Preference As Reward,
  `credit.par_sigmoid_shaping`): the RL reward is the win probability against
  replies of the reference policy to the same prompt, bounded in (0, 1) and
  centred on the reference. The raw total is kept as the component "unshaped".

  Args:
    r: the rollout (groups of `group_size` rows per prompt).
    reference_rewards: f32[P, M] total rewards of M reference replies per prompt.
    group_size: G.
  """
  refs = np.repeat(np.asarray(reference_rewards, np.float32), group_size, axis=0)
  shaped = np.asarray(credit.par_sigmoid_shaping(jnp.asarray(r.rewards), jnp.asarray(refs)))
  return dataclasses.replace(r, traj=types.with_outcome(r.traj, shaped), rewards=shaped,
                             components={**r.components, "unshaped": r.rewards})


def sampling_from_config(config, tok, greedy: bool = False) -> sampler_lib.SamplingConfig:
  """The rollouts' SamplingConfig (config.max_new_tokens, temperature, top_p, top_k,
  compact_min_rows), or with greedy the evaluation's (temperature 0)."""
  stop, pad = tokenizer_lib.stop_token_ids(tok), tok.pad_token_id
  compact = config.get("compact_min_rows", 0)
  if greedy:
    return sampler_lib.SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=0.0,
                                      stop_tokens=stop, pad_id=pad, compact_min_rows=compact)
  return sampler_lib.SamplingConfig(
      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
      top_p=config.get("top_p", 1.0), top_k=config.get("top_k", 0), stop_tokens=stop,
      pad_id=pad, compact_min_rows=compact)


def single_turn_collector(config, model: zoo.Model, *, reward_fn: RewardFn, grader,
                          eval_examples: Sequence[Mapping[str, Any]]
                          ) -> tuple[Collect, Callable[[Any], tuple[dict, list[dict]]] | None]:
  """(collect, evaluate) of a single-turn task: prompts from the data, rewarded replies,
  optionally PAR-shaped (config.reward_shaping); greedy evaluation on `eval_examples`."""
  sampling = sampling_from_config(config, model.tokenizer)
  prompt_kwargs = dict(template=config.prompt_template, chat=config.chat,
                       system=config.get("system_prompt") or None,
                       overflow=config.get("prompt_overflow", "error"),
                       min_prompt_width=config.get("min_prompt_width", 0))
  shaping = config.get("reward_shaping", None)
  # PAR's references come from the initial policy, kept apart: the train state
  # may donate (and so delete) the initial params at its first update.
  par_references = shaping.references if shaping and shaping.name == "par" else 0
  reference_params = jax.tree.map(jnp.copy, model.params) if par_references else None

  slots = config.get("continuous_slots", 0)

  def collect(params, examples, rng):
    r = rollout(params, model, examples, rng, group_size=config.group_size, sampling=sampling,
                reward_fn=reward_fn, grader=grader, continuous_slots=slots, **prompt_kwargs)
    reward_timeouts = time_limit.timeouts(reward_fn)  # completions scored 0 for running over
    if par_references:
      ref = sample(reference_params, model, examples, jax.random.fold_in(rng, 7),
                               group_size=par_references, sampling=sampling, **prompt_kwargs)
      ref_total, _ = reward_fn(ref.completions, ref.examples)
      reward_timeouts += time_limit.timeouts(reward_fn)
      r = par_shaped(r, np.reshape(ref_total, (len(examples), par_references)),
                     config.group_size)
    return r, {"reward_timeouts": reward_timeouts}

  collect.likely_trajectory = functools.partial(
      likely_trajectory, model, group_size=config.group_size, sampling=sampling,
      **prompt_kwargs)

  def run_eval(params):
    return evaluate(params, model, eval_examples, batch_size=config.eval_batch_size,
                    max_new_tokens=config.max_new_tokens, reward_fn=reward_fn, grader=grader,
                    compact_min_rows=config.get("compact_min_rows", 0),
                    continuous_slots=slots, **prompt_kwargs)

  return collect, run_eval if eval_examples else None


def evaluate(params, model: zoo.Model, examples: Sequence[Mapping[str, Any]], *,
             batch_size: int, max_new_tokens: int, template: str, chat: bool,
             system: str | None, reward_fn: RewardFn, grader, overflow: str = "error",
             compact_min_rows: int = 0, continuous_slots: int = 0,
             min_prompt_width: int = 0) -> tuple[dict, list[dict]]:
  """Greedy completions of held-out examples: accuracy, rewards, lengths; and the samples.
  `compact_min_rows`: the SamplingConfig's (decoding goes on with the unfinished rows).
  `continuous_slots` > 0: every example in one queue through that many slots
  (`rollout/continuous.py`), not in batches of `batch_size`."""
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=max_new_tokens, temperature=0.0,
      stop_tokens=tokenizer_lib.stop_token_ids(model.tokenizer),
      pad_id=model.tokenizer.pad_token_id, compact_min_rows=compact_min_rows)
  if continuous_slots:  # one queue
    s = sample(params, model, list(examples), jax.random.key(0), group_size=1,
               sampling=sampling, template=template, chat=chat, system=system,
               overflow=overflow, continuous_slots=continuous_slots,
               min_prompt_width=min_prompt_width)
    completions, used = s.completions, list(examples)
    prompts_truncated = int(s.prompts_truncated.sum())
  else:
    completions, used, prompts_truncated = [], [], 0
    for _, n, padded in padded_batches(examples, batch_size):
      s = sample(params, model, padded, jax.random.key(0), group_size=1,
                 sampling=sampling, template=template, chat=chat, system=system,
                 overflow=overflow, min_prompt_width=min_prompt_width)
      completions += s.completions[:n]
      used += padded[:n]
      prompts_truncated += int(s.prompts_truncated[:n].sum())  # not the padding
  total, components = reward_fn(completions, used)
  timeouts = time_limit.timeouts(reward_fn)
  correct = np.asarray(grader(completions, used), np.float32)
  result = {"accuracy": float(correct.mean()), "reward_mean": float(np.mean(total)),
            "response_chars": float(np.mean([len(c) for c in completions])),
            "num_examples": len(used), "reward_timeouts": timeouts,
            "prompts_truncated": prompts_truncated}
  for name, values in components.items():
    result[f"reward/{name}_mean"] = float(np.mean(values))
  samples = [{"prompt": prompt, "completion": c, "answer": ex.get("answer"),
              "reward": float(total[i]), "correct": float(correct[i]),
              **{f"reward/{n}": float(v[i]) for n, v in components.items()}}
             for i, (prompt, ex, c) in enumerate(zip(format_prompts(used, template),
                                                     used,
                                                     completions, strict=True))]
  return result, samples
