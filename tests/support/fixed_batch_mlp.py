"""Models for the layout / global-batch / profiling tests, shaped like ``torch.onnx.export`` output.

torch.onnx.export fixes the batch dim unless told otherwise, computes reshape targets with Shape/Gather/Concat
arithmetic on Constants, and writes Gemm-free MatMul + Add. The classifier here does all three.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_fixed_batch_classifier(path: Path, batch: int = 4, features: int = 8, hidden: int = 16, classes: int = 3,
                                 seed: int = 0) -> Path:  # fmt: skip
    """``x [batch, features] -> logits [batch, classes]`` with a fixed batch dim and a Shape-arithmetic Reshape.

    The hidden activations also go through ``h.view(batch, hidden)`` as a traced export writes it (the batch size as a
    Constant feeding Reshape), so the graph only runs at ``batch`` and configure keeps the dim fixed.
    """
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.normal(size=(features, hidden)) * 0.3).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "fc1.bias"),
        numpy_helper.from_array((rng.normal(size=(hidden, classes)) * 0.3).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["/Shape_output_0"], name="/Shape"),
        helper.make_node("Constant", [], ["/Constant_output_0"], name="/Constant",
                         value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Gather", ["/Shape_output_0", "/Constant_output_0"], ["/Gather_output_0"], name="/Gather",
                         axis=0),
        helper.make_node("Constant", [], ["/Constant_1_output_0"], name="/Constant_1",
                         value=numpy_helper.from_array(np.array([0], np.int64))),
        helper.make_node("Unsqueeze", ["/Gather_output_0", "/Constant_1_output_0"], ["/Unsqueeze_output_0"],
                         name="/Unsqueeze"),
        helper.make_node("Constant", [], ["/Constant_2_output_0"], name="/Constant_2",
                         value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Concat", ["/Unsqueeze_output_0", "/Constant_2_output_0"], ["/Concat_output_0"],
                         name="/Concat", axis=0),
        helper.make_node("Reshape", ["x", "/Concat_output_0"], ["/Reshape_output_0"], name="/Reshape"),
        helper.make_node("MatMul", ["/Reshape_output_0", "fc1.weight"], ["/fc1/MatMul_output_0"], name="/fc1/MatMul"),
        helper.make_node("Add", ["fc1.bias", "/fc1/MatMul_output_0"], ["/fc1/Add_output_0"], name="/fc1/Add"),
        helper.make_node("Relu", ["/fc1/Add_output_0"], ["/Relu_output_0"], name="/Relu"),
        helper.make_node("Constant", [], ["/Constant_3_output_0"], name="/Constant_3",
                         value=numpy_helper.from_array(np.array([batch, hidden], np.int64))),
        helper.make_node("Reshape", ["/Relu_output_0", "/Constant_3_output_0"], ["/Reshape_1_output_0"],
                         name="/Reshape_1"),
        helper.make_node("MatMul", ["/Reshape_1_output_0", "fc2.weight"], ["/fc2/MatMul_output_0"], name="/fc2/MatMul"),
        helper.make_node("Add", ["fc2.bias", "/fc2/MatMul_output_0"], ["logits"], name="/fc2/Add"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
