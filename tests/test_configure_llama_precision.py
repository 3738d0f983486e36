"""Mixed precision for CUDA on the Llama exports, configured on a CPU host: the built training graph has a CUDA kernel
for every fp16/bf16 node (what ``validate --deep`` checks for device cuda), RoPE's Cos and Sin stay fp32 in bf16 (no
bf16 type in their schema) and the projections run in the compute type."""

from __future__ import annotations

import onnx
import pytest

from ortflow.graph.autocast import BFLOAT16, FLOAT, FLOAT16
from ortflow.graph.cuda_kernels import element_types, missing_kernels
from tests.trainer.exports_runs import LLAMA_EXPORTS, llama_run

EXPORTS = LLAMA_EXPORTS
PRECISION = {FLOAT16: {"use_mixed_precision": True}, BFLOAT16: {"use_mixed_precision": True, "use_bfloat16": True}}


@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_llama_configures_for_cuda_in_half_precision(tmp_path, export, compute):
    cfg = llama_run(tmp_path, "run", export=export, precision=PRECISION[compute],
                    distributed={"num_ranks": 1, "device": "cuda", "use_nccl": True})
    model = onnx.load(str(cfg.artifacts_dir / "training_model.onnx"))
    types = element_types(model)
    assert missing_kernels(model, types) == []
    products = [n for n in model.graph.node if n.op_type in ("MatMul", "FusedMatMul")]
    assert products and sum(types.get(n.output[0]) == compute for n in products) >= len(products) // 2
    rope = [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
    assert rope and all(types[n.input[0]] == (FLOAT if compute == BFLOAT16 else FLOAT16) for n in rope)
    silu = [n for n in model.graph.node if n.op_type == "QuickGelu"]  # the engine's fusion of x * sigmoid(x)
    assert all(types[n.output[0]] == (FLOAT if compute == BFLOAT16 else FLOAT16) for n in silu)
