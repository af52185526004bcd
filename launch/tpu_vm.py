r"""Run an experiment on a Cloud TPU VM: create (or reuse) it, copy the code, set up, run.

  python -m launch.tpu_vm --name=rl-v5e --zone=us-west4-a --accelerator=v5litepod-8 \
      --dry_run -- experiments.grpo --config=experiments/configs/grpo_arithmetic.py \
      --config.mesh.fsdp=-1 --workdir=runs/grpo_tpu

Steps, each a `gcloud compute tpus tpu-vm` command (`--dry_run` prints them
and runs nothing):
  1. `describe` the VM; `create` it when it does not exist (`--spot` for spot).
  2. `scp` a tarball of the working tree (tracked and untracked files that git
     does not ignore) to every worker, and unpack it in `--remote_dir`.
  3. `ssh --worker=all`: `scripts/setup.sh tpu` (a virtualenv with jax[tpu]),
     then `.venv/bin/python -m <experiment> <args>` under nohup, its output in
     `<remote_dir>/launch.log`.

A single-host slice (v4-8, v5litepod-8: one worker, 8 chips) runs the
experiment as one process over its local devices (`config.mesh`). On a
multi-worker pod slice (v4-32, v5litepod-64, ...) every worker runs the same
command with `JAXRL_DISTRIBUTED=auto`: `jax.distributed` finds the other workers
from the TPU metadata and the processes form one mesh over every chip
(`jaxrl_agents/parallel/distributed.py`). Their checkpoints are written by all workers
together, so the workdir must be on a filesystem every worker mounts (a
Filestore NFS share or a gcsfuse bucket), not a worker's own disk.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

# Slices with one worker: one process. Any other slice runs one process per worker.
SINGLE_HOST = ("v4-8", "v5litepod-1", "v5litepod-4", "v5litepod-8", "v6e-1", "v6e-4", "v6e-8")


def commands(args, experiment: list[str]) -> list[list[str]]:
  """The gcloud commands, in order (the create step is run only when describe fails)."""
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  where = [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])
  remote = args.remote_dir
  multihost = "" if args.accelerator in SINGLE_HOST else "JAXRL_DISTRIBUTED=auto "
  run = (f"cd {shlex.quote(remote)} && scripts/setup.sh tpu && "
         f"{multihost}nohup .venv/bin/python -m {' '.join(shlex.quote(a) for a in experiment)} "
         f"> launch.log 2>&1 &")
  return [
      tpu + ["describe", args.name] + where,
      tpu + ["create", args.name, f"--accelerator-type={args.accelerator}",
             f"--version={args.runtime}"] + where + (["--spot"] if args.spot else []),
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      tpu + ["scp", "/tmp/jaxrl_agents_launch.tar.gz", f"{args.name}:/tmp/",
             "--worker=all"] + where,
      tpu + ["ssh", args.name, "--worker=all",
             f"--command=mkdir -p {shlex.quote(remote)} && "
             f"tar -xzf /tmp/jaxrl_agents_launch.tar.gz -C {shlex.quote(remote)}"] + where,
      tpu + ["ssh", args.name, "--worker=all", f"--command={run}"] + where,
  ]


def parse(argv: list[str]):
  if "--" not in argv:
    raise SystemExit("usage: python -m launch.tpu_vm [options] -- <experiment module> <args>")
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="launch.tpu_vm", description=__doc__.split("\n\n")[0])
  parser.add_argument("--name", required=True, help="the TPU VM's name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default="")
  parser.add_argument("--accelerator", default="v5litepod-8")
  parser.add_argument("--runtime", default="v2-alpha-tpuv5-lite", help="TPU VM software version")
  parser.add_argument("--spot", action="store_true")
  parser.add_argument("--remote_dir", default="jaxrl_agents")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  args = parser.parse_args(argv[:split])
  experiment = argv[split + 1:]
  if not experiment or not experiment[0].startswith("experiments."):
    raise SystemExit("after --: an experiment module (experiments.grpo, ...) and its flags")
  return args, experiment


def main(argv: list[str] | None = None) -> int:
  args, experiment = parse(sys.argv[1:] if argv is None else argv)
  describe, create, files, scp, unpack, run = commands(args, experiment)
  if args.dry_run:
    print(shlex.join(describe) + " || " + shlex.join(create))
    print(shlex.join(files) + " | tar -czf /tmp/jaxrl_agents_launch.tar.gz --null -T -")
    for cmd in (scp, unpack, run):
      print(shlex.join(cmd))
    return 0
  if subprocess.run(describe, capture_output=True).returncode != 0:
    subprocess.run(create, check=True)
  listed = subprocess.run(files, check=True, capture_output=True).stdout
  subprocess.run(["tar", "-czf", "/tmp/jaxrl_agents_launch.tar.gz", "--null", "-T", "-"],
                 input=listed, check=True)
  for cmd in (scp, unpack, run):
    subprocess.run(cmd, check=True)
  print(f"started; follow it with: gcloud compute tpus tpu-vm ssh {args.name} "
        f"--zone={args.zone} --command='tail -f {args.remote_dir}/launch.log'")
  return 0


if __name__ == "__main__":
  sys.exit(main())
