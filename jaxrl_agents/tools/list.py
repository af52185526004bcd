"""Every name a config can choose, by kind, with its one-line doc.

  python -m jaxrl_agents.tools.list                 # every kind and name
  python -m jaxrl_agents.tools.list reward env      # some kinds
  python -m jaxrl_agents.tools.list --import mypkg.rewards reward   # with one's own module

An unknown kind is an error naming the closest one.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from jaxrl_agents import registry


def format_kind(kind: str, width: int = 110) -> str:
  """A kind's heading and one line per name: `  name  doc`, the doc cut to `width`."""
  entries = registry.describe(kind)
  pad = max((len(name) for name, _ in entries), default=0)
  lines = [f"{kind} ({len(entries)})"]
  for name, doc in entries:
    line = f"  {name.ljust(pad)}  {doc}".rstrip()
    lines.append(line if len(line) <= width else line[: width - 3] + "...")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("kinds", nargs="*", help="kinds to list (default: all)")
  p.add_argument("--import", dest="imports", action="append", default=[],
                 help="a module of one's own to import first (as config.imports does)")
  args = p.parse_args(argv)
  registry.import_modules(args.imports)
  known = registry.kinds()
  for kind in args.kinds:
    if kind not in known:
      close = difflib.get_close_matches(kind, known, n=1)
      hint = f"; did you mean {close[0]!r}?" if close else ""
      print(f"unknown kind {kind!r}{hint} Kinds: {', '.join(known)}", file=sys.stderr)
      return 2
  print("\n\n".join(format_kind(kind) for kind in (args.kinds or known)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
