"""Models shaped like torch.onnx.export output for the data / batch / validate tests (onnx.helper, opset 17).

``torch.onnx.export`` without ``dynamic_axes`` writes every input and output with fixed dims, the batch dim included;
``x.view(B, -1)`` inside ``forward`` becomes a Reshape whose shape is a Constant holding the traced batch size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
NUM_FEATURES = 8
HIDDEN = 16
NUM_CLASSES = 3


def _save(graph: onnx.GraphProto, path: Path | None) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
    return model


def _weights(seed: int) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [
        numpy_helper.from_array((rng.standard_normal((NUM_FEATURES, HIDDEN)) / 3).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "fc1.bias"),
        numpy_helper.from_array((rng.standard_normal((HIDDEN, NUM_CLASSES)) / 4).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(NUM_CLASSES, np.float32), "fc2.bias"),
    ]


def fixed_batch_classifier(batch: int = 4, path: Path | None = None, seed: int = 0) -> onnx.ModelProto:
    """``features`` [batch, 8] -> ``logits`` [batch, 3], every dim fixed; the graph does not depend on the batch.

    Also carries a value_info with the fixed batch dim, as exporters write for intermediate tensors.
    """
    nodes = [
        helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm"),
        helper.make_node("Relu", ["h"], ["a"], name="/act/Relu"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="/fc2/Gemm"),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, NUM_CLASSES])],
        _weights(seed),
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, [batch, HIDDEN])],
    )  # fmt: skip
    return _save(graph, path)


def reshape_batch_classifier(batch: int = 4, path: Path | None = None, seed: int = 0) -> onnx.ModelProto:
    """Like :func:`fixed_batch_classifier`, but ``h.view(batch, 4, 4)`` ... ``.view(batch, -1)`` hard-codes the batch.

    The traced batch size sits in Constant nodes feeding Reshape (torch's shape arithmetic), so the graph only runs
    at that batch size: ortflow must keep the dim fixed.
    """
    shape3 = numpy_helper.from_array(np.array([batch, 4, HIDDEN // 4], np.int64), "shape3")
    shape2 = numpy_helper.from_array(np.array([batch, HIDDEN], np.int64), "shape2")
    nodes = [
        helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm"),
        helper.make_node("Constant", [], ["/Constant_output_0"], value=shape3, name="/Constant"),
        helper.make_node("Reshape", ["h", "/Constant_output_0"], ["h3"], name="/Reshape"),
        helper.make_node("Relu", ["h3"], ["a3"], name="/act/Relu"),
        helper.make_node("Constant", [], ["/Constant_1_output_0"], value=shape2, name="/Constant_1"),
        helper.make_node("Reshape", ["a3", "/Constant_1_output_0"], ["a"], name="/Reshape_1"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="/fc2/Gemm"),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, NUM_CLASSES])],
        _weights(seed),
    )  # fmt: skip
    return _save(graph, path)


def batch_mean_classifier(batch: int = 4, path: Path | None = None, seed: int = 0) -> onnx.ModelProto:
    """A graph that runs at any batch size but mixes rows (subtracts the batch mean): its batch must stay fixed."""
    nodes = [
        helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["mean"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["h", "mean"], ["centered"]),
        helper.make_node("Relu", ["centered"], ["a"]),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, NUM_CLASSES])],
        _weights(seed),
    )  # fmt: skip
    return _save(graph, path)


def sequence_logits_model(batch: int | str = "batch", seq: int = 5, vocab: int = 7, path: Path | None = None,
                          seed: int = 0) -> onnx.ModelProto:
    """A tiny causal-LM-shaped model: ``input_ids`` int64 [B, T] -> ``logits`` [B, T, V] (embedding + projection)."""
    rng = np.random.default_rng(seed)
    emb = numpy_helper.from_array((rng.standard_normal((vocab, 8)) / 3).astype(np.float32), "wte")
    head = numpy_helper.from_array((rng.standard_normal((8, vocab)) / 3).astype(np.float32), "lm_head")
    nodes = [
        helper.make_node("Gather", ["wte", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "lm_head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, vocab])],
        [emb, head],
    )  # fmt: skip
    return _save(graph, path)


def undifferentiable_model(path: Path | None = None, seed: int = 0) -> onnx.ModelProto:
    """A classifier with Softplus (no gradient in onnxruntime-training 1.19.2): the engine cannot build its graph."""
    nodes = [
        helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["h"]),
        helper.make_node("Softplus", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", NUM_CLASSES])],
        _weights(seed),
    )  # fmt: skip
    return _save(graph, path)


def classification_data(num_rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(features float32 [N, 8], labels int64 [N]) with a learnable rule."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(num_rows, NUM_FEATURES)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
    return features, labels


def flattened_logits_model(batch: int = 2, seq: int = 5, vocab: int = 7, hard_coded: bool = False,
                           path: Path | None = None, seed: int = 0) -> onnx.ModelProto:
    """GPT-2-style head traced at a fixed batch: ``input_ids`` [batch, T] -> ``logits`` [batch*T, V].

    ``logits.view(-1, V)`` traces to a Reshape of the Constant ``[-1, V]`` (batch-agnostic);
    ``logits.view(batch * T, V)`` with a Python int traces to the Constant ``[batch*T, V]`` (``hard_coded``).
    Positions come from shape arithmetic (Shape -> Gather -> Range), as torch exports ``arange(x.size(1))``.
    """
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((vocab, 8)) / 3).astype(np.float32), "wte"),
        numpy_helper.from_array((rng.standard_normal((seq, 8)) / 3).astype(np.float32), "wpe"),
        numpy_helper.from_array((rng.standard_normal((8, vocab)) / 3).astype(np.float32), "lm_head"),
    ]
    flat = [batch * seq, vocab] if hard_coded else [-1, vocab]
    nodes = [
        helper.make_node("Gather", ["wte", "input_ids"], ["tok"]),
        helper.make_node("Shape", ["input_ids"], ["/Shape_output_0"]),
        helper.make_node("Constant", [], ["/Constant_output_0"], value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("Gather", ["/Shape_output_0", "/Constant_output_0"], ["/Gather_output_0"], axis=0),
        helper.make_node("Constant", [], ["/zero"], value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Constant", [], ["/one"], value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("Range", ["/zero", "/Gather_output_0", "/one"], ["positions"]),
        helper.make_node("Gather", ["wpe", "positions"], ["pos"]),
        helper.make_node("Add", ["tok", "pos"], ["x"]),
        helper.make_node("MatMul", ["x", "lm_head"], ["scores"]),
        helper.make_node("Constant", [], ["/flat"], value=numpy_helper.from_array(np.array(flat, np.int64))),
        helper.make_node("Reshape", ["scores", "/flat"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "main_graph",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch * seq, vocab])],
        inits,
    )  # fmt: skip
    return _save(graph, path)
