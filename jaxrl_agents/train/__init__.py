"""The run: harness (workdir, resume, schedule, logging), checkpoints, metrics, optimizer,
compile-ahead, the overlapped rollout, host memory."""
