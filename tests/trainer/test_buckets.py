"""The exchange's bucket plan (pure) and the bucketed exchange itself under ``mpiexec -n 2``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ortflow.trainer.comm.buckets import plan_buckets
from tests.support.runs import MPIEXEC


def _covered(sizes, buckets):
    seen = {i: [] for i in range(len(sizes))}
    for bucket in buckets:
        for piece in bucket.pieces:
            seen[piece.index].append((piece.start, piece.stop))
    return {i: sorted(v) for i, v in seen.items()}


@pytest.mark.parametrize("bucket", [1, 4, 10, 1000])
def test_every_value_is_in_exactly_one_bucket(bucket):
    sizes = [3, 25, 1, 0, 9, 40, 2]
    covered = _covered(sizes, plan_buckets(sizes, bucket))
    for index, size in enumerate(sizes):
        spans = covered[index]
        assert sum(b - a for a, b in spans) == size
        assert all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1))  # contiguous, no overlap


def test_large_gradients_are_reduced_in_place_in_equal_slices_small_ones_packed():
    buckets = plan_buckets([25, 3, 2, 4], bucket_values=10)
    in_place = [b for b in buckets if not b.packed]
    assert [(b.pieces[0].index, b.pieces[0].size) for b in in_place] == [(0, 9), (0, 9), (0, 7)]
    packed = [b for b in buckets if b.packed]
    assert [[p.index for p in b.pieces] for b in packed] == [[1, 2, 3]]
    assert all(b.size <= 10 for b in in_place)


def test_packs_close_when_full():
    buckets = plan_buckets([3, 3, 3, 3], bucket_values=8)
    assert [[p.index for p in b.pieces] for b in buckets] == [[0, 1, 2], [3]]


@pytest.mark.mpi
def test_exchange_averages_like_numpy_at_two_ranks_runs_and_bucketed():
    script = str(Path(__file__).with_name("exchange_rank.py"))
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("exchange ok") == 2
