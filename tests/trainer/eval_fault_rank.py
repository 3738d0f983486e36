"""Test-only rank entry: the real ``run_rank`` whose evaluation raises on every rank (the final evaluation, when the
run has no periodic one). Usage: mpiexec -n N python eval_fault_rank.py RUN_DIR."""

import logging
import sys
from pathlib import Path

import ortflow.trainer.__main__ as entry
from ortflow.dataprep import loader


def failing(self, max_batches=None):
    raise ValueError("injected failure in the final evaluation")
    yield  # pragma: no cover


loader.EvalLoader.weighted_batches = failing
logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(Path(sys.argv[1])))
