"""The Hugging Face BERT export split over 2 GPUs, against the same layout on CPU ranks: two pipeline stages (NCCL
point-to-point between them) and two tensor-parallel pieces (every layer's attention by heads and MLP, sums on the
device). Needs 2 GPUs, the GPU engine and CuPy (skipped otherwise).

SGD and strict fp32 (the reasons in test_gpu_four_layouts.py) make the GPU and CPU layouts comparable to 1e-6; the
attention key biases are left out of the bound (softmax is invariant to them: their exact gradient is zero and what
the engine computes is rounding noise, test_exports_parallel_mpi.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gpu_training import REASON, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]
GPU = {"device": "cuda", "use_nccl": True, "collective_timeout_s": 60.0}


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"horizontal_parallel_size": 2}],
                         ids=["pp2", "hp2"])  # fmt: skip
def test_bert_export_split_over_two_gpus_equals_two_cpu_ranks(tmp_path, layout):
    from ortflow.checkpoints.h5state import read_params
    from tests.gpu.test_gpu_four_layouts import SGD, STRICT_FP32, _compare
    from tests.support.parallel_runs import initial_parameters, newest
    from tests.trainer.exports_checks import key_bias
    from tests.trainer.exports_runs import bert_run

    layout, train = {"num_ranks": 2, **layout}, {"num_train_steps": 8}
    gpu = bert_run(tmp_path, "gpu", distributed={**layout, **GPU}, optimizer=SGD, train=train)
    cpu = bert_run(tmp_path, "cpu", distributed=layout, optimizer=SGD, train=train)
    _run(gpu, 2, env=STRICT_FP32)
    _run(cpu, 2)

    def without_key_biases(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: v for n, v in params.items() if key_bias(n, v.shape) is None}

    _compare(without_key_biases(read_params(newest(gpu))), without_key_biases(read_params(newest(cpu))),
             initial_parameters(cpu), f"BERT {'pp' if 'pipeline_parallel_size' in layout else 'hp'} 2")  # fmt: skip
