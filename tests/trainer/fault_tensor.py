"""Test-only rank entry: the real ``run_rank`` of a tensor-parallel pair whose rank 1 hangs in its first micro-batch.
Usage: mpiexec -n 2 python fault_tensor.py RUN_DIR"""

import logging
import sys
import time
from pathlib import Path

import ortflow.trainer.__main__ as entry
from ortflow.trainer.parallel import tensor_parallel_body as tensor

real_micro_step = tensor.TensorParallel.micro_step


def micro_step(self, batch):
    if self.tp_rank == 1:
        time.sleep(3600)
    return real_micro_step(self, batch)


tensor.TensorParallel.micro_step = micro_step
logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(Path(sys.argv[1])))
