"""Run under ``mpiexec -n 2``: MPIComm's exchange (posted and bucketed) against a numpy reference."""

import sys
import tempfile
from pathlib import Path

import numpy as np

from ortflow.trainer.comm import MPIComm

comm = MPIComm(Path(tempfile.mkdtemp()) / "hb", 60.0)
shapes = [(7, 5), (3,), (64,), (1,), (40, 3), (2, 2, 2), (129, 130)]  # the last one reduced in place
all_ranks = [[np.random.default_rng([r, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
             for r in range(comm.size)]  # fmt: skip
expected = [sum(ranks[i] for ranks in all_ranks) / np.float32(3.0) for i in range(len(shapes))]
for bucket_values in (0, 1, 8, 50, 10_000):  # 0: the default exchange (one in-place collective per gradient)
    grads = [g.copy() for g in all_ranks[comm.rank]]
    scalars = np.array([comm.rank + 1.0, 0.5], dtype=np.float32)
    comm.bucket_values = bucket_values
    comm.average_gradients(grads, 3.0, scalars)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"bucket_values {bucket_values}")
    np.testing.assert_allclose(scalars, [sum(range(1, comm.size + 1)), 0.5 * comm.size])
comm.close()
print(f"rank {comm.rank} exchange ok", flush=True)
sys.exit(0)
