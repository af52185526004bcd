r"""Run an experiment as several processes on this machine (`jax.distributed` over CPUs).

  python -m launch.local --processes=2 --devices_per_process=2 -- \
      experiments.grpo --config=experiments/configs/grpo_arithmetic.py:tiny \
      --config.mesh.data=4 --workdir=runs/grpo_2proc

Every process runs the same command; they meet at a coordinator on a free local
port (`JAXRL_COORDINATOR`, `JAXRL_NUM_PROCESSES`, `JAXRL_PROCESS_ID`, read by
`jaxrl_agents.parallel.distributed`) and form one mesh of processes x devices_per_process
CPU devices, exchanging collectives over gloo. This is how the multi-host code
paths are tested without a cluster; it is not faster than one process.

Process 0 prints to this terminal; process i writes `<log_dir>/process_<i>.log`.
When a process fails, the others are stopped (SIGTERM, then SIGKILL) and the
launcher exits with the failing process's status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

LOCAL_INIT_TIMEOUT_S = 120


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(base: dict[str, str], index: int, count: int, port: int,
                devices_per_process: int) -> dict[str, str]:
  """The environment of process `index`: the coordinator, its id, its CPU device count."""
  env = dict(base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
  env.update(XLA_FLAGS=" ".join(flags), JAXRL_COORDINATOR=f"localhost:{port}",
             JAXRL_NUM_PROCESSES=str(count), JAXRL_PROCESS_ID=str(index))
  # Processes on one machine meet within seconds; JAX's default wait for a missing one is
  # 300 s. Set JAXRL_INIT_TIMEOUT_S to wait otherwise.
  env.setdefault("JAXRL_INIT_TIMEOUT_S", str(LOCAL_INIT_TIMEOUT_S))
  return env


def launch(command: list[str], processes: int, devices_per_process: int, log_dir: str,
           timeout_s: float = 0.0) -> int:
  """Runs `command` as `processes` processes; returns 0, or the first failing status."""
  os.makedirs(log_dir, exist_ok=True)
  port, procs, logs = free_port(), [], []
  for i in range(processes):
    env = process_env(dict(os.environ), i, processes, port, devices_per_process)
    out = None
    if i > 0:
      out = open(os.path.join(log_dir, f"process_{i}.log"), "w")  # noqa: SIM115
      logs.append(out)
    procs.append(subprocess.Popen(command, env=env, stdout=out,
                                  stderr=subprocess.STDOUT if out else None))
  deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
  status, culprit = 0, None
  try:
    while True:
      # Every process is polled each time: the first failure anywhere stops the launch,
      # not only once the processes before it in the list have ended.
      codes = [p.poll() for p in procs]
      failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        culprit, status = failed[0]
        break
      if all(code == 0 for code in codes):
        break
      if time.monotonic() > deadline:
        status = 124
        break
      time.sleep(0.2)
  finally:
    _stop(procs)
    for f in logs:
      f.close()
  if culprit is not None:
    log = "this terminal" if culprit == 0 else os.path.join(log_dir, f"process_{culprit}.log")
    print(f"launch.local: process {culprit} of {processes} {_ending(status)}; the others were "
          f"stopped. Its log: {log}", file=sys.stderr)
    if status == -signal.SIGABRT:
      print("launch.local: jax.distributed ends a process with SIGABRT when its peers do not "
            "all connect within JAXRL_INIT_TIMEOUT_S (default 300 s: a process hung or slow "
            "before starting it; see each log's 'waiting up to' line) or when a peer dies",
            file=sys.stderr)
  elif status:
    print(f"launch.local: the processes ran past --timeout_s={timeout_s:g} and were stopped; "
          f"logs of processes 1.. in {log_dir}", file=sys.stderr)
  return status


def _ending(status: int) -> str:
  """How a process ended, in words: its exit status or the signal that killed it."""
  if status < 0:
    try:
      return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
      return f"was killed by signal {-status}"
  return f"exited with status {status}"


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
  live = [p for p in procs if p.poll() is None]
  for p in live:
    p.send_signal(signal.SIGTERM)
  end = time.monotonic() + grace_s
  for p in live:
    try:
      p.wait(timeout=max(end - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def parse(argv: list[str]):
  if "--" not in argv:
    raise SystemExit("usage: python -m launch.local [options] -- <experiment module> <args>")
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="launch.local", description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=1,
                      help="CPU devices each process has (XLA's host platform device count)")
  parser.add_argument("--log_dir", default="", help="where processes 1.. write their logs "
                      "(default: a new temporary directory)")
  parser.add_argument("--timeout_s", type=float, default=0.0,
                      help="stop every process after this many seconds (0: no limit)")
  args = parser.parse_args(argv[:split])
  module = argv[split + 1:]
  if not module or not module[0].startswith("experiments."):
    raise SystemExit("after --: an experiment module (experiments.grpo, ...) and its flags")
  if args.processes < 1 or args.devices_per_process < 1:
    raise SystemExit("--processes and --devices_per_process must be >= 1")
  return args, [sys.executable, "-m", *module]


def main(argv: list[str] | None = None) -> int:
  args, command = parse(sys.argv[1:] if argv is None else argv)
  log_dir = args.log_dir or tempfile.mkdtemp(prefix="launch_local_")
  return launch(command, args.processes, args.devices_per_process, log_dir, args.timeout_s)


if __name__ == "__main__":
  sys.exit(main())
