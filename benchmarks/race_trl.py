"""The TRL side of the learning race, and transformers-side grading of any policy.

Runs in benchmarks/.venv-trl (benchmarks/setup_trl.sh); benchmarks/learning_race.py
drives it. Two commands:

  race_trl.py train --model HF_DIR --train train.jsonl --eval eval.jsonl --out DIR \
      --budget-s 1800 --eval-every-s 300
  race_trl.py grade --model HF_DIR --eval eval.jsonl      # prints {"accuracy": ...,
                                                            #   "correct": [0/1 per question]}

`train` runs TRL's GRPOTrainer with the race's settings (2 prompts x 8
generations per step, at most 48 new tokens, learning rate 5e-6 constant, no
KL, temperature 1.0; rewards: 1 if the last integer of the reply is the answer,
plus 0.2 for a reply under 40 characters). Training time is the wall-clock of
the trainer's steps with evaluation excluded, the same clock as the project's
`train_time_s`. Held-out accuracy (greedy, last-integer grader) is written to
DIR/evals.jsonl at the start and each time training time crosses a multiple
of --eval-every-s, with each question's verdict (`correct`, in the eval file's
order: the race pairs the two sides' finals question by question); TRL's own
per-step logs go to DIR/train_log.jsonl.

The graders are the project's registered rewards (numpy only), so both sides
grade with the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from jaxrl_agents import registry
from jaxrl_agents import rewards as _rewards  # noqa: F401 - registers the graders

MAX_NEW_TOKENS = 48


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def chat_prompt(tokenizer, question: str) -> str:
  return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples: list[dict], batch_size: int = 32,
                    max_new_tokens: int = MAX_NEW_TOKENS
                    ) -> tuple[float, list[str], list[int]]:
  """(accuracy, replies, each question's 0/1 verdict): greedy replies to each example's
  question through the chat template, graded by last integer."""
  was_training = model.training
  model.eval()
  replies = []
  for i in range(0, len(examples), batch_size):
    chunk = examples[i: i + batch_size]
    encoded = tokenizer([chat_prompt(tokenizer, ex["question"]) for ex in chunk],
                        return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False)
    out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    replies += tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:],
                                      skip_special_tokens=True)
  if was_training:
    model.train()
  correct = np.asarray(registry.get("reward", "last_integer")(replies, examples))
  return float(correct.mean()), replies, [int(c) for c in correct]


def load(model_dir: str):
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  return model, tokenizer


def _texts(completions) -> list[str]:
  # Conversational prompts give completions as [{"role": "assistant", "content": ...}].
  return [c[0]["content"] if isinstance(c, list) else c for c in completions]


def correct_reward(completions, answer, **kwargs) -> list[float]:
  del kwargs
  examples = [{"answer": a} for a in answer]
  return [float(x) for x in registry.get("reward", "last_integer")(_texts(completions), examples)]


def short_reward(completions, **kwargs) -> list[float]:
  texts = _texts(completions)
  return [float(x) for x in registry.get("reward", "short_reply")(texts, [{}] * len(texts))]


def train(args) -> None:
  from datasets import Dataset
  from transformers import TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  torch.manual_seed(args.seed)
  model, tokenizer = load(args.model)
  train_rows = read_jsonl(args.train)
  eval_rows = read_jsonl(args.eval)
  dataset = Dataset.from_list([
      {"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
      for r in train_rows])
  os.makedirs(args.out, exist_ok=True)
  evals_path = os.path.join(args.out, "evals.jsonl")
  log_path = os.path.join(args.out, "train_log.jsonl")
  for path in (evals_path, log_path):
    open(path, "w").close()

  class Clock(TrainerCallback):
    """Training-time budget and timed evaluations (evaluation time excluded)."""

    def __init__(self):
      self.train_time, self.next_eval, self.last = 0.0, args.eval_every_s, None

    def _evaluate(self, model, step):
      t0 = time.perf_counter()
      accuracy, replies, correct = greedy_accuracy(model, tokenizer, eval_rows)
      record = {"step": step, "train_time_s": self.train_time, "accuracy": accuracy,
                "eval_time_s": time.perf_counter() - t0, "sample": replies[:3],
                "correct": correct}
      with open(evals_path, "a") as f:
        f.write(json.dumps(record) + "\n")
      print(f"[trl] step {step} train {self.train_time:.0f}s accuracy {accuracy:.3f}",
            flush=True)

    def on_train_begin(self, args_, state, control, model=None, **kwargs):
      self._evaluate(model, 0)
      self.last = time.perf_counter()

    def on_step_end(self, args_, state, control, model=None, **kwargs):
      self.train_time += time.perf_counter() - self.last
      out_of_time = self.train_time >= args.budget_s
      if out_of_time or self.train_time >= self.next_eval:
        self._evaluate(model, state.global_step)
        while self.next_eval <= self.train_time:
          self.next_eval += args.eval_every_s
      if out_of_time:
        control.should_training_stop = True
      self.last = time.perf_counter()

    def on_log(self, args_, state, control, logs=None, **kwargs):
      with open(log_path, "a") as f:
        f.write(json.dumps({"step": state.global_step, "train_time_s": self.train_time,
                            **(logs or {})}) + "\n")

  config = GRPOConfig(
      output_dir=os.path.join(args.out, "trainer"), learning_rate=5e-6,
      lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=1.0,
      num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=1,
      max_completion_length=MAX_NEW_TOKENS, max_steps=1_000_000, logging_steps=1,
      save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=args.seed,
      reward_weights=[1.0, 0.2], disable_tqdm=True, dataloader_num_workers=0,
      # TRL turns activation checkpointing on by default; with 24 GB for a 135M
      # model it only costs time, so the baseline runs without it.
      gradient_checkpointing=False)
  trainer = GRPOTrainer(model=model, reward_funcs=[correct_reward, short_reward], args=config,
                        train_dataset=dataset, processing_class=tokenizer,
                        callbacks=[Clock()])
  trainer.train()
  if args.save_final:
    trainer.save_model(os.path.join(args.out, "final"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  t = sub.add_parser("train")
  t.add_argument("--model", required=True)
  t.add_argument("--train", required=True)
  t.add_argument("--eval", required=True)
  t.add_argument("--out", required=True)
  t.add_argument("--budget-s", type=float, default=1800.0)
  t.add_argument("--eval-every-s", type=float, default=300.0)
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  t.add_argument("--save-final", action="store_true")
  g = sub.add_parser("grade")
  g.add_argument("--model", required=True)
  g.add_argument("--eval", required=True)
  g.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  if args.command == "train":
    train(args)
  else:
    model, tokenizer = load(args.model)
    accuracy, replies, correct = greedy_accuracy(model, tokenizer, read_jsonl(args.eval))
    print(json.dumps({"accuracy": accuracy, "sample": replies[:3], "correct": correct}))


if __name__ == "__main__":
  main()
