"""Environments for multi-turn agents, registered by name (kind "env").

```
env = envs.make("guess_number", tokenizer, high=16)
```
See `envs.base` for the protocol. Registered:

| name          | what the agent does                                              |
|---------------|------------------------------------------------------------------|
| guess_number  | guesses a number in a range, told "higher" / "lower" each turn    |
| guess_number_host | (host) the same game stepped in Python, to time the host loop  |
| frozen_lake   | walks a text-grid lake to the goal around holes (slippery or not) |
| tic_tac_toe   | plays tic-tac-toe (pgx) against a fixed opponent                  |
| tic_tac_toe_self_play | plays both sides of tic-tac-toe (two players, `rollout.self_play`) |
| sokoban       | pushes boxes onto targets in small generated rooms (text grid)    |
| calculator    | (host) multiplies large numbers, with a calculator tool to call   |
| text_to_sql   | (host) answers questions with SQL over a generated sqlite database |
| search_qa     | (host) multi-hop questions over invented documents, BM25 search   |
"""

from jaxrl_agents import registry
from jaxrl_agents.envs import (
  base,
  calculator,
  frozen_lake,
  guess_number,
  search_qa,
  sokoban,
  text_to_sql,
  tic_tac_toe,
)
from jaxrl_agents.envs.base import Env, EnvStep, GameStep, HostEnv, HostStep, Tokens


def make(name: str, tokenizer, **options) -> Env | HostEnv:
  """The environment registered as `name`, built for `tokenizer` with its options."""
  return registry.get("env", name)(tokenizer, **options)


def names() -> list[str]:
  return registry.names("env")


__all__ = ["Env", "EnvStep", "GameStep", "HostEnv", "HostStep", "Tokens", "base", "calculator",
           "frozen_lake", "guess_number", "search_qa", "sokoban",
           "text_to_sql", "tic_tac_toe", "make", "names"]
