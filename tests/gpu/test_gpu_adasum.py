"""Adasum on 2 GPU ranks through NCCLComm (CuPy p2p on the device): the float64 reference, ranks bitwise equal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.gpu.test_gpu_training import REASON
from tests.trainer.adasum_rank import COUNTS, contribution
from tests.trainer.test_adasum import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_nccl_adasum_matches_the_reference_and_ranks_agree(tmp_path):
    from ortflow.launch.local import launcher_flavor
    from tests.support.runs import MPIEXEC

    mpiexec = MPIEXEC if Path(MPIEXEC).exists() else shutil.which("mpiexec")
    tag = "--tag-output" if launcher_flavor(Path(mpiexec)) == "openmpi" else "-prepend-rank"
    script = str(Path(__file__).with_name("adasum_gpu_rank.py"))
    out = subprocess.run([mpiexec, "-n", "2", tag, sys.executable, "-u", script, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert out.returncode == 0, out.stdout[-4000:]
    results = [np.load(tmp_path / f"gpu-rank{r}.npy") for r in range(2)]
    assert np.array_equal(results[0], results[1])
    expected = reference([contribution("random", r, 2) / 2 for r in range(2)], COUNTS)
    bounds = np.cumsum([0, *COUNTS])
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            np.testing.assert_allclose(results[0][lo:hi], expected[lo:hi], rtol=0,
                                       atol=1e-6 * np.abs(expected[lo:hi]).max())
    assert [float(np.load(tmp_path / f"gpu-scalars{r}.npy")[0]) for r in range(2)] == [3.0, 3.0]
    norm = float(np.load(tmp_path / "gpu-norm0.npy")[0])
    assert norm == pytest.approx(float(np.linalg.norm(results[0].astype(np.float64))), rel=1e-6)


@pytest.mark.skipif(REASON is None and cuda_libs.gpu_count()[0] < 4, reason="needs 4 GPUs")
def test_device_exchange_on_four_gpus_matches_the_reference_in_both_modes(tmp_path):
    from ortflow.launch.local import launcher_flavor
    from tests.gpu.adasum_device_rank import START_SEED
    from tests.support.runs import MPIEXEC

    mpiexec = MPIEXEC if Path(MPIEXEC).exists() else shutil.which("mpiexec")
    tag = "--tag-output" if launcher_flavor(Path(mpiexec)) == "openmpi" else "-prepend-rank"
    script = str(Path(__file__).with_name("adasum_device_rank.py"))
    out = subprocess.run([mpiexec, "-n", "4", tag, sys.executable, "-u", script, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert out.returncode == 0, out.stdout[-4000:]
    contributions = [contribution("random", r, 4) for r in range(4)]
    bounds = np.cumsum([0, *COUNTS])

    def close(result, expected):
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if hi > lo:
                np.testing.assert_allclose(result[lo:hi], expected[lo:hi], rtol=0,
                                           atol=2e-6 * np.abs(expected[lo:hi]).max())

    grads = [np.load(tmp_path / f"grad-rank{r}.npy") for r in range(4)]
    assert all(np.array_equal(grads[0], g) for g in grads[1:])  # the ranks agree bitwise
    expected = reference(contributions, COUNTS)  # each rank's own mean: its sum over 2 micro-batches / 2
    close(grads[0], expected)
    norm = float(np.load(tmp_path / "grad-norm0.npy")[0])
    assert norm == pytest.approx(float(np.linalg.norm(expected.astype(np.float64))), rel=1e-5)
    assert [float(np.load(tmp_path / f"grad-scalars{r}.npy")[0]) for r in range(4)] == [10.0] * 4
    deltas = [np.load(tmp_path / f"delta-rank{r}.npy") for r in range(4)]
    assert all(np.array_equal(deltas[0], d) for d in deltas[1:])
    start = np.random.default_rng(START_SEED).normal(size=sum(COUNTS)).astype(np.float32)
    local = [(start + c) - start for c in contributions]  # each rank's delta as the device sees it (float32)
    combined = start.astype(np.float64) + reference(local, COUNTS)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):  # plus one rounding of start + the combination
        if hi > lo:
            ulp = np.spacing(np.abs(combined[lo:hi]).max().astype(np.float32))
            np.testing.assert_allclose(deltas[0][lo:hi], combined[lo:hi], rtol=0,
                                       atol=2e-6 * np.abs(combined[lo:hi] - start[lo:hi]).max() + ulp)
