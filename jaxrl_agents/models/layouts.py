"""How a loaded model's layers are laid out (config.layout, registry kind "layout"):
a `zoo.Model` in, the same model laid out, with `remat` (the rematerialization of a
scanned layer in the backward pass) as its option."""

from __future__ import annotations

from jaxrl_agents import registry
from jaxrl_agents.models import transformer, zoo


@registry.register("layout", "list")
def layer_list(model: zoo.Model, *, remat: str = "none") -> zoo.Model:
  """A per-layer list of parameters, one compiled layer each (fastest on CPU)."""
  if remat != "none":
    raise ValueError(f"remat={remat!r} applies to the stacked layout; set layout='stacked'")
  return model


@registry.register("layout", "stacked")
def stacked(model: zoo.Model, *, remat: str = "none") -> zoo.Model:
  """The layers stacked under one lax.scan, `remat` in the backward (for accelerators).

  Compile time does not grow with depth; `remat` is one of `transformer.REMAT_POLICIES`."""
  if not isinstance(model.cfg, transformer.TransformerConfig):
    raise ValueError(f"layout='stacked' is the project's transformer's; this model is a "
                     f"{type(model.cfg).__name__}")
  model.params = transformer.stack_layers(model.params)
  model.cfg = model.cfg.replace(remat=remat)
  return model
