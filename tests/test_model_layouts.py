"""config.layout and config.remat, "auto" included: what each resolves to, and that a run
records what "auto" chose (a resume compares that)."""

import pytest

from experiments import common
from experiments.configs import grpo_arithmetic
from jaxrl_agents.models import gemma, transformer, zoo


@pytest.mark.parametrize("layout, remat, backend, want", [
    ("auto", "auto", "cpu", ("list", "none")),  # the list is faster on CPU
    ("auto", "auto", "gpu", ("stacked", "full")),  # long rows need the memory
    ("auto", "auto", "tpu", ("stacked", "full")),
    ("auto", "dots", "gpu", ("stacked", "dots")),
    ("stacked", "auto", "cpu", ("stacked", "full")),
    ("list", "auto", "gpu", ("list", "none")),
    ("list", "none", "gpu", ("list", "none")),  # asked for: as is
])
def test_auto_layout_and_remat_by_backend(layout, remat, backend, want):
  cfg = zoo.load("tiny").cfg
  assert isinstance(cfg, transformer.TransformerConfig)
  assert common.resolve_layout(layout, remat, cfg, backend=backend) == want


def test_a_model_that_cannot_stack_keeps_the_list_under_auto():
  flax_cfg = gemma.definition(gemma.TINY_GEMMA3)
  assert common.resolve_layout("auto", "auto", flax_cfg, backend="gpu") == ("list", "none")


def test_loading_records_what_auto_chose():
  config = grpo_arithmetic.get_config("tiny")
  assert (config.layout, config.remat) == ("auto", "auto")
  model = common.load_model(config)
  want = common.resolve_layout("auto", "auto", model.cfg)
  assert (config.layout, config.remat) == want
  assert transformer.is_stacked(model.params) == (want[0] == "stacked")


def test_bad_names_are_refused():
  config = grpo_arithmetic.get_config("tiny")
  config.remat = "most"
  with pytest.raises(ValueError, match="remat must be one of .* or 'auto'"):
    common.load_model(config)
  config.remat, config.layout = "full", "list"
  with pytest.raises(ValueError, match="applies to the stacked layout"):
    common.load_model(config)
