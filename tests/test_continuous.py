"""Continuous batching against the static sampler and against each sequence alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.rollout import continuous
from jaxrl_agents.rollout import sampler as sampler_lib

# Prompts of different lengths; budgets from 1 to the longest reply, so slots refill at
# different steps and the ring's write index wraps several times.
PROMPTS = [[5, 9, 14, 20, 31], [7, 3], [100, 101, 102, 103], [8], [40, 41, 42, 43, 44, 45],
           [60, 61], [70, 71, 72], [90, 91, 92, 93, 94]]
BUDGETS = [12, 3, 7, 1, 12, 5, 9, 2]
WIDTH = 12


def _encoded():
  tokens, mask = tokenizer_lib.pad_left(PROMPTS, pad_id=0, length=8)
  return jnp.asarray(tokens), jnp.asarray(mask)


def _continuous(model, sampling, slots, budgets=BUDGETS, keys=None):
  tokens, mask = _encoded()
  keys = jax.random.split(jax.random.key(7), len(PROMPTS)) if keys is None else keys
  return continuous.generate(model.params, model.cfg, tokens, mask, keys, sampling,
                             slots=slots, max_new_tokens=jnp.asarray(budgets, jnp.int32))


def test_greedy_equals_the_static_batch_cut_at_each_budget(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  static = sampler_lib.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                                jax.random.key(0), sampling)
  for slots in (3, len(PROMPTS)):
    out = _continuous(tiny_model, sampling, slots)
    assert np.asarray(out.lengths).tolist() == BUDGETS, slots
    for i, n in enumerate(BUDGETS):
      got, want = np.asarray(out.tokens[i]), np.asarray(static.tokens[i])
      assert got[:n].tolist() == want[:n].tolist(), (slots, i)
      assert (got[n:] == 0).all()  # padding after the budget
      np.testing.assert_allclose(np.asarray(out.logprobs[i, :n]),
                                 np.asarray(static.logprobs[i, :n]), atol=2e-5)
      assert np.asarray(out.mask[i]).sum() == n


def test_a_stop_token_ends_a_sequence_and_its_slot_takes_the_next(tiny_model):
  # The static batch's greedy tokens; make the 3rd token of prompt 0 a stop token.
  free = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  static = np.asarray(sampler_lib.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                                           jax.random.key(0), free).tokens)
  stop = int(static[0, 2])
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(stop,), pad_id=0)
  out = _continuous(tiny_model, sampling, slots=2, budgets=[WIDTH] * len(PROMPTS))
  for i in range(len(PROMPTS)):
    row = static[i].tolist()
    n = row.index(stop) + 1 if stop in row else WIDTH  # up to and with the stop token
    assert int(out.lengths[i]) == n, i
    assert np.asarray(out.tokens[i, :n]).tolist() == row[:n], i


def test_sampled_sequences_do_not_depend_on_their_slot_or_neighbours(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, temperature=1.0, stop_tokens=(),
                                        pad_id=0)
  alone = _continuous(tiny_model, sampling, slots=1)
  for slots in (3, len(PROMPTS)):
    out = _continuous(tiny_model, sampling, slots)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(alone.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(alone.logprobs), atol=2e-5)
  # Each sequence's own key decides its tokens: another key, other samples.
  other = _continuous(tiny_model, sampling, slots=3,
                      keys=jax.random.split(jax.random.key(8), len(PROMPTS)))
  assert (np.asarray(other.tokens) != np.asarray(alone.tokens)).any()


def test_bad_arguments_are_refused_clearly(tiny_model):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=4, stop_tokens=(), pad_id=0)
  with pytest.raises(ValueError, match=r"slots must be in \[1, 8\]"):
    _continuous(tiny_model, sampling, slots=9)
  compact = sampler_lib.SamplingConfig(max_new_tokens=4, stop_tokens=(), pad_id=0,
                                       compact_min_rows=2)
  with pytest.raises(ValueError, match="compact_min_rows is the static batch's"):
    _continuous(tiny_model, compact, slots=2)


def test_evaluation_through_continuous_batching_equals_static_batches(tiny_model):
  from experiments import common
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.rollout import single_turn

  config = grpo_arithmetic.get_config("tiny")
  _, eval_examples = common.task_examples(config)
  reward_fn, grader = common.make_rewards(config)
  kw = dict(batch_size=4, max_new_tokens=config.max_new_tokens,
            template=config.prompt_template, chat=config.chat,
            system=config.get("system_prompt") or None, reward_fn=reward_fn, grader=grader)
  examples = list(eval_examples[:6])
  static, static_samples = single_turn.evaluate(tiny_model.params, tiny_model, examples, **kw)
  cont, cont_samples = single_turn.evaluate(tiny_model.params, tiny_model, examples,
                                            continuous_slots=3, **kw)
  assert [s["completion"] for s in cont_samples] == [s["completion"] for s in static_samples]
  assert cont["accuracy"] == static["accuracy"]
  assert cont["num_examples"] == static["num_examples"] == 6


def test_a_tiny_grpo_run_samples_through_continuous_batching(tmp_path):
  from experiments import grpo
  from experiments.configs import grpo_arithmetic
  from jaxrl_agents.train import metrics as metrics_lib

  config = grpo_arithmetic.get_config("tiny")
  config.steps, config.continuous_slots = 2, 4
  grpo.train(config, str(tmp_path / "run"), progress=False)
  records = metrics_lib.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2]
  assert all(np.isfinite(r["loss"]) for r in train)
  assert any(r["kind"] == "eval" for r in records)
  config.compact_min_rows = 2
  with pytest.raises(ValueError, match="continuous_slots and config.compact_min_rows"):
    grpo.train(config, str(tmp_path / "both"), progress=False)
  config.compact_min_rows, config.continuous_slots = 0, -1
  with pytest.raises(ValueError, match="continuous_slots must be 0"):
    grpo.train(config, str(tmp_path / "negative"), progress=False)


def test_slots_that_finish_together_with_fewer_sequences_queued(tiny_model):
  # Sequences 0 and 1 finish at the same step with only sequence 2 queued: one slot takes
  # it, the other must stop (not go on decoding the sequence it had).
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  tokens, mask = tokens[:3], mask[:3]
  out = continuous.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                            jax.random.split(jax.random.key(0), 3), sampling, slots=2,
                            max_new_tokens=jnp.asarray([2, 2, 5], jnp.int32))
  assert np.asarray(out.lengths).tolist() == [2, 2, 5]
  static = sampler_lib.generate(tiny_model.params, tiny_model.cfg, tokens, mask,
                                jax.random.key(0), sampling)
  for i, n in enumerate([2, 2, 5]):
    assert np.asarray(out.tokens[i, :n]).tolist() == np.asarray(static.tokens[i, :n]).tolist()
    assert (np.asarray(out.tokens[i, n:]) == 0).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_samples_per_prompt_equals_repeating_each_prompt(tiny_model, temperature):
  sampling = sampler_lib.SamplingConfig(max_new_tokens=WIDTH, temperature=temperature,
                                        stop_tokens=(), pad_id=0)
  tokens, mask = _encoded()
  tokens, mask, g = tokens[:3], mask[:3], 3
  keys = jax.random.split(jax.random.key(5), 3 * g)
  budgets = jnp.asarray([4, 12, 2, 7, 1, 12, 3, 5, 9], jnp.int32)
  run = lambda t, m, **kw: continuous.generate(tiny_model.params, tiny_model.cfg, t, m, keys,
                                               sampling, slots=4, max_new_tokens=budgets, **kw)
  shared = run(tokens, mask, samples_per_prompt=g)
  repeated = run(jnp.repeat(tokens, g, 0), jnp.repeat(mask, g, 0))
  np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(repeated.tokens))
  np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(repeated.logprobs),
                             atol=2e-5)
  assert np.asarray(shared.lengths).tolist() == np.asarray(budgets).tolist()
