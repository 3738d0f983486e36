"""Training calls through configure's cut for CUDA graphs (distributed.cuda_graphs, ortflow/trainer/captured_call.py),
for real: needs the GPU engine, CuPy and 1 CUDA GPU (skipped otherwise).

The cut's sessions run the same kernels in the same order as the training API's call, on the same buffers, so a run
with ``cuda_graphs`` must end with exactly the parameters of the same run without, in each way a call can go:
- recorded and replayed (the bench GPT, whose call the engine records), two micro-batches per update (the graph that
  overwrites the gradients and the one that adds to them: the engine's recording call runs a graph more than once);
- not recorded (the committed GPT-2 and dynamo Llama exports: the engine runs their shape computations on the host
  and refuses to record), through the cut's sessions; GPT-2 ties its embedding and output projection, whose gradient
  shares the engine adds inside a fused product in the unsplit graph (the cut keeps the pair together, or fp16 would
  round twice);
- a recording that fails at its first replay (the TorchScript Llama export): the buffers it may have written are
  restored and every kernel is launched from then on.
fp32 and fp16 (its loss-scale input written before each call; from a loss scale low enough that no update is
skipped), and an eval between updates.
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
#: fp16 from a loss scale of 2^7: from the default 2^16 the first updates overflow and are skipped (a run of 4 updates
#: of the Llama export moved no parameter), which would leave nothing to compare.
FP16 = {"precision": {"use_mixed_precision": True, "initial_loss_scale": 128.0}}


def _assert_same_end(replayed, launched) -> None:
    want, got = final_parameters(launched), final_parameters(replayed)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    state = api.CheckpointState.load_checkpoint(str(replayed.artifacts_dir / "checkpoint"))
    start = {n: np.array(p.data) for n, p in state.parameters}
    assert sum(not np.array_equal(start[n], got[n]) for n in got if n in start) > len(got) // 2  # it trained


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_recorded_replays_with_two_micro_batches_per_update_end_with_the_training_api_calls_parameters(tmp_path,
                                                                                                        precision):
    from tests.gpu.test_gpu_mixed_precision import _make

    settings = {"steps": 12, "train": {"gradient_accumulation_steps": 2, "evaluation_period": 3, "max_eval_rows": 32},
                **({"precision": FP16["precision"]} if precision == "fp16" else {})}  # fmt: skip
    replayed = _make(tmp_path, "replayed", precision, distributed={"cuda_graphs": True}, **settings)
    launched = _make(tmp_path, "launched", precision, **settings)
    log = _run(replayed, 1)
    assert "training calls replay a CUDA graph" in log and "launch every kernel" not in log  # recorded, replayed
    assert "replay a CUDA graph" not in _run(launched, 1)
    _assert_same_end(replayed, launched)


@pytest.mark.parametrize(("export", "precision"), [
    ("gpt2.onnx", "fp32"), ("gpt2.onnx", "fp16"), ("llama-dynamo.onnx", "fp32"), ("llama-dynamo.onnx", "fp16"),
    ("llama.onnx", "fp32")])  # fmt: skip
def test_training_through_the_cut_ends_with_the_parameters_of_the_training_api_call(tmp_path, export, precision):
    make = gpt2_run if export.startswith("gpt2") else llama_run
    mixed = FP16 if precision == "fp16" else {}
    replayed = make(tmp_path, "replayed", export=export, distributed=GPU, **mixed)
    launched = make(tmp_path, "launched", export=export, distributed={**GPU, "cuda_graphs": False}, **mixed)
    assert (replayed.artifacts_dir / "training_head.onnx").exists()
    assert not (launched.artifacts_dir / "training_head.onnx").exists()
    log = _run(replayed, 1)
    print(re.findall(r"training calls (?:replay|launch) [^\n]*", log))
    assert re.search(r"training calls (replay a CUDA graph|launch every kernel)", log)  # the cut is built and bound
    assert "replay a CUDA graph" not in _run(launched, 1)
    _assert_same_end(replayed, launched)
