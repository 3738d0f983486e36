"""Test-only rank entry: the real ``run_rank`` whose evaluation raises on every rank (the final evaluation, when the
run has no periodic one) and whose checkpoint writes take a second longer (a slow disk). Usage: mpiexec -n N python
eval_fault_rank.py RUN_DIR."""

import logging
import sys
import time
from pathlib import Path

import ortflow.trainer.__main__ as entry
from ortflow.checkpoints.h5state import write_state
from ortflow.dataprep import loader


def failing(self, max_batches=None):
    raise ValueError("injected failure in the final evaluation")
    yield  # pragma: no cover


def slow_write(state, folder):  # a slow disk: the ranks that do not write reach the final evaluation first
    time.sleep(1.0)
    return write_state(state, folder)


loader.EvalLoader.weighted_batches = failing
entry.write_state = slow_write
logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(Path(sys.argv[1])))
