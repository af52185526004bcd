"""`python -m jaxrl_agents.generate`, kept working: the command is `jaxrl_agents.tools.generate`."""

import sys

from jaxrl_agents.tools.generate import main

if __name__ == "__main__":
  sys.exit(main())
