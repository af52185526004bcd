"""Generate a completion from the command line.

  python -m jaxrl_agents.tools.generate --model smollm2-135m-instruct \
      --prompt "What is 7 times 8?" --max-new-tokens 64

Applies the chat template unless --no-chat; greedy unless --temperature > 0.
Only the completion text goes to stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxrl_agents.models import zoo


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_agents.tools.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=zoo.DEFAULT_MODEL,
                 help="preset name, Hugging Face directory or .gguf file")
  p.add_argument("--prompt", required=True, action="append",
                 help="prompt text; repeat the flag for a batch (one completion per line)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--min-p", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--system", default=None, help="optional system message")
  p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                 help="apply the tokenizer's chat template (default on)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(message)s")
  import jax

  from jaxrl_agents.rollout.sampler import Sampler

  start = time.time()
  model = zoo.load(args.model, dtype=args.dtype)
  num_params = sum(leaf.size for leaf in jax.tree.leaves(model.params))
  logging.info("loaded %s (%.1fM params) in %.1fs", model.name, num_params / 1e6,
               time.time() - start)
  context = model.cfg.max_seq_len
  if not 1 <= args.max_new_tokens < context:
    raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: must be at least 1 and leave "
                     f"room for the prompt in {model.name}'s context of {context} tokens")
  sampler = Sampler(model, chat=args.chat, system=args.system)
  start = time.time()
  texts, out = sampler(args.prompt, rng=jax.random.key(args.seed),
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
  elapsed = time.time() - start
  logging.info("generated %d tokens in %.1fs (including compilation)", int(out.lengths.sum()),
               elapsed)
  for text in texts:
    print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
