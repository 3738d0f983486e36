"""Training calls through configure's cut for CUDA graphs (distributed.cuda_graphs, ortflow/trainer/captured_call.py),
for real: needs the GPU engine, CuPy and 1 CUDA GPU (skipped otherwise).

The cut's sessions run the same kernels in the same order as the training API's call, on the same buffers, so a run
with ``cuda_graphs`` must end with exactly the parameters of the same run without: real exports of both torch
exporters (GPT-2 through TorchScript, Llama through dynamo), fp32 and fp16 (its loss-scale input written before each
call; from a loss scale low enough that no update is skipped), two micro-batches per update (the graph that overwrites
the gradients and the one that adds to them) and an eval between updates. The engine records neither export's call (it
runs their shape computations on the host), so these runs go through the cut's sessions without recording; the
recorded replay is measured by the GPU suite (``bench/gpu_suite.sh --precisions fp16-graphs``). fp16 GPT-2 ends with
other parameters than the training API's call (measured on an H200): why is open, and the test says so until it holds.
The fp16 Llama case was measured only from the default loss scale, where every update of both runs was skipped; this
loss scale is new in it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from ortflow.engine import api
from tests.gpu.test_gpu_mixed_precision import COUNT, WHY, _run
from tests.support.runs import final_parameters
from tests.trainer.exports_runs import gpt2_run, llama_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(COUNT < 1, reason=f"needs 1 GPU ({WHY})")]
GPU = {"device": "cuda", "use_nccl": True, "cuda_graphs": True}
FP16_GPT2 = pytest.mark.xfail(strict=True, reason="fp16 GPT-2 through the cut ends with other parameters than the "
                              "training API's call (measured on an H200)")


@pytest.mark.parametrize(("export", "precision"), [
    ("gpt2.onnx", "fp32"), ("llama-dynamo.onnx", "fp32"), ("llama-dynamo.onnx", "fp16"),
    pytest.param("gpt2.onnx", "fp16", marks=FP16_GPT2)])  # fmt: skip
def test_training_through_the_cut_ends_with_the_parameters_of_the_training_api_call(tmp_path, export, precision):
    make = gpt2_run if export.startswith("gpt2") else llama_run
    # fp16 from a loss scale of 2^7: from the default 2^16 the first updates overflow and are skipped (a run of 4
    # updates of the Llama export moved no parameter), which would leave nothing to compare.
    mixed = {"precision": {"use_mixed_precision": True, "initial_loss_scale": 128.0}} if precision == "fp16" else {}
    replayed = make(tmp_path, "replayed", export=export, distributed=GPU, **mixed)
    launched = make(tmp_path, "launched", export=export, distributed={**GPU, "cuda_graphs": False}, **mixed)
    assert (replayed.artifacts_dir / "training_head.onnx").exists()
    assert not (launched.artifacts_dir / "training_head.onnx").exists()
    log = _run(replayed, 1)
    print(re.findall(r"training calls (?:replay|launch) [^\n]*", log))
    assert re.search(r"training calls (replay a CUDA graph|launch every kernel)", log)  # the cut is built and bound
    assert "replay a CUDA graph" not in _run(launched, 1)
    want, got = final_parameters(launched), final_parameters(replayed)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    state = api.CheckpointState.load_checkpoint(str(replayed.artifacts_dir / "checkpoint"))
    start = {n: np.array(p.data) for n, p in state.parameters}
    assert sum(not np.array_equal(start[n], got[n]) for n in got if n in start) > len(got) // 2  # it trained
