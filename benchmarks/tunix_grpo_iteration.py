"""tunix's GRPOLearner on SmolLM2 weights, timed per iteration; run inside benchmarks/.venv-tunix.

Called by benchmarks/grpo_iteration.py (not a project dependency):

  benchmarks/.venv-tunix/bin/python benchmarks/tunix_grpo_iteration.py --hf-dir DIR \
      --batches batches.json --steps 6

`batches.json` holds the prompts (chat-templated text) and answers of each
step. tunix's llama3 model with its vanilla rollout engine, a frozen reference
model (beta 0.04), AdamW, `num_generations` completions per prompt of at most
`max_tokens_to_generate` tokens: the configuration of tunix's GRPO examples at
the benchmark's sizes. The reward is the last integer of the reply against the
answer, the same Python function as the project's side.

An iteration's time is the interval between two reads of the next batch by the
learner (tunix reads step t + 1's batch after finishing step t: rollout,
reference and policy log-probabilities, advantages, one update). The first
interval runs from the call of `train` and includes its compilation.
Prints one JSON object on its last line.
"""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tunix_sampler import model_config

_INT = re.compile(r"-?\d+")


def last_integer_reward(prompts, completions, answer, **kwargs):
  """1 when the reply's last integer is the answer, else 0 (both sides use this)."""
  del prompts, kwargs
  rewards = []
  for text, want in zip(completions, answer, strict=True):
    found = _INT.findall(text[-2000:])
    rewards.append(1.0 if found and int(found[-1]) == int(want) else 0.0)
  return rewards


class TimedBatches:
  """The steps' batches, noting the time each is read."""

  def __init__(self, batches):
    self.batches, self.reads = batches, []

  def __iter__(self):
    for batch in self.batches:
      self.reads.append(time.perf_counter())
      yield batch
    self.reads.append(time.perf_counter())


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--hf-dir", required=True)
  ap.add_argument("--batches", required=True)
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--generations", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--max-prompt-length", type=int, default=64)
  ap.add_argument("--learning-rate", type=float, default=1e-6)
  ap.add_argument("--beta", type=float, default=0.04)
  args = ap.parse_args()

  from transformers import AutoTokenizer
  from tunix.models.llama3 import params as params_lib
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  load_start = time.perf_counter()
  cfg = model_config(args.hf_dir)
  actor = params_lib.create_model_from_safe_tensors(args.hf_dir, cfg, dtype=jnp.float32)
  reference = params_lib.create_model_from_safe_tensors(args.hf_dir, cfg, dtype=jnp.float32)
  tok = AutoTokenizer.from_pretrained(args.hf_dir)
  load_s = time.perf_counter() - load_start

  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  role = rl_cluster_lib.Role
  training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(args.learning_rate, b1=0.9, b2=0.999, weight_decay=0.0),
      eval_every_n_steps=10_000, max_steps=args.steps)
  rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=args.max_new_tokens, max_prompt_length=args.max_prompt_length,
      kv_cache_size=args.max_prompt_length + args.max_new_tokens + 32, temperature=0.9,
      top_p=1.0, top_k=None, eos_tokens=[tok.eos_token_id])
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=tok,
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={role.ACTOR: mesh, role.REFERENCE: mesh, role.ROLLOUT: mesh},
          rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
          rollout_config=rollout))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[last_integer_reward],
      algo_config=grpo_learner.GRPOConfig(num_generations=args.generations, num_iterations=1,
                                          beta=args.beta, epsilon=0.2))
  with open(args.batches) as f:  # numpy string arrays, as tunix's grain pipelines give them
    batches = [{k: np.asarray(v) for k, v in b.items()} for b in json.load(f)[: args.steps]]
  data = TimedBatches(batches)
  start = time.perf_counter()
  learner.train(data)
  end = time.perf_counter()
  # reads[0] is the first batch, taken before step 1 runs; reads[i] follows step i. The
  # learner stops after max_steps without asking for more: the last step ends with train.
  marks = [start] + data.reads[1:len(batches)] + [end]
  step_s = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
  print(json.dumps({"system": "tunix", "load_s": load_s, "step_s": step_s,
                    "train_s": end - start, "steps": len(batches),
                    "jax": jax.__version__, "devices": str(jax.devices())}))


if __name__ == "__main__":
  main()
