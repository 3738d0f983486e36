"""Pipeline stages on 2 GPUs with NCCL point-to-point (skipped without 2 GPUs, the GPU engine and CuPy).

UNTESTED at the time of writing: the NCCL send/recv path (comm/nccl.py) was written on a CPU-only machine. This test
is what checks it: pp 2 on 2 GPUs trains to the parameters of 1 GPU unsplit (TF32 tolerance, see
test_gpu_training.py's docstring) and both ranks finish.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_gpu_training import REASON, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_two_gpu_stages_match_one_gpu(tmp_path):
    from tests.trainer.runs import make_text_run
    from tests.trainer.test_pipeline_mpi import TRAIN, stage_parameters

    gpu = {"device": "cuda", "use_nccl": True}
    one = make_text_run(tmp_path, "one", distributed={**gpu, "num_ranks": 1}, train=TRAIN)
    two = make_text_run(tmp_path, "two", distributed={**gpu, "num_ranks": 2, "pipeline_parallel_size": 2},
                        train=TRAIN)
    _run(one, 1)
    _run(two, 2)
    p1, p2 = stage_parameters(one), stage_parameters(two)
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-3, atol=1e-3, err_msg=name)
