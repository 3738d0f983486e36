"""The half-precision kernel table (ortflow/graph/precision/cuda_kernels.py) against the installed GPU engine.

Needs the GPU engine and one CUDA GPU (skipped otherwise). Each judged (op, opset 17, fp16/bf16) becomes a one-node
model in a CUDA session with the CPU fallback disabled: the session starts exactly when the CUDA provider has the
kernel. Then the committed fixtures (GPT-2, BERT, the CNN) after autocast start and run a forward pass in fp16 and
bf16, and the bf16 GPT-2 rewritten without the table fails as the ranks would.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ortflow import cuda_libs
from ortflow.graph.precision.autocast import BFLOAT16, FLOAT16, autocast
from ortflow.graph.precision.cuda_kernels import KERNELS, has_kernel
from tests.support.exports import export_path


def _why_not() -> str | None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "the GPU engine (onnxruntime-training) is not installed"
    count, why = cuda_libs.gpu_count()
    return None if count else (why or "no GPU")


WHY = _why_not()


def conv_libraries_missing() -> str | None:
    """Why a model with convolutions cannot run on this machine's GPUs (cuDNN's convolution library absent), or None."""
    report = cuda_libs.preload()
    missing = cuda_libs.missing_for_ops(["Conv"], report)
    return f"cuDNN's convolution library is not installed ({', '.join(missing[0][2])})" if missing else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"needs 1 GPU ({WHY})")]
OPSET = 17


def _session(model: onnx.ModelProto, fallback: bool):
    import onnxruntime

    cuda_libs.preload(cuda_libs.ENGINE_LIBRARIES)
    options = onnxruntime.SessionOptions()
    if not fallback:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])


def _one_node(op: str, domain: str, elem: int) -> onnx.ModelProto | None:
    """A one-node model of ``op`` reading and writing ``elem``, or None for ops this probe has no recipe for."""
    x = [2, 4, 8, 8]
    shapes = {"Erf": [x], "Tanh": [x], "Relu": [x], "Softmax": [x], "LogSoftmax": [x], "Dropout": [x],
              "Add": [x, x], "Sub": [x, x], "Mul": [x, x], "Div": [x, x], "Pow": [x, x], "Equal": [x, x],
              "MatMul": [x, [8, 8]], "Gemm": [[4, 8], [8, 8], [8]], "LayerNormalization": [x, [8], [8]],
              "Conv": [x, [4, 4, 3, 3]], "BatchNormalization": [x, [4], [4], [4], [4]],
              "SkipLayerNormalization": [[2, 4, 8], [2, 4, 8], [8], [8]], "FastGelu": [x], "Gelu": [x],
              "BiasGelu": [x, [8]], "Where": [x, x, x], "Pad": [x]}  # fmt: skip
    if op not in shapes:
        return None
    inputs = [helper.make_tensor_value_info(f"in{i}", TensorProto.BOOL if op == "Where" and i == 0 else elem, s)
              for i, s in enumerate(shapes[op])]  # fmt: skip
    out_elem = TensorProto.BOOL if op == "Equal" else elem
    consts = [helper.make_tensor("pads", TensorProto.INT64, [8], [0, 0, 0, 0, 0, 0, 0, 2])] if op == "Pad" else []
    node = helper.make_node(op, [i.name for i in inputs] + [c.name for c in consts], ["out"], domain=domain)
    graph = helper.make_graph([node], "probe", inputs, [helper.make_tensor_value_info("out", out_elem, None)], consts)
    imports = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model


def test_every_judged_op_starts_on_cuda_exactly_when_the_table_says():
    disagree, probed = [], []
    for (domain, op), _ in sorted(KERNELS.items()):
        for elem in (FLOAT16, BFLOAT16):
            model = _one_node(op, domain, elem)
            if model is None:
                continue
            try:
                _session(model, fallback=False)
                found = True
            except Exception as err:  # noqa: BLE001 - the engine raises its own exception types
                found, text = False, str(err)
            expected = has_kernel(op, domain, OPSET, elem)
            probed.append(f"{op}:{'fp16' if elem == FLOAT16 else 'bf16'}={'yes' if found else 'no'}")
            if found != expected:
                why = "" if found else f" ({text[:200]})"
                disagree.append(f"{op} {elem}: table {expected}, engine {found}{why}")
    print("cuda kernel probe:", " ".join(probed))
    assert probed and not disagree, disagree


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for info in model.graph.input:
        if info.name in inits:
            continue
        dims = [d.dim_value or 2 for d in info.type.tensor_type.shape.dim]
        if info.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[info.name] = (rng.integers(0, 100, dims) if "ids" in info.name else np.ones(dims)).astype(np.int64)
        else:
            feeds[info.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", ["gpt2.onnx", "bert.onnx", "cnn.onnx"])
@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_autocast_fixture_starts_and_runs_on_cuda(name, compute):
    if name == "cnn.onnx" and (why := conv_libraries_missing()):
        pytest.skip(why)  # cuDNN would abort this process at the first convolution
    model = autocast(onnx.load(str(export_path(name))), compute)
    outputs = _session(model, fallback=True).run(None, _feeds(model))
    assert all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f")


def test_bf16_gpt2_without_the_table_fails_at_session_start():
    model = autocast(onnx.load(str(export_path("gpt2.onnx"))), BFLOAT16, check_kernels=False)
    with pytest.raises(Exception, match="Pow"):
        _session(model, fallback=True)
