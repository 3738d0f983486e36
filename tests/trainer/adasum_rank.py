"""Run under mpiexec by test_adasum.py: each rank reduces its vectors with Adasum and saves the result.

Usage: adasum_rank.py OUT_DIR CASE, where CASE is random | identical | orthogonal | zeros.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ortflow.trainer.comm import create_communicator
from ortflow.trainer.comm.adasum import adasum_allreduce

COUNTS = [7, 1, 0, 130, 33, 64]  # uneven tensors, an empty one, splits that cut tensors at every level


def contribution(case: str, rank: int, size: int) -> np.ndarray:
    """This rank's packed vector for the named case (test_adasum.py rebuilds the same ones)."""
    total = sum(COUNTS)
    if case == "random":
        rng = np.random.default_rng(100 + rank)
        # Different scales per tensor, so per-layer coefficients matter.
        scales = np.repeat(np.array([1.0, 10.0, 1.0, 0.01, 3.0, 1e3]), COUNTS)
        return (rng.normal(size=total) * scales).astype(np.float32)
    if case == "identical":
        return np.random.default_rng(7).normal(size=total).astype(np.float32)
    if case == "orthogonal":
        vector = np.zeros(total, dtype=np.float32)
        vector[rank::size] = np.random.default_rng(rank).normal(size=len(range(rank, total, size)))
        return vector
    if case == "zeros":  # rank 0 contributes nothing: the others' result must be unaffected by it
        return np.zeros(total, np.float32) if rank == 0 else contribution("random", rank, size)
    raise ValueError(case)


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    comm = create_communicator(out / ".ranks", timeout_s=60)
    flat = contribution(case, comm.rank, comm.size)
    adasum_allreduce(flat, COUNTS, comm)
    np.save(out / f"{case}-rank{comm.rank}.npy", flat)
    comm.close()


if __name__ == "__main__":
    main()
