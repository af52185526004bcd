"""Export a model as a Hugging Face directory that transformers and vLLM load.

  python -m jaxrl_agents.export --model smollm2-135m-instruct --out /tmp/smollm2_hf

Writes config.json, model.safetensors (float32) and the tokenizer files.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxrl_agents.models import checkpoints, zoo


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_agents.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=zoo.DEFAULT_MODEL,
                 help="preset name, Hugging Face directory or .gguf file")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(message)s")
  if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
    raise SystemExit(f"--out {args.out!r} exists and is not empty; pass --overwrite")
  model = zoo.load(args.model)
  checkpoints.save_hf_dir(model.params, model.cfg, args.out, tokenizer=model.tokenizer)
  logging.info("wrote %s as a Hugging Face directory to %s", model.name, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
