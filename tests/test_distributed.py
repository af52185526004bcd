"""Several processes, one run (`jax.distributed` over local CPU processes, gloo collectives).

The tiny GRPO experiment as 2 processes of 1 CPU device each logs exactly what
1 process with 2 CPU devices logs on the same (data = 2) mesh, with the rollout's
rows and the rewards' host work split between the processes; only process 0
writes the logs; a checkpoint written by 2 processes resumes in 1 and the
reverse, each continuing as the uninterrupted run did.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_agents.parallel import distributed
from launch import local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_TINY = "experiments/configs/grpo_arithmetic.py:tiny"
# What depends on the clock or the machine's load, not on the computation.
TIMING = ("time", "per_s")


def test_settings_from_env():
  assert distributed.settings_from_env({}) is None
  assert distributed.settings_from_env({"JAXRL_DISTRIBUTED": "auto"}) == {}
  assert distributed.settings_from_env({
      "JAXRL_COORDINATOR": "10.0.0.1:1234", "JAXRL_NUM_PROCESSES": "4",
      "JAXRL_PROCESS_ID": "3"}) == {"coordinator_address": "10.0.0.1:1234",
                                    "num_processes": 4, "process_id": 3}


def test_importing_experiments_and_building_configs_starts_no_backend():
  # `jax.distributed.initialize` must run before anything starts an XLA backend, and the
  # experiments call it after absl has parsed `--config` (which builds the config): a
  # backend started by an import or a config's construction fails every multi-process run.
  code = (
      "import glob, importlib, importlib.util, os\n"
      "from jax._src import xla_bridge\n"
      "for path in sorted(glob.glob('experiments/*.py')):\n"
      "  importlib.import_module('experiments.' + os.path.basename(path)[:-3])\n"
      "for path in sorted(glob.glob('experiments/configs/*.py')):\n"
      "  spec = importlib.util.spec_from_file_location('c', path)\n"
      "  module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
      "  if hasattr(module, 'get_config'):\n"
      "    module.get_config(); module.get_config('tiny')\n"
      "assert not xla_bridge.backends_are_initialized(), 'a backend was started'\n"
      "print('ok')\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("env, match", [
    ({"JAXRL_COORDINATOR": "nohost"}, "host:port"),
    ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "two", "JAXRL_PROCESS_ID": "0"},
     "JAXRL_NUM_PROCESSES must be an integer"),
    ({"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "2"},
     r"JAXRL_PROCESS_ID=2 must be in \[0, JAXRL_NUM_PROCESSES=2\)"),
    ({"JAXRL_DISTRIBUTED": "yes"}, "'auto' or unset"),
])
def test_settings_from_env_names_a_bad_variable(env, match):
  with pytest.raises(ValueError, match=match):
    distributed.settings_from_env(env)


def test_local_launcher_sets_each_process_apart():
  base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1", "A": "b"}
  env = local.process_env(base, 1, 3, 5555, 2)
  assert env["A"] == "b" and env["JAXRL_COORDINATOR"] == "localhost:5555"
  assert (env["JAXRL_NUM_PROCESSES"], env["JAXRL_PROCESS_ID"]) == ("3", "1")
  assert env["XLA_FLAGS"].split() == ["--xla_foo=1",
                                      "--xla_force_host_platform_device_count=2"]
  assert env["JAXRL_INIT_TIMEOUT_S"] == "120"  # local peers meet in seconds, not JAX's 300
  assert local.process_env({"JAXRL_INIT_TIMEOUT_S": "7"}, 0, 2, 1, 1)[
      "JAXRL_INIT_TIMEOUT_S"] == "7"
  with pytest.raises(SystemExit, match="experiment module"):
    local.parse(["--processes=2", "--", "rm", "-rf", "/"])


def _run(workdir, steps, processes, tmp_path):
  """The tiny GRPO run on a data = 2 mesh: 2 processes x 1 device or 1 process x 2 devices.
  4 prompts: each device samples 2 of them; 7 held-out questions: the processes score 4
  and 3 of the replies."""
  flags = [f"--config={GRPO_TINY}", "--config.mesh.data=2", f"--config.steps={steps}",
           "--config.prompts_per_step=4", "--config.eval_size=7",
           f"--workdir={workdir}", f"--compilation_cache={tmp_path / 'cache'}"]
  if processes == 2:
    cmd = [sys.executable, "-m", "launch.local", "--processes=2", "--devices_per_process=1",
           f"--log_dir={tmp_path / 'logs'}", "--timeout_s=500", "--", "experiments.grpo",
           *flags]
    env = dict(os.environ)
  else:
    cmd = [sys.executable, "-m", "experiments.grpo", *flags]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  for name in ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID"):
    env.pop(name, None)
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  logs = ""
  if processes == 2 and os.path.exists(tmp_path / "logs" / "process_1.log"):
    logs = (tmp_path / "logs" / "process_1.log").read_text()[-3000:]
  assert proc.returncode == 0, proc.stderr[-4000:] + "\nprocess 1:\n" + logs


def _records(workdir, name="metrics.jsonl"):
  with open(os.path.join(workdir, name)) as f:
    return [json.loads(line) for line in f]


def _computed(records):
  """Every logged figure but those of the clock."""
  return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


@pytest.mark.slow
def test_two_processes_log_what_one_process_logs_and_resume_across(tmp_path, crashed_copy):
  two, one = tmp_path / "two", tmp_path / "one"
  _run(two, 3, 2, tmp_path)
  _run(one, 3, 1, tmp_path)
  two_records, one_records = _records(two), _records(one)
  # One writer: every step and evaluation once, not once per process.
  assert [(r["kind"], r["step"]) for r in two_records] == \
      [(r["kind"], r["step"]) for r in one_records]
  assert sorted(r["step"] for r in two_records if r["kind"] == "train") == [1, 2, 3]
  assert _computed(two_records) == _computed(one_records)
  assert _records(two, "samples.jsonl") == _records(one, "samples.jsonl")
  assert sorted(os.listdir(two / "checkpoints")) == ["1", "2", "3"]

  # The checkpoint of step 2 written by 2 processes resumes in 1, and the reverse: each
  # run's workdir as a crash after the checkpoint of step 2 would leave it (step 3's log
  # lines written, its checkpoint not), resumed, ends where the uninterrupted run did.
  for first, then in ((two, 1), (one, 2)):
    workdir = crashed_copy(first, tmp_path / f"resumed_{first.name}_in_{then}", 2)
    _run(workdir, 3, then, tmp_path)
    assert _computed(_records(workdir)) == _computed(one_records), (first.name, then)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("module, config", [
    ("experiments.ppo", "experiments/configs/ppo_frozen_lake.py:tiny"),  # lax.scan episodes
    ("experiments.grpo", "experiments/configs/grpo_calculator.py:tiny"),  # a host tool env
    # its round buffer is replaced mid-run: the new one must be a global array
    ("experiments.rejection_sampling", "experiments/configs/rejection_sampling_arithmetic.py:tiny"),
    # it samples its preference pairs first: every process samples, process 0 writes them
    ("experiments.dpo", "experiments/configs/dpo_arithmetic.py:tiny"),
])
def test_other_experiments_run_as_two_processes(tmp_path, module, config):
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "launch.local", "--processes=2", f"--log_dir={tmp_path}",
         "--timeout_s=500", "--", module, f"--config={config}", "--config.mesh.data=2",
         "--config.steps=2", "--config.checkpoint_every=1", f"--workdir={workdir}",
         f"--compilation_cache={tmp_path / 'cache'}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  train = [r["step"] for r in _records(workdir) if r["kind"] == "train"]
  assert train == [1, 2]  # written once, by process 0
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]


def test_a_mesh_short_of_the_processes_devices_is_refused_before_anything_runs(tmp_path):
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "launch.local", "--processes=2", f"--log_dir={tmp_path}",
         "--timeout_s=300", "--", "experiments.grpo", f"--config={GRPO_TINY}",
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "2 processes with 2 devices in all" in proc.stderr
  assert "--config.mesh.data=-1" in proc.stderr
  assert not workdir.exists()


_WITH_PROCESS_SETTINGS = (
    "import os, runpy, sys\n"
    "i = int(os.environ['JAXRL_PROCESS_ID'])\n"
    "sys.argv = ['grpo'] + sys.argv[1:] + ([f'--config.optimizer.learning_rate={1e-3 * (i + 1)}',"
    " f'--config.seed={i}'] if i else [])\n"
    "runpy.run_module('experiments.grpo', run_name='__main__')\n")


def test_processes_started_with_different_configs_are_refused_naming_the_keys(tmp_path, capfd,
                                                                             monkeypatch):
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-c", _WITH_PROCESS_SETTINGS, f"--config={GRPO_TINY}",
         "--config.mesh.data=2", f"--workdir={workdir}", "--compilation_cache=none"]
  monkeypatch.setenv("PYTHONPATH", REPO)
  monkeypatch.chdir(REPO)
  status = local.launch(cmd, processes=2, devices_per_process=1, log_dir=str(tmp_path),
                        timeout_s=240)
  assert status not in (0, 124)
  logs = capfd.readouterr().err + (tmp_path / "process_1.log").read_text()
  assert "started with different configs" in logs
  assert "optimizer.learning_rate = 0.002 (process 0: " in logs
  assert "seed = 1 (process 0: 0)" in logs
  assert not (workdir / "metrics.jsonl").exists()
