"""Tensor parallelism on 2 GPUs with NCCL (skipped without 2 GPUs, the GPU engine and CuPy).

The GPU path of ortflow/trainer/parallel/tensor_piece.py (activation sums through NCCL
all-gather, ortflow's device update over the pieces' CUDA buffers, the device-side norm of the rank's share) was
written on a CPU-only machine. This test is what checks it: hp 2 on 2 GPUs trains the 2-layer GPT to the parameters
of 1 GPU unsplit (TF32 tolerance as in test_gpu_training.py) and both ranks finish; the log keeps the step times.
Passed on 2 H200s: bench/results/gpu-tests-h200x2-w3-tp-pipeline.log.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gpu_training import REASON, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_two_gpu_tensor_parallel_ranks_match_one_gpu(tmp_path):
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import gpt_run, newest

    gpu = {"device": "cuda", "use_nccl": True}
    one = gpt_run(tmp_path, "one", distributed={**gpu, "num_ranks": 1})
    two = gpt_run(tmp_path, "two", distributed={**gpu, "num_ranks": 2, "horizontal_parallel_size": 2})
    out1 = _run(one, 1)
    out2 = _run(two, 2)
    print(out1[-2000:], out2[-2000:])  # samples/s of both, for the device log
    p1, p2 = read_params(newest(one)), read_params(newest(two))
    assert sorted(p1) == sorted(p2)
    for name in p1:  # AdamW at lr 1e-3 for 4 updates; TF32 matmuls on both sides
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-3, atol=1e-3, err_msg=name)
