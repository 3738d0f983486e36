"""Run under ``mpiexec -n 2``: MPIComm's exchange (over memory runs, and bucketed) against a numpy reference.

The gradients are views of one arena per rank, laid out in a different order on each rank (so the ranks' memory runs
differ and must be agreed on), with one large run (reduced in place), small runs (packed) and separate arrays.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

from ortflow.trainer.comm import MPIComm

comm = MPIComm(Path(tempfile.mkdtemp()) / "hb", 60.0)
shapes = [(7, 5), (3,), (64,), (1,), (40, 3), (2, 2, 2), (129, 130), (200, 100), (0,), (90, 90)]
all_ranks = [[np.random.default_rng([r, i]).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
             for r in range(comm.size)]  # fmt: skip
divisor = 3.0
sums = [all_ranks[0][i] + all_ranks[1][i] for i in range(len(shapes))]  # a + b: the same in any algorithm's order
expected = [s * np.float32(1.0 / divisor) for s in sums]  # the trainer's mean: the sum times float32(1/divisor)


def carved(rank: int) -> list[np.ndarray]:
    """Rank 0: gradients 0..7 back to back, then a gap, then 9; rank 1: another order in which only 0 -> 1 and
    6 -> 7 are adjacent as on rank 0."""
    order = [0, 1, 2, 3, 4, 5, 6, 7, 9] if rank == 0 else [5, 4, 3, 2, 0, 1, 6, 7, 9]
    sizes = [int(np.prod(s)) for s in shapes]
    arena = np.zeros(sum(sizes) + 64, np.float32)
    out: list = [None] * len(shapes)
    at = 0
    for i in order:
        out[i] = arena[at : at + sizes[i]].reshape(shapes[i])
        out[i][...] = all_ranks[rank][i]
        at += sizes[i] + (64 if i == 7 else 0)
    out[8] = np.zeros(shapes[8], np.float32)
    return out


# Buckets of 1000 and 4096 values: tens of collectives (a bucket of 1 value would be 45k, too slow on a loaded host).
for bucket_values, layout in [(0, "carved"), (0, "separate"), (1000, "separate"), (4096, "carved"),
                              (100_000, "separate")]:  # fmt: skip
    comm.bucket_values = bucket_values  # 0: the default exchange (memory runs in place, small ones packed)
    grads = carved(comm.rank) if layout == "carved" else [g.copy() for g in all_ranks[comm.rank]]
    for repeat in range(2):  # the second call reuses the plan
        for g, original in zip(grads, all_ranks[comm.rank], strict=True):
            g[...] = original
        scalars = np.array([comm.rank + 1.0, 0.5], dtype=np.float32)
        comm.average_gradients(grads, divisor, scalars)
        label = f"bucket_values {bucket_values}, {layout}, call {repeat}"
        for got, want in zip(grads, expected, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=label)
        np.testing.assert_allclose(scalars, [sum(range(1, comm.size + 1)), 0.5 * comm.size])
        first = comm.comm.bcast(np.concatenate([g.reshape(-1) for g in grads]) if comm.rank == 0 else None, root=0)
        assert np.array_equal(first, np.concatenate([g.reshape(-1) for g in grads])), f"ranks differ: {label}"
    if bucket_values == 0 and layout == "carved":
        # 6 and 7 form one run reduced in place; 0 + 1 joined too but small (packed), as is 9 (8100 values)
        assert [v.size for v in comm._runs.views] == [129 * 130 + 200 * 100], [v.size for v in comm._runs.views]
        assert comm._runs.small == [0, 1, 2, 3, 4, 5, 9], comm._runs.small
comm.close()
print(f"rank {comm.rank} exchange ok", flush=True)
sys.exit(0)
