"""Export a model as a Hugging Face directory that transformers and vLLM load.

  python -m jaxrl_agents.tools.export --model smollm2-135m-instruct --out /tmp/smollm2_hf
  python -m jaxrl_agents.tools.export --workdir runs/grpo_arithmetic --out /tmp/trained_hf
  python -m jaxrl_agents.tools.export --workdir runs/grpo_lora --out /tmp/merged_hf \
      --adapters /tmp/peft_adapters

Writes config.json, model.safetensors (float32) and the tokenizer files. With
--workdir, the policy comes from the training run's latest readable checkpoint
and the architecture and tokenizer from the run's model (its config.json). A run that
trained LoRA adapters (config.lora) exports its adapters merged into the base weights;
--adapters also writes them as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that `peft.PeftModel.from_pretrained` applies to the base.

One export to an --out at a time (a lock beside it); weights that are not finite, or
absurdly large, are refused by name rather than shipped.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import sys
import tempfile

from jaxrl_agents.models import lora, weights, zoo
from jaxrl_agents.train import checkpointing


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_agents.tools.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None,
                 help="preset name, Hugging Face directory or .gguf file (default: the run's "
                      f"model with --workdir, else {zoo.DEFAULT_MODEL})")
  p.add_argument("--workdir", default=None, help="a training run directory to export from")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  p.add_argument("--adapters", default=None,
                 help="with --workdir of a LoRA run: also write its adapters here, as PEFT's")
  return p.parse_args(argv)


# What an export directory holds, by exact name; --overwrite replaces only a
# directory of these, so a mistyped --out (a home directory, a dataset) or a
# file of the user's that merely looks similar is never deleted.
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "added_tokens.json")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _check_replaceable(out: str) -> None:
  foreign = sorted(name for name in os.listdir(out)
                   if os.path.isdir(os.path.join(out, name))
                   or not (name in EXPORT_FILES or _SHARD.fullmatch(name)))
  if foreign:
    raise SystemExit(f"--out {out!r} holds {', '.join(foreign[:5])}, which an export does not "
                     "write; --overwrite only replaces a previous export. Choose another --out")


def _write_clean(out: str, write) -> None:
  """Runs write(dir) into a fresh directory that then takes the place of `out`.

  The old directory is renamed away before the new one moves in, and deleted
  last: a failure at any point leaves either the old export or the new one.
  """
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
  # mkdtemp makes a private (0700) directory: give the export the permissions a
  # plain mkdir would (or the replaced export's), so a server or a team can read it.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, stat.S_IMODE(os.stat(out).st_mode) if os.path.isdir(out) else 0o777 & ~umask)
  old = None
  try:
    write(tmp)
    if os.path.exists(out):
      old = tempfile.mkdtemp(prefix=".export-old-", dir=parent)
      os.rename(out, os.path.join(old, "previous"))
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not os.path.exists(out):
      os.rename(os.path.join(old, "previous"), out)
    raise
  finally:
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)


def _out_dir(out: str) -> str:
  """The real directory --out names (symlinks followed, '.' and relative paths resolved)."""
  if not out.strip():
    raise SystemExit("--out must name a directory")
  real = os.path.realpath(out)
  if os.path.exists(real) and not os.path.isdir(real):
    raise SystemExit(f"--out {out!r} is a file, not a directory")
  if real == os.path.realpath(os.getcwd()) or real == os.path.dirname(real):
    # Swapping out the working directory (or /) would leave the shell in a deleted one.
    raise SystemExit(f"--out {out!r} is the current (or root) directory; name the export's "
                     "own directory")
  return real


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _write_adapters(args, model, meta: dict, step: int) -> None:
  """The run's adapters of checkpoint `step` as a PEFT adapter directory at --adapters."""
  raw, _, _ = checkpointing.latest_policy_params(args.workdir, step, merge_adapters=False)
  if not lora.is_lora_params(raw):
    raise SystemExit(f"--adapters: {args.workdir!r} trained every weight, not adapters "
                     "(config.lora.rank 0); its --out export is the whole model")
  out = _out_dir(args.adapters)
  if os.path.isdir(out) and os.listdir(out):
    foreign = sorted(set(os.listdir(out)) - set(ADAPTER_FILES))
    if not args.overwrite or foreign:
      raise SystemExit(f"--adapters {args.adapters!r} is not empty"
                       + (f" (it holds {', '.join(foreign[:5])})" if foreign else
                          "; pass --overwrite"))
  spec = lora.spec_from_config(meta["config"]["lora"])
  weights.save_peft_adapters(raw["lora"], model.cfg, out, rank=spec.rank, alpha=spec.alpha,
                             base_model=meta["config"]["model"])
  logging.info("wrote the adapters of %s (step %d) as a PEFT directory to %s", args.workdir,
               step, args.adapters)


def _check_weights(params, source: str) -> None:
  """Refuses, naming the array, weights that are not finite or are absurdly large."""
  found = checkpointing.absurd_weight(params)
  if found:
    name, value = found
    raise SystemExit(f"{source}: weight {name} holds {value:.3g} (not finite, or beyond any "
                     f"trained model's > {checkpointing.ABSURD_WEIGHT:g}): the run diverged. "
                     "Not exported")


@contextlib.contextmanager
def _exclusive(out: str):
  """Holds a lock beside `out` for one export at a time: a second export to the same --out
  fails at once instead of replacing (and deleting) the first one's directory. The lock
  file stays (an empty hidden file); the kernel releases the lock when its process dies."""
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  fd = os.open(os.path.join(parent, f".{os.path.basename(out)}.export-lock"),
               os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise SystemExit(f"--out {out!r}: another export to it is running; wait for it or "
                       "choose another --out") from None
    yield
  finally:
    os.close(fd)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(message)s")
  out = _out_dir(args.out)
  with _exclusive(out):
    _export(args, out)
  return 0


def _export(args, out: str) -> None:
  """main's work, with --out locked: what is there is checked, then replaced in one rename."""
  if os.path.isdir(out) and os.listdir(out):
    if not args.overwrite:
      raise SystemExit(f"--out {args.out!r} exists and is not empty; pass --overwrite")
    _check_replaceable(out)
  if args.workdir and not os.path.isdir(os.path.join(args.workdir, "checkpoints")):
    raise SystemExit(f"--workdir {args.workdir!r} holds no checkpoints/ (not a training run)")
  if args.workdir:
    try:
      params, meta, step = checkpointing.latest_policy_params(args.workdir)
    except FileNotFoundError as e:
      raise SystemExit(f"--workdir {args.workdir!r}: {e}") from None
    model = zoo.load(args.model or meta["config"]["model"])
    zoo.check_params(params, model.cfg, args.workdir)
    model.params = params
    source = f"{args.workdir} (step {step})"
    if args.adapters:
      _write_adapters(args, model, meta, step)
  else:
    if args.adapters:
      raise SystemExit("--adapters needs --workdir (a run that trained LoRA adapters)")
    model = zoo.load(args.model or zoo.DEFAULT_MODEL)
    source = model.name
  _check_weights(model.params, source)
  _write_clean(out, lambda d: zoo.save_hf_dir(model, d))
  logging.info("wrote %s as a Hugging Face directory to %s", source, args.out)


if __name__ == "__main__":
  sys.exit(main())
