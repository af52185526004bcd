"""Command-line tools: `python -m jaxrl_agents.tools.list` lists every registered name."""
