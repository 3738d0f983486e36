"""A non-finite loss or gradient norm stops every rank at the same update; the last good checkpoint stays newest."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ortflow.checkpoints import list_complete
from ortflow.trainer.guards import NonFiniteError, check_update
from tests.support.runs import make_run, run_ranks

INJECT = str(Path(__file__).with_name("inject.py"))


def test_finite_updates_pass_and_non_finite_ones_name_the_step():
    assert check_update(3, 0.5, 1.2)
    assert check_update(3, 0.5, None)
    with pytest.raises(NonFiniteError, match=r"weight update 12: non-finite loss \(loss nan"):
        check_update(12, math.nan, 1.0)
    with pytest.raises(NonFiniteError, match="weight update 4: non-finite loss and gradient norm"):
        check_update(4, math.inf, math.nan)


def test_loss_scaling_skips_an_overflowing_update_instead_of_stopping():
    assert check_update(5, 0.5, math.inf, skip_overflow=True) is False


@pytest.mark.mpi
def test_nan_gradients_on_one_rank_stop_both_at_that_update(tmp_path):
    cfg = make_run(tmp_path, "nan", distributed={"num_ranks": 2}, checkpoint={"period": 5, "max_num_checkpoints": 3})
    out = run_ranks(cfg, INJECT, "nan-grad:1:7")
    assert out.returncode == 4, out.stdout
    assert "weight update 7: non-finite gradient norm" in out.stdout
    assert "Traceback" not in out.stdout
    assert [c.step for c in list_complete(cfg.checkpoints_dir)] == [5]  # nothing written after the bad update


@pytest.mark.mpi
def test_an_artifact_that_differs_from_configure_stops_the_job_before_any_step(tmp_path):
    import json

    cfg = make_run(tmp_path, "artifact", distributed={"num_ranks": 2})
    record = json.loads((cfg.output_dir / "configure.json").read_text())
    assert set(record["artifact_sha256"]) == {"training_model.onnx", "eval_model.onnx", "checkpoint"}
    model = cfg.artifacts_dir / "training_model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")  # the file changed after configure (its sealed record did not)
    out = run_ranks(cfg)
    assert out.returncode != 0
    assert "training_model.onnx does not match its sha256 in configure.json" in out.stdout
    assert "Traceback" not in out.stdout and not list_complete(cfg.checkpoints_dir)
