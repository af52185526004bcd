"""The test suite's groups for scripts/test.sh, balanced by measured time, not by file name.

Prints one line per group, `LANE SECONDS FILE...`: GROUPS processes, each a fresh pytest
process (fresh XLA state), split over two lanes that run side by side. Each file's time comes
from tests/durations.json (seconds of test time, measured; refresh it with
`scripts/test_groups.py --record JUNIT_XML...` after a whole run with --junitxml); a file it
does not list counts as DEFAULT_SECONDS. Longest first onto the least loaded group (LPT).
"""

import glob
import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DURATIONS = os.path.join(ROOT, "tests", "durations.json")
GROUPS = 6
DEFAULT_SECONDS = 30.0


def groups(lanes: int = 2) -> list[tuple[int, float, list[str]]]:
  with open(DURATIONS) as f:
    seconds = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
  files = sorted(os.path.relpath(p, ROOT)
                 for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
  bins = [[0.0, []] for _ in range(GROUPS)]
  for path in sorted(files, key=lambda p: -seconds.get(p, DEFAULT_SECONDS)):
    b = min(bins, key=lambda b: b[0])
    b[0] += seconds.get(path, DEFAULT_SECONDS)
    b[1].append(path)
  # Whole groups onto the lanes, longest first onto the less loaded lane.
  loads, out = [0.0] * lanes, []
  for total, paths in sorted(bins, key=lambda b: -b[0]):
    if not paths:
      continue
    lane = loads.index(min(loads))
    loads[lane] += total
    out.append((lane, total, sorted(paths)))
  return sorted(out, key=lambda g: (g[0], -g[1]))


def record(xml_paths: list[str]) -> None:
  """tests/durations.json from pytest's JUnit XML files of a whole run."""
  totals: dict[str, float] = {}
  for xml in xml_paths:
    for case in ET.parse(xml).getroot().iter("testcase"):
      path = "tests/" + case.get("classname").split(".")[-1] + ".py"
      totals[path] = totals.get(path, 0.0) + float(case.get("time"))
  with open(DURATIONS) as f:
    note = {k: v for k, v in json.load(f).items() if k.startswith("_")}
  with open(DURATIONS, "w") as f:
    json.dump({**note, **{k: round(v, 1) for k, v in sorted(totals.items())}}, f, indent=1)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--record"]:
    record(sys.argv[2:])
  else:
    lanes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for lane, total, paths in groups(lanes):
      print(lane, round(total), *paths)
