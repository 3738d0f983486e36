"""Test-only rank entry: the real ``run_rank`` of a 2-stage pipeline whose stage 1 (rank 1) hangs in its first
backward call. Usage: mpiexec -n 2 python fault_stage.py RUN_DIR"""

import logging
import sys
import time
from pathlib import Path

import ortflow.trainer.__main__ as entry
from ortflow.trainer.parallel import pipeline_stage as stages

real_backward = stages.PipelineStage.backward


def backward(self, feeds, grads):
    if self.stage == 1:
        time.sleep(3600)
    return real_backward(self, feeds, grads)


stages.PipelineStage.backward = backward
logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(Path(sys.argv[1])))
