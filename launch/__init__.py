"""Launchers: the same experiment command on a TPU VM or a SLURM GPU node."""
