"""`python -m jaxrl_agents.export`, kept working: the command is `jaxrl_agents.tools.export`."""

import sys

from jaxrl_agents.tools.export import main

if __name__ == "__main__":
  sys.exit(main())
