"""A two-layer MLP classifier as an ONNX model: ``features`` float32 [N, F] -> ``logits`` [N, C]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Opset and IR version of every example model (the engine runs opset <= 21, IR <= 10).
OPSET = 17
IR_VERSION = 9


def save_model(graph: onnx.GraphProto, path: str | Path) -> Path:
    """Wrap ``graph`` in an opset-17, IR-9 model, check it fully, and write it to ``path`` (folders created)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ortflow.examples")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def build_mlp(
    path: Path | str, num_features: int = 8, hidden: int = 16, num_classes: int = 3, seed: int = 0
) -> Path:
    """Write an MLP classifier ``logits = relu(features @ w1 + b1) @ w2 + b2``.

    Args:
        path: Where to write the ``.onnx`` file (parent folders are created).
        num_features: Width F of the ``features`` input.
        hidden: Width of the hidden layer.
        num_classes: Number of classes C, the width of ``logits``.
        seed: Seed of the weight initialisation.

    Returns:
        The path written.
    """
    rng = np.random.default_rng(seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    initializers = [
        numpy_helper.from_array(dense(num_features, hidden), "fc1.weight"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "fc1.bias"),
        numpy_helper.from_array(dense(hidden, num_classes), "fc2.weight"),
        numpy_helper.from_array(np.zeros(num_classes, np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("MatMul", ["features", "fc1.weight"], ["fc1.mm"]),
        helper.make_node("Add", ["fc1.mm", "fc1.bias"], ["fc1.out"]),
        helper.make_node("Relu", ["fc1.out"], ["act"]),
        helper.make_node("MatMul", ["act", "fc2.weight"], ["fc2.mm"]),
        helper.make_node("Add", ["fc2.mm", "fc2.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", num_features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])],
        initializers,
    )
    return save_model(graph, path)
