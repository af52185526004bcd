"""Launchers: their dry runs print the commands they would run; the SLURM script parses."""

import os
import subprocess

import pytest

from launch import slurm, tpu_vm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPERIMENT = ["experiments.grpo", "--config=experiments/configs/grpo_arithmetic.py",
              "--config.mesh.fsdp=-1", "--workdir=runs/x y"]


def test_tpu_vm_dry_run_prints_every_step_and_runs_nothing(capsys):
  assert tpu_vm.main(["--name=rl", "--zone=us-west4-a", "--dry_run", "--"] + EXPERIMENT) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("gcloud compute tpus tpu-vm describe rl --zone=us-west4-a || "
                           "gcloud compute tpus tpu-vm create rl")
  assert "--accelerator-type=v5litepod-8" in out[0]
  assert out[1].startswith("git ls-files -z") and "tar -czf" in out[1]
  assert "scp" in out[2] and "--worker=all" in out[2]
  assert "--worker=all" in out[4] and "scripts/setup.sh tpu" in out[4]
  assert "-m experiments.grpo" in out[4] and "'--workdir=runs/x y'" in out[4]


def test_tpu_vm_runs_a_multi_worker_slice_as_one_distributed_run(capsys):
  # One worker: one process, nothing to initialize.
  assert tpu_vm.main(["--name=rl", "--zone=z", "--accelerator=v4-8", "--dry_run", "--"]
                     + EXPERIMENT) == 0
  assert "JAXRL_DISTRIBUTED" not in capsys.readouterr().out
  assert tpu_vm.main(["--name=rl", "--zone=z", "--accelerator=v5litepod-64", "--dry_run",
                      "--"] + EXPERIMENT) == 0
  run = capsys.readouterr().out.splitlines()[4]
  assert "--worker=all" in run and "JAXRL_DISTRIBUTED=auto nohup .venv/bin/python" in run


def test_tpu_vm_refuses_a_missing_experiment():
  with pytest.raises(SystemExit, match="experiment module"):
    tpu_vm.main(["--name=rl", "--zone=z", "--dry_run", "--", "rm", "-rf"])


def test_slurm_dry_run_prints_a_script_bash_accepts(capsys, tmp_path):
  assert slurm.main(["--gpus=4", "--partition=gpu", "--dry_run", "--"] + EXPERIMENT) == 0
  text = capsys.readouterr().out
  assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --partition=gpu" in text
  assert "scripts/setup.sh cuda" in text
  assert "srun .venv/bin/python -m experiments.grpo" in text and "'--workdir=runs/x y'" in text
  path = tmp_path / "job.sbatch"
  path.write_text(text)
  assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
  with pytest.raises(SystemExit, match="--gpus must be >= 1"):
    slurm.main(["--gpus=0", "--dry_run", "--"] + EXPERIMENT)


def test_slurm_several_nodes_run_one_distributed_process_each(capsys, tmp_path):
  assert slurm.main(["--nodes=4", "--gpus=8", "--dry_run", "--"] + EXPERIMENT) == 0
  text = capsys.readouterr().out
  assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=1" in text
  assert "export JAXRL_DISTRIBUTED=auto" in text
  assert text.index("JAXRL_DISTRIBUTED") < text.index("srun")
  path = tmp_path / "job.sbatch"
  path.write_text(text)
  assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
  assert slurm.main(["--dry_run", "--"] + EXPERIMENT) == 0
  assert "JAXRL_DISTRIBUTED" not in capsys.readouterr().out  # one node: one process
  with pytest.raises(SystemExit, match="--nodes must be >= 1"):
    slurm.main(["--nodes=0", "--dry_run", "--"] + EXPERIMENT)


_DIES_OR_WAITS = ("import os, sys, time; i = int(os.environ['JAXRL_PROCESS_ID']); "
                  "time.sleep(120) if i == 0 else os.kill(os.getpid(), 9)")


def test_local_launch_fails_fast_naming_a_process_other_than_the_first(tmp_path, capsys):
  import sys
  import time

  from launch import local

  start = time.monotonic()
  status = local.launch([sys.executable, "-c", _DIES_OR_WAITS], processes=2,
                        devices_per_process=1, log_dir=str(tmp_path))
  elapsed = time.monotonic() - start
  assert status == -9
  assert elapsed < 30, elapsed  # process 0 would have waited 120 s
  err = capsys.readouterr().err
  assert "process 1 of 2 was killed by SIGKILL" in err
  assert str(tmp_path / "process_1.log") in err


_NEVER_JOINS = ("import os, time; i = int(os.environ['JAXRL_PROCESS_ID']); "
                "time.sleep(120) if i == 1 else None; "
                "import logging; logging.basicConfig(level=logging.INFO); "
                "from jaxrl_agents.parallel import distributed; distributed.initialize_from_env()")


def test_a_peer_that_never_connects_is_reported_at_the_init_timeout(tmp_path, capfd,
                                                                   monkeypatch):
  import sys
  import time

  from launch import local

  monkeypatch.setenv("JAXRL_INIT_TIMEOUT_S", "3")
  monkeypatch.setenv("PYTHONPATH", REPO)
  start = time.monotonic()
  status = local.launch([sys.executable, "-c", _NEVER_JOINS], processes=2,
                        devices_per_process=1, log_dir=str(tmp_path))
  elapsed = time.monotonic() - start
  err = capfd.readouterr().err
  assert status == -6, err[-2000:]
  assert elapsed < 90, elapsed  # process 1 would have slept 120 s; JAX's default wait is 300
  assert "process 0 of 2 was killed by SIGABRT" in err
  assert "waiting up to 3 s for all processes to connect" in err
  assert "JAXRL_INIT_TIMEOUT_S" in err


def test_a_coordinator_port_in_use_is_named_before_jax_starts():
  import socket

  from jaxrl_agents.parallel import distributed

  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = {"JAXRL_COORDINATOR": f"localhost:{port}", "JAXRL_NUM_PROCESSES": "2",
           "JAXRL_PROCESS_ID": "0"}
    with pytest.raises(RuntimeError, match=f"port {port} is already in use"):
      distributed.initialize_from_env(env)
  with pytest.raises(ValueError, match="JAXRL_INIT_TIMEOUT_S must be a whole number"):
    distributed.settings_from_env({**env, "JAXRL_INIT_TIMEOUT_S": "soon"})
