"""The package's layout (docs/layout.md): its parts import only the parts below them, so it
has no import cycle, and the library never imports the experiments."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxrl_agents"
# Lowest first: a part may import the parts before it, never one after it.
ORDER = ["parallel", "registry", "types", "models", "data", "objectives", "train", "rewards",
         "envs", "rollout", "evaluation", "tools"]
# `python -m jaxrl_agents.generate|export|plots`, kept working: they call tools/.
COMMANDS = {"generate", "export", "plots"}


def _imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports (at the top or inside a function)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "jaxrl_agents":
        out |= {f"jaxrl_agents.{a.name}" for a in node.names}
      else:
        out.add(node.module)
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
  return out


def _part(module: str) -> str:
  return module.split(".")[1]


def test_every_part_imports_only_the_parts_below_it():
  parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if not p.name.startswith("_") and p.name != "__pycache__"}
  assert parts == set(ORDER) | COMMANDS, f"place the new part in ORDER: {parts ^ set(ORDER)}"
  upward = []
  for path in PACKAGE.rglob("*.py"):
    rel = path.relative_to(PACKAGE)
    if rel.name == "__init__.py" and len(rel.parts) == 1:
      continue
    part = rel.parts[0].removesuffix(".py")
    if part in COMMANDS:
      continue
    for module in _imports(path):
      if module.startswith("experiments"):
        upward.append(f"{rel} imports {module} (the library never imports the experiments)")
      elif module.startswith("jaxrl_agents.") and _part(module) != part:
        if ORDER.index(_part(module)) > ORDER.index(part):
          upward.append(f"{rel} ({part}) imports {module} ({_part(module)}, a higher part)")
  assert not upward, "\n".join(sorted(upward))
