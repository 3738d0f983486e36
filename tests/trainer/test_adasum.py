"""Adasum's tree reduction under mpiexec (2 and 4 ranks) against a float64 numpy reference, and its properties."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow.trainer.comm.adasum import adasum_allreduce, is_power_of_two
from tests.support.runs import MPIEXEC
from tests.trainer.adasum_rank import COUNTS, contribution

SCRIPT = str(Path(__file__).with_name("adasum_rank.py"))


def reference(vectors: list[np.ndarray], counts: list[int]) -> np.ndarray:
    """The paper's rule in float64, pairwise up the tree (0,1), (2,3), then (01, 23), separately for every tensor."""
    bounds = np.cumsum([0, *counts])
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2], strict=True):
            out = np.empty_like(a)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                x, y = a[lo:hi], b[lo:hi]
                dot, xx, yy = x @ y, x @ x, y @ y
                cx = 1 - dot / (2 * xx) if xx >= 1e-8 else 1.0
                cy = 1 - dot / (2 * yy) if yy >= 1e-8 else 1.0
                out[lo:hi] = cx * x + cy * y
            nxt.append(out)
        level = nxt
    return level[0]


def run_case(tmp_path: Path, ranks: int, case: str) -> list[np.ndarray]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-u", SCRIPT, str(tmp_path), case],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [np.load(tmp_path / f"{case}-rank{r}.npy") for r in range(ranks)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_adasum_equals_the_float64_reference_and_ranks_agree_bitwise(tmp_path, ranks):
    results = run_case(tmp_path, ranks, "random")
    for r in range(1, ranks):
        assert np.array_equal(results[r], results[0]), f"rank {r} differs from rank 0"
    expected = reference([contribution("random", r, ranks) for r in range(ranks)], COUNTS)
    # fp32 rounding: each level rounds the combination once (and the inputs are fp32), so the error stays within a
    # few ulps of each tensor's scale; the tensors here span 0.01 to 1e3, hence a per-tensor relative check.
    bounds = np.cumsum([0, *COUNTS])
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            scale = np.abs(expected[lo:hi]).max()
            np.testing.assert_allclose(results[0][lo:hi], expected[lo:hi], rtol=0, atol=4e-7 * scale * ranks)


@pytest.mark.mpi
def test_adasum_of_identical_vectors_is_that_vector(tmp_path):
    results = run_case(tmp_path, 4, "identical")
    for result in results:
        assert np.array_equal(result, contribution("identical", 0, 4))


@pytest.mark.mpi
def test_adasum_of_orthogonal_vectors_is_their_sum(tmp_path):
    results = run_case(tmp_path, 4, "orthogonal")
    total = sum(contribution("orthogonal", r, 4).astype(np.float64) for r in range(4))
    for result in results:
        np.testing.assert_array_equal(result, total.astype(np.float32))


@pytest.mark.mpi
def test_a_zero_contribution_changes_nothing(tmp_path):
    results = run_case(tmp_path, 2, "zeros")
    assert np.array_equal(results[0], contribution("zeros", 1, 2))


class _Pair:
    """Two in-process 'ranks' are not needed: one rank of one reduces to itself."""

    rank, size = 0, 1


def test_one_rank_is_the_identity_and_bad_sizes_are_refused():
    flat = np.arange(10, dtype=np.float32)
    adasum_allreduce(flat, [4, 6], _Pair())
    assert np.array_equal(flat, np.arange(10, dtype=np.float32))
    with pytest.raises(ValueError, match="elements"):
        adasum_allreduce(flat, [4, 5], _Pair())
    assert [n for n in range(1, 9) if is_power_of_two(n)] == [1, 2, 4, 8]
