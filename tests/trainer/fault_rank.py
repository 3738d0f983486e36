"""Test-only rank entry: the real ``run_rank`` with one fault injected on rank 1.

Usage: mpiexec -n 2 python fault_rank.py MODE RUN_DIR, MODE one of:
  raise - rank 1's data loader raises at its first batch;
  hang  - rank 1 never enters the first gradient all-reduce.
"""

import sys
import time
from pathlib import Path

import ortflow.trainer.__main__ as entry
from ortflow.dataprep import loader

mode, run_dir = sys.argv[1], Path(sys.argv[2])
real_start = entry.start_mpi


def start_with_fault(path):
    cfg, comm = real_start(path)
    if comm.rank == 1:
        if mode == "raise":
            def failing(self, cursor):
                raise ValueError("injected failure on rank 1")
                yield  # pragma: no cover

            loader.TrainLoader.iter_from = failing
        elif mode == "hang":
            def hang(*args, **kwargs):
                time.sleep(3600)

            comm.average_gradients = hang
    return cfg, comm


entry.start_mpi = start_with_fault
import logging  # noqa: E402

logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(run_dir))
