"""Tensor parallelism on 2 GPUs with NCCL (skipped without 2 GPUs, the GPU engine and CuPy).

The GPU path of ortflow/trainer/parallel/tensor_parallel_body.py and activations.py: the pieces' activations, their
gradients and the tensor-parallel sums on the device (NCCL all-gather, rank-order adds), ortflow's device update over
the pieces' CUDA buffers, the device-side norm of the rank's share. tp 2 on 2 GPUs trains the 2-layer GPT to the
parameters of 1 GPU unsplit (strict fp32 and SGD, as in test_gpu_four_layouts.py), the GPT-2 export's tp 2 equals
the same layout on CPU ranks, and the engine writes the pieces' outputs on the device
(bench/reports/gpu-tests-4xh100.md). Every piece but the loss's runs its forward once and keeps its activations on the
GPU (the engine on a stream the rank owns), as on CPU ranks.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow.gpus import gpu_count
from tests.gpu.test_gpu_training import REASON, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_two_gpu_tensor_parallel_ranks_match_one_gpu(tmp_path):
    from ortflow.checkpoints.h5state import read_params
    from tests.gpu.test_gpu_four_layouts import ATOL, SGD, STRICT_FP32
    from tests.support.parallel_runs import gpt_run, initial_parameters, newest

    gpu = {"device": "cuda", "use_nccl": True}
    one = gpt_run(tmp_path, "one", distributed={**gpu, "num_ranks": 1}, optimizer=SGD)
    two = gpt_run(tmp_path, "two", distributed={**gpu, "num_ranks": 2, "horizontal_parallel_size": 2}, optimizer=SGD)
    # Strict fp32 and plain SGD, as in test_gpu_four_layouts.py: AdamW lifts rounding-level gradient differences to
    # steps of ~lr, and TF32 matmuls differ between the split and the unsplit products by ~5e-4 relative.
    out1 = _run(one, 1, env=STRICT_FP32)
    out2 = _run(two, 2, env=STRICT_FP32)
    print(out1[-2000:], out2[-2000:])  # samples/s of both, for the device log
    kept = re.findall(r"(\d+) pieces \((\d+) keep their activations\)", out2)
    assert len(kept) == 2 and all(0 < int(k) < int(n) for n, k in kept), kept  # all but the loss's piece, on the GPU
    p1, p2 = read_params(newest(one)), read_params(newest(two))
    initial = initial_parameters(one)
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p2[n] - p1[n]).max()) for n in p1)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"hp 2 on 2 GPUs against 1 GPU: max |difference| {worst:.3g}; largest move in training {moved:.3g}")
    assert worst < ATOL, f"hp 2 on 2 GPUs differs from 1 GPU by {worst:.3g} (bound {ATOL})"
    assert moved > 100 * ATOL, f"training moved the weights by {moved:.3g} only: the comparison is void"


@pytest.mark.skipif(REASON is None and gpu_count()[0] < 2, reason="needs 2 GPUs")
def test_gpt2_export_with_its_tied_table_splits_over_two_gpus_as_over_two_cpu_ranks(tmp_path):
    """The Hugging Face GPT-2 export ties its token table to the LM head: both pieces read the vocabulary slice, so
    the tied gradient sum and the copy of the updated slice run on the device. SGD and strict fp32 (the reasons in
    test_gpu_four_layouts.py) make the GPU and CPU layouts comparable to 1e-6."""
    from ortflow.checkpoints.h5state import read_params
    from tests.gpu.test_gpu_four_layouts import STRICT_FP32, _compare
    from tests.support.parallel_runs import initial_parameters, newest
    from tests.trainer.exports_runs import gpt2_run

    sgd, train = {"name": "sgd", "learning_rate": 1e-2}, {"num_train_steps": 8}
    layout = {"num_ranks": 2, "horizontal_parallel_size": 2}
    gpu = gpt2_run(tmp_path, "gpu", distributed={**layout, "device": "cuda", "use_nccl": True}, optimizer=sgd,
                   train=train)
    cpu = gpt2_run(tmp_path, "cpu", distributed=layout, optimizer=sgd, train=train)
    _run(gpu, 2, env=STRICT_FP32)
    _run(cpu, 2)
    tied = [n for n in read_params(newest(cpu)) if n.endswith("wte.weight")]
    assert tied, "the GPT-2 export has no token table"
    _compare(read_params(newest(gpu)), read_params(newest(cpu)), initial_parameters(cpu), "GPT-2 hp 2")


def test_pieces_keep_activations_and_their_sums_on_the_gpu(tmp_path):
    """After a piece's first call (the engine allocates its outputs on the host; their shapes are recorded), every
    training and eval call writes its outputs into device tensors, the pieces that keep their activations leave their
    sent tensors on the GPU from the first micro-batch, and the tensor-parallel sums and gradient adds
    run on the GPU with the bits of the host's rank-order float32 adds."""
    import json
    import re
    from pathlib import Path

    from tests.gpu.test_gpu_mixed_precision import _run as run_script
    from tests.support.parallel_runs import gpt_run

    cfg = gpt_run(tmp_path, "hp2", distributed={"device": "cuda", "use_nccl": True, "num_ranks": 2,
                                                "horizontal_parallel_size": 2})
    log = run_script(cfg, 2, str(Path(__file__).parent / "tensor_device_rank.py"))
    results = [json.loads(line) for line in re.findall(r"RESULT (.*)$", log, re.M)]
    assert sorted(r["rank"] for r in results) == [0, 1], log[-3000:]
    for r in results:
        assert r["devices"][0] == ["cpu"]  # the first micro-batch: the engine's own (host) outputs, shapes recorded
        assert r["devices"][1:] == [["cuda"], ["cuda"]], r["devices"]
        assert r["sum_device"] == "cuda"
        assert r["kept_pieces"] > 0 and r["kept_devices"] == ["cuda"], r  # kept pieces' sends stay on the GPU
        assert r["sum_bits_equal"] and r["large_sum_bits_equal"] and r["add_bits_equal"], r
        assert r["scale_bits_equal"] and r["sum_into_bits_equal"], r
