"""distributed.allreduce_dtype and reduce_sum_as_matmul: accepted where implemented, refused elsewhere with the fix."""

from __future__ import annotations

import pytest

from tests.test_config import problems_of

GPU = ["distributed.device=cuda", "distributed.use_nccl=true"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_allreduce_is_accepted_on_nccl_gpu_ranks(tmp_path, dtype):
    assert problems_of(tmp_path, *GPU, f"distributed.allreduce_dtype={dtype}") == []
    assert problems_of(tmp_path, *GPU, "precision.use_mixed_precision=true", f"distributed.allreduce_dtype={dtype}",
                       "distributed.num_ranks=2") == []  # fmt: skip
    assert problems_of(tmp_path, *GPU, f"distributed.allreduce_dtype={dtype}", "distributed.zero_stage=1",
                       "distributed.num_ranks=2") == []  # ZeRO-1's reduce-scatter sends the half type too


@pytest.mark.parametrize("settings", [
    [],  # CPU ranks (MPI)
    ["distributed.use_nccl=true"],  # CPU engine, gradients staged through the GPU
    [*GPU, "distributed.enable_adasum=true", "distributed.num_ranks=2"],
    [*GPU, "distributed.pipeline_parallel_size=2", "distributed.num_ranks=2"],
    [*GPU, "distributed.horizontal_parallel_size=2", "distributed.num_ranks=2"],
])  # fmt: skip
def test_half_allreduce_is_refused_where_the_exchange_is_not_the_nccl_all_reduce(tmp_path, settings):
    problems = problems_of(tmp_path, *settings, "distributed.allreduce_dtype=float16")
    (mine,) = [p for p in problems if p.startswith("distributed.allreduce_dtype")]
    assert "data-parallel NCCL all-reduce and the ZeRO-1 reduce-scatter of GPU ranks only" in mine
    assert "or allreduce_dtype float32" in mine


def test_unknown_allreduce_dtype_and_the_reduce_switch(tmp_path):
    assert any("allreduce_dtype" in p for p in problems_of(tmp_path, *GPU, "distributed.allreduce_dtype=float8"))
    assert problems_of(tmp_path, *GPU, "distributed.reduce_sum_as_matmul=false") == []


@pytest.mark.parametrize(("settings", "ranks", "want"), [
    (["precision.use_mixed_precision=true"], 4, "float16"),  # fp16 on several NCCL GPU ranks
    (["precision.use_mixed_precision=true"], 1, "float32"),  # one rank reduces nothing
    (["precision.use_mixed_precision=true", "precision.use_bfloat16=true"], 4, "float32"),  # bf16: 8 bits only
    ([], 4, "float32"),  # fp32 training
    (["precision.use_mixed_precision=true", "distributed.zero_stage=1"], 4, "float16"),  # ZeRO-1's reduce-scatter
    (["precision.use_mixed_precision=true", "distributed.enable_adasum=true"], 4, "float32"),  # Adasum's tree
    (["precision.use_mixed_precision=true", "distributed.allreduce_dtype=float32"], 4, "float32"),  # told
    (["distributed.allreduce_dtype=bfloat16"], 4, "bfloat16"),
])  # fmt: skip
def test_auto_allreduce_dtype_is_float16_only_for_fp16_on_several_nccl_gpu_ranks(tmp_path, settings, ranks, want):
    from ortflow.config import load_config
    from tests.test_config import write

    cfg = load_config(write(tmp_path), [*GPU, f"distributed.num_ranks={ranks}", *settings])
    assert cfg.distributed.allreduce_dtype == next((s.split("=")[1] for s in settings if "allreduce" in s), "auto")
    assert cfg.gradient_allreduce_dtype(ranks) == want

