"""Test-only rank entry: the real ``run_rank`` with an fp16 overflow injected at one weight update.

Usage: mpiexec -n N python overflow_rank.py STEP RUN_DIR. At update STEP every rank feeds the loss scale 2**100
instead of the scaler's own value: the scaled loss is finite in fp32, but the fp16 backward overflows, so the
averaged gradients are inf/nan, exactly as a too-high dynamic scale would make them.
"""

import sys
from pathlib import Path

import numpy as np

import ortflow.trainer.__main__ as entry
from ortflow.trainer.loss_scale import INPUT_NAME, LossScaler

step, run_dir = int(sys.argv[1]), Path(sys.argv[2])
real_init = entry.init_runtime


class InjectingScaler(LossScaler):
    """The run's scaler, except that the micro-batches of update ``step`` get a scale of 2**100."""

    updates_seen: int = 0

    def feed(self, feeds):
        fed = super().feed(feeds)
        if self.updates_seen + 1 == step:
            fed[INPUT_NAME] = np.array(2.0**100, dtype=np.float32)
        return fed

    def update(self, grad_norm):
        self.updates_seen += 1
        return super().update(grad_norm)


def init_with_injection(path, cfg, comm):
    rt = real_init(path, cfg, comm)
    rt.loss_scale = InjectingScaler(**vars(rt.loss_scale))
    rt.loss_scale.updates_seen = rt.resume.step if rt.resume else 0
    return rt


entry.init_runtime = init_with_injection
import logging  # noqa: E402

logging.basicConfig(level=logging.INFO, force=True)
sys.exit(entry.run_rank(run_dir))
