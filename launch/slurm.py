r"""Run an experiment as a SLURM batch job on one or several GPU nodes.

  python -m launch.slurm --gpus=8 --time=04:00:00 --partition=gpu --dry_run -- \
      experiments.grpo --config=experiments/configs/grpo_arithmetic.py \
      --config.mesh.fsdp=-1 --workdir=runs/grpo_gpu

Writes an sbatch script (`--script`, default launch_<job>.sbatch) that sets up
the virtualenv with JAX for CUDA 12 (`scripts/setup.sh cuda`) and runs the
experiment with `srun`, one process over the node's GPUs (`config.mesh`
spreads the work over them); then submits it with `sbatch`. `--dry_run`
prints the script and submits nothing. The job runs in this checkout (a
shared filesystem, as SLURM clusters have).

With `--nodes=N` (N > 1) srun starts one process per node with
`JAXRL_DISTRIBUTED=auto`: `jax.distributed` reads SLURM's variables for the
coordinator (the first node), the process count and each process's id, and
the processes form one mesh over every GPU of every node
(`jaxrl_agents/parallel/distributed.py`); process 0 writes the logs, all of them the
checkpoints (the workdir is on the shared filesystem).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys


def script(args, experiment: list[str], repo: str) -> str:
  lines = [
      "#!/usr/bin/env bash",
      f"#SBATCH --job-name={args.job}",
      f"#SBATCH --nodes={args.nodes}",
      "#SBATCH --ntasks-per-node=1",
      f"#SBATCH --gpus-per-node={args.gpus}",
      f"#SBATCH --cpus-per-task={args.cpus}",
      f"#SBATCH --time={args.time}",
      f"#SBATCH --output={args.job}-%j.log",
  ]
  if args.partition:
    lines.append(f"#SBATCH --partition={args.partition}")
  if args.account:
    lines.append(f"#SBATCH --account={args.account}")
  lines += [
      "set -euo pipefail",
      f"cd {shlex.quote(repo)}",
      "scripts/setup.sh cuda",
      "export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX takes GPU memory as it needs it",
  ]
  if args.nodes > 1:  # one process per node; jax.distributed reads SLURM's variables
    lines.append("export JAXRL_DISTRIBUTED=auto")
  lines += [
      "srun .venv/bin/python -m " + " ".join(shlex.quote(a) for a in experiment),
  ]
  return "\n".join(lines) + "\n"


def parse(argv: list[str]):
  if "--" not in argv:
    raise SystemExit("usage: python -m launch.slurm [options] -- <experiment module> <args>")
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="launch.slurm", description=__doc__.split("\n\n")[0])
  parser.add_argument("--job", default="jaxrl_agents")
  parser.add_argument("--nodes", type=int, default=1, help="nodes, one process on each")
  parser.add_argument("--gpus", type=int, default=8, help="GPUs on each node")
  parser.add_argument("--cpus", type=int, default=16, help="CPU cores for the job")
  parser.add_argument("--time", default="04:00:00", help="the job's time limit")
  parser.add_argument("--partition", default="")
  parser.add_argument("--account", default="")
  parser.add_argument("--script", default="", help="where to write the sbatch script")
  parser.add_argument("--dry_run", action="store_true", help="print the script, submit nothing")
  args = parser.parse_args(argv[:split])
  experiment = argv[split + 1:]
  if not experiment or not experiment[0].startswith("experiments."):
    raise SystemExit("after --: an experiment module (experiments.grpo, ...) and its flags")
  if args.gpus < 1:
    raise SystemExit(f"--gpus must be >= 1, got {args.gpus}")
  if args.nodes < 1:
    raise SystemExit(f"--nodes must be >= 1, got {args.nodes}")
  return args, experiment


def main(argv: list[str] | None = None) -> int:
  args, experiment = parse(sys.argv[1:] if argv is None else argv)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  text = script(args, experiment, repo)
  if args.dry_run:
    print(text, end="")
    return 0
  path = args.script or f"launch_{args.job}.sbatch"
  with open(path, "w") as f:
    f.write(text)
  subprocess.run(["sbatch", path], check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
