"""The launching process's side of training: start the ranks here (``mpiexec``), through Slurm, or on Kubernetes.

Every launcher starts the same ranks (``python -m ortflow.trainer RUN_DIR``) on the same run folder, and resumes
from its newest complete checkpoint; they differ only in where the ranks run and how they are started and stopped.
This package also chooses ranks x threads for a host (:mod:`ortflow.launch.layout`, :mod:`ortflow.launch.tune`).
It imports nothing from ortflow but the config.
"""
