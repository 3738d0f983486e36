"""A model shaped like ``torch.onnx.export`` output whose gradients need sums over leading and other axes.

For the tests of :mod:`ortflow.graph.gradients.leading_sums` (built with ``onnx.helper``, opset 17, fixed batch dims): a
tied embedding (read by Gather and, transposed, by the LM head), a learned position table [T, d] added to [B, T, d]
(gradient: a sum over axis 0), a per-row bias [T, 1] (a sum over axes 0 and 2: not a leading run), LayerNormalization
with only its Y output, MatMul+Add linear, Relu, a per-channel gain (Mul), shape arithmetic from Shape/Gather/
Unsqueeze/Concat Constants into Reshape, a Gemm with a bias on [B*T, h], and [B, T, V] logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def build_bias_lm(vocab: int = 16, seq: int = 6, d: int = 8, hidden: int = 12, batch: int = 4,
                  seed: int = 0) -> onnx.ModelProto:  # fmt: skip
    """The model of the module docstring: ``input_ids`` int64 [batch, seq] -> ``logits`` [batch, seq, vocab]."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def param(name: str, shape: tuple[int, ...], std: float = 0.3, mean: float = 0.0) -> str:
        inits.append(numpy_helper.from_array((mean + rng.standard_normal(shape) * std).astype(np.float32), name))
        return name

    def const(name: str, value) -> str:
        nodes.append(helper.make_node("Constant", [], [name], name=f"/{name}", value=numpy_helper.from_array(
            np.asarray(value), name)))  # fmt: skip
        return name

    def op(op_type: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(op_type, inputs, [name], name=f"/{name}/{op_type}", **attrs))
        return name

    wte = param("wte.weight", (vocab, d))
    x = op("Gather", [wte, "input_ids"], "tok", axis=0)
    x = op("Add", [x, param("wpe.weight", (seq, d))], "pos")
    x = op("LayerNormalization", [x, param("ln.weight", (d,), 0.1, 1.0), param("ln.bias", (d,))], "ln",
           axis=-1, epsilon=1e-5)  # fmt: skip
    x = op("Add", [x, param("row_bias", (seq, 1))], "rows")  # after the norm, which would cancel its gradient
    h = op("MatMul", [x, param("fc.weight", (d, hidden))], "fc_mm")
    h = op("Add", [h, param("fc.bias", (hidden,))], "fc")
    h = op("Relu", [h], "act")
    h = op("Mul", [h, param("gain", (hidden,), 0.1, 1.0)], "gained")
    shape = op("Shape", [h], "h_shape")
    b = op("Unsqueeze", [op("Gather", [shape, const("i0", np.int64(0))], "b", axis=0), const("ax0", [0])], "b1")
    t = op("Unsqueeze", [op("Gather", [shape, const("i1", np.int64(1))], "t", axis=0), const("ax0b", [0])], "t1")
    rows = op("Mul", [b, t], "bt")
    flat = op("Reshape", [h, op("Concat", [rows, const("minus1", [-1])], "flat_shape", axis=0)], "flat")
    y = op("Gemm", [flat, param("proj.weight", (hidden, d)), param("proj.bias", (d,))], "proj")
    logits = op("MatMul", [y, op("Transpose", [wte], "wte_t", perm=[1, 0])], "head")
    back = op("Concat", [b, t, const("v", [vocab])], "logits_shape", axis=0)
    nodes.append(helper.make_node("Reshape", [logits, back], ["logits"], name="/logits/Reshape"))
    graph = helper.make_graph(
        nodes, "bias_lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, vocab])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path
