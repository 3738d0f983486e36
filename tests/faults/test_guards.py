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


def test_out_of_memory_is_named_with_its_fixes_and_other_failures_are_not():
    from ortflow.trainer.outcome import out_of_memory

    gpu = out_of_memory(RuntimeError("[ONNXRuntimeError] : 1 : FAIL : CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ; "
                                     "GPU=0 ; expr=cublasCreate(&cublas_handle_);"))
    assert gpu.startswith("ran out of GPU memory (CUBLAS_STATUS_ALLOC_FAILED)")
    assert "distributed.zero_stage 1" in gpu and "distributed.pipeline_parallel_size" in gpu
    assert "train.batch_size" in gpu and "precision.use_mixed_precision" in gpu
    arena = out_of_memory(RuntimeError("BFCArena::AllocateRawInternal Failed to allocate memory for requested buffer "
                                       "of size 8589934592"))
    assert arena.startswith("ran out of host memory") and "fewer ranks per host" in arena
    assert out_of_memory(MemoryError()).startswith("ran out of host memory (MemoryError)")
    assert out_of_memory(RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Unexpected input data type")) is None
    assert out_of_memory(KeyboardInterrupt()) is None


@pytest.mark.mpi
def test_a_rank_out_of_gpu_memory_stops_the_job_with_one_line_naming_the_fixes(tmp_path):
    cfg = make_run(tmp_path, "oom", distributed={"num_ranks": 2})
    out = run_ranks(cfg, INJECT, "oom:1:3")
    assert out.returncode == 1, out.stdout
    assert "rank 1 ran out of GPU memory (CUBLAS_STATUS_ALLOC_FAILED)" in out.stdout, out.stdout
    assert "distributed.pipeline_parallel_size" in out.stdout
    assert "Traceback" not in out.stdout and "cuda_call.cc" not in out.stdout


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
