"""Runs a benchmark command and commits its result as JSON under benchmarks/results/.

  .venv/bin/python benchmarks/record.py NAME -- .venv/bin/python benchmarks/sampler.py --skip-tunix

The benchmark's last line of output must be one JSON object (every benchmark here prints
one). The file `benchmarks/results/NAME.json` gets {date, cpu (cpu_info.describe), commit,
command, wall_s, result}; the docs pages cite these files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import cpu_info

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("name", help="the result file's name (benchmarks/results/NAME.json)")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark's command")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the benchmark's command after --")
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  start = time.perf_counter()
  proc = subprocess.run(command, capture_output=True, text=True)
  wall = time.perf_counter() - start
  sys.stderr.write(proc.stderr[-4000:])
  lines = [line for line in proc.stdout.splitlines() if line.strip()]
  if proc.returncode != 0 or not lines:
    print(f"record.py: {command} exited {proc.returncode}; nothing recorded", file=sys.stderr)
    return proc.returncode or 1
  try:
    result = json.loads(lines[-1])
  except json.JSONDecodeError:
    print(f"record.py: the last line of {command}'s output is not JSON: {lines[-1][:200]!r}",
          file=sys.stderr)
    return 1
  os.makedirs(RESULTS, exist_ok=True)
  out = os.path.join(RESULTS, f"{args.name}.json")
  with open(out, "w") as f:
    json.dump({"date": datetime.date.today().isoformat(), "cpu": cpu_info.describe(),
               "commit": commit, "command": " ".join(command), "wall_s": round(wall, 1),
               "result": result}, f, indent=1)
  print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
