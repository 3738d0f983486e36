"""The fold under ``mpiexec -n 2``: MPIComm's deferred scale, and real training runs bitwise equal to the eager ones."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow.trainer.metrics import read_progress
from ortflow.trainer.runtime import FOLD_ENV
from tests.support.runs import MPIEXEC, final_parameters, make_run, run_ranks_together

pytestmark = pytest.mark.mpi

FOLDED = "gradient scales folded"


def test_deferred_exchange_leaves_the_sums_and_folded_updates_match_eager_at_two_ranks():
    script = str(Path(__file__).with_name("exchange_fold_rank.py"))
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("exchange fold ok") == 2


def digests(output: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> parameter sha256, from the ranks' log lines."""
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_clipped_two_rank_training_with_the_fold_equals_the_eager_passes_bitwise(tmp_path, monkeypatch, zero_stage):
    # 3 micro-batches x 2 ranks: the mean's scale float32(1/6) rounds; max_grad_norm far below the norms: every
    # update clips (with its own factor).
    sections = {"distributed": {"num_ranks": 2, "zero_stage": zero_stage},
                "train": {"batch_size": 4, "gradient_accumulation_steps": 3, "num_train_steps": 24},
                "optimizer": {"learning_rate": 0.01, "max_grad_norm": 0.01}}  # fmt: skip
    folded = make_run(tmp_path, "folded", **sections)
    eager = make_run(tmp_path, "eager", **sections)
    monkeypatch.delenv(FOLD_ENV, raising=False)
    out_folded, out_eager = run_ranks_together(folded, eager, envs=[{}, {FOLD_ENV: "0"}])  # independent: at once
    assert out_folded.returncode == 0, out_folded.stdout[-3000:]
    assert out_eager.returncode == 0, out_eager.stdout[-3000:]
    assert out_folded.stdout.count(FOLDED) == 2 and FOLDED not in out_eager.stdout  # each run took its path
    for cfg in (folded, eager):
        assert read_progress(cfg.output_dir)["grad_norm"] > 0.01  # clipping applied
    p_folded, p_eager = final_parameters(folded), final_parameters(eager)
    assert p_folded.keys() == p_eager.keys()
    for name in p_eager:
        assert np.array_equal(p_folded[name], p_eager[name]), name
    assert digests(out_folded.stdout) == digests(out_eager.stdout) != {}  # every checkpoint, both ranks
