"""`python -m jaxrl_agents.plots`, kept working: the command is `jaxrl_agents.tools.plots`."""

import sys

from jaxrl_agents.tools.plots import main

if __name__ == "__main__":
  sys.exit(main())
