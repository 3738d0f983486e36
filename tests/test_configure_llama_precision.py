"""Mixed precision for CUDA on the Llama exports, configured on a CPU host: the built training graph has a CUDA kernel
for every fp16/bf16 node (what ``validate --deep`` checks for device cuda), RoPE's Cos and Sin stay fp32 in bf16 (no
bf16 type in their schema) and the projections run in the compute type."""

from __future__ import annotations

import onnx
import pytest

from ortflow.graph.precision.autocast import BFLOAT16, FLOAT, FLOAT16
from ortflow.graph.precision.cuda_kernels import element_types, missing_kernels
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


@pytest.mark.parametrize("export", EXPORTS)
def test_no_gradient_of_a_computed_divisor_is_reduced_in_bf16(tmp_path, export):
    """On a GPU the TorchScript Llama in bf16 did not load: the engine's DivGrad of RMSNorm's ``1 / sqrt`` computes the
    divisor's gradient (its second output) through ReduceSumTraining, whose schema has no bf16 type. bf16 keeps such
    a Div in fp32, so no DivGrad of the built training graph takes bf16 inputs where it computes that gradient."""
    cfg = llama_run(tmp_path, "run", export=export, precision=PRECISION[BFLOAT16],
                    distributed={"num_ranks": 1, "device": "cuda", "use_nccl": True})
    model = onnx.load(str(cfg.artifacts_dir / "training_model.onnx"))
    types = element_types(model)
    refused = [n.name or n.output[0] for n in model.graph.node
               if n.op_type == "DivGrad" and len(n.output) > 1 and n.output[1]
               and any(types.get(x) == BFLOAT16 for x in n.input)]
    assert not refused, f"DivGrad nodes reducing a divisor's gradient in bf16: {refused}"
