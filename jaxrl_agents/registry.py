"""Name -> function registries, so configs choose parts by string.

```
from jaxrl_agents import registry

@registry.register("group_advantage", "grpo")
def group_normalized_advantages(rewards, ...): ...

registry.get("group_advantage", "grpo")(rewards)
registry.names("group_advantage")
```
A kind holds functions of one signature, so a caller can call any entry of it:
"group_advantage" (f32[P, G] rewards -> f32[P, G]), "component_advantage"
(f32[P, G, M] reward components, f32[M] weights -> f32[P, G]), "token_advantage"
(token rewards, values, dones -> advantages, returns), "kl" (per-token
estimators), "policy_loss", "aggregation", "preference_loss", "reward" (host
functions of completions and examples), "model" (presets), "env" (environment
factories: tokenizer, **options -> Env), and the named choices of the configs:
"kl_controller" (kl_coef, **options -> KLController), "token_control" (which policy
tokens keep their gradient), "turn_credit" (episode advantages -> token advantages
of multi-turn episodes), "gae_level" (PPO's credit), "critic" (PPO's value
backbone), "reward_combinator" (reward components -> one reward), "layout" (the
model's layers as a list or one scan). An entry's keyword-only arguments are its
options: `options(kind, name, config_dict)` picks them out of a config block that
holds the options of every name.
Registration happens when the defining module is imported; `get` and `names`
import the library's modules for the kind first, so callers never need to.
Modules of one's own register the same way: list them in a config's `imports`
(`config.imports = ("mypkg.rewards",)`), and every trainer imports them before it
checks any name (`import_modules`). `python -m jaxrl_agents.tools.list [KIND]`
prints every kind and name with its one-line doc.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

_REGISTRY: dict[str, dict[str, Any]] = {}

# Modules whose import registers the entries of each kind.
_PROVIDERS: dict[str, tuple[str, ...]] = {
    "model": ("jaxrl_agents.models.zoo",),
    "group_advantage": ("jaxrl_agents.objectives.advantages",),
    "component_advantage": ("jaxrl_agents.objectives.advantages",),
    "token_advantage": ("jaxrl_agents.objectives.advantages",),
    "kl": ("jaxrl_agents.objectives.losses",),
    "policy_loss": ("jaxrl_agents.objectives.losses",),
    "aggregation": ("jaxrl_agents.objectives.losses",),
    "preference_loss": ("jaxrl_agents.objectives.losses",),
    "reward": ("jaxrl_agents.rewards",),
    "env": ("jaxrl_agents.envs",),
    "kl_controller": ("jaxrl_agents.objectives.losses.kl_control",),
    "token_control": ("jaxrl_agents.objectives.losses.token_controls",),
    "turn_credit": ("jaxrl_agents.objectives.credit.turn_credits",),
    "gae_level": ("jaxrl_agents.objectives.credit.gae",),
    "critic": ("jaxrl_agents.models.heads",),
    "reward_combinator": ("jaxrl_agents.rewards.combine",),
    "layout": ("jaxrl_agents.models.layouts",),
}


def register(kind: str, name: str) -> Callable[[Any], Any]:
  """Decorator registering `fn` under (kind, name); a name is registered once."""

  def decorator(fn):
    table = _REGISTRY.setdefault(kind, {})
    if name in table and table[name] is not fn:
      raise ValueError(f"{kind} {name!r} is already registered to {table[name]!r}")
    table[name] = fn
    return fn

  return decorator


@contextlib.contextmanager
def registered(kind: str, name: str, fn: Any) -> Iterator[Any]:
  """Registers `fn` under (kind, name) for the duration of a `with` block (tests, notebooks)."""
  register(kind, name)(fn)
  try:
    yield fn
  finally:
    _REGISTRY[kind].pop(name, None)


def _load_providers(kind: str) -> None:
  for module in _PROVIDERS.get(kind, ()):
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name != module:  # a real import error inside the module
        raise


def get(kind: str, name: str) -> Any:
  """The entry registered under (kind, name); a clear error names the closest match, lists
  the valid names and says how to register one."""
  _load_providers(kind)
  table = _REGISTRY.get(kind)
  if not table:
    raise KeyError(f"unknown kind {kind!r}; known kinds: {kinds()}")
  if name not in table:
    close = difflib.get_close_matches(str(name), list(table), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise KeyError(f"unknown {kind} {name!r}; {hint}registered: {sorted(table)}. To add one, "
                   f"decorate it with @registry.register({kind!r}, NAME) in a module that the "
                   "config lists in `imports` (docs/extending.md)")
  return table[name]


def kinds() -> list[str]:
  """Every kind: the library's and any a user module registered."""
  return sorted(set(_PROVIDERS) | set(_REGISTRY))


def describe(kind: str) -> list[tuple[str, str]]:
  """(name, first line of the entry's docstring) of every entry of a kind, sorted by name."""
  _load_providers(kind)
  out = []
  for name, entry in sorted(_REGISTRY.get(kind, {}).items()):
    doc = (inspect.getdoc(entry) or "").strip()
    out.append((name, doc.splitlines()[0] if doc else ""))
  return out


def import_modules(modules) -> None:
  """Imports each named module (a config's `imports`), so the entries it registers exist
  before a config's names are checked. A name that does not import is an error naming it."""
  if isinstance(modules, str):
    raise TypeError(f"config.imports must be a sequence of module names, got the string "
                    f"{modules!r}; write ({modules!r},)")
  for module in modules:
    if not isinstance(module, str) or not module:
      raise TypeError(f"config.imports holds module names (str), got {module!r}")
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name is not None and module.startswith(e.name):  # the module itself is missing
        raise ModuleNotFoundError(
            f"config.imports names {module!r}, which Python cannot find ({e}); install its "
            f"package or put its directory on PYTHONPATH", name=e.name) from e
      raise


def options(kind: str, name: str, given) -> dict[str, Any]:
  """The entries of mapping `given` that entry (kind, name) takes as keyword-only arguments
  (its options), e.g. config.kl_controller, which holds every controller's options."""
  params = inspect.signature(get(kind, name)).parameters
  return {k: given[k] for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k in given}


def check_name(kind: str, name: str, what: str) -> None:
  """Raises ValueError naming `what` (the config key) when `name` is not registered."""
  try:
    get(kind, name)
  except KeyError as e:
    raise ValueError(f"{what}: {e.args[0]}") from None


def names(kind: str) -> list[str]:
  """Sorted registered names of a kind (empty if none)."""
  _load_providers(kind)
  return sorted(_REGISTRY.get(kind, {}))
