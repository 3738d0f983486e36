"""check_differentiable alone: which nodes count as on the trained path, and one error listing every problem."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.gradients.differentiable import check_differentiable, trained_path
from ortflow.graph.onnx_tools import GraphError
from tests.graph.test_passes import f32, make_model


def _weights(*names):
    return [numpy_helper.from_array(np.ones((4, 4), np.float32), n) for n in names]


def test_every_problem_is_listed_at_once_with_node_op_and_fix():
    e = numpy_helper.from_array(np.array(2.0, np.float32), "e")
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="mm_a"),
             helper.make_node("Softplus", ["a"], ["sp"], name="soft"),
             helper.make_node("Pow", ["sp", "e"], ["p"], name="pow"),  # trained exponent
             helper.make_node("ReduceL2", ["p"], ["r"], name="l2", axes=[1], keepdims=0),
             helper.make_node("Unsqueeze", ["r", "ax"], ["y"])]
    ax = numpy_helper.from_array(np.array([1], np.int64), "ax")
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 1])], [*_weights("A"), e, ax])
    with pytest.raises(GraphError) as err:
        check_differentiable(model, {"A", "e"}, ["y"])
    text = str(err.value)
    assert "node 'soft' (op Softplus)" in text and "Relu(x) + Log(1 + Exp(-Abs(x)))" in text
    assert "node 'pow' (op Pow)" in text and "Pow's exponent" in text
    assert "node 'l2' (op ReduceL2)" in text and "keepdims=1 followed by Squeeze" in text
    assert text.count("\n  - ") == 3
    # With the exponent frozen, the Pow is fine; the other two remain.
    with pytest.raises(GraphError) as err:
        check_differentiable(model, {"A"}, ["y"])
    assert "Pow" not in str(err.value) and str(err.value).count("\n  - ") == 2


def test_nodes_off_the_trained_path_are_not_checked():
    nodes = [helper.make_node("Elu", ["x"], ["ex"], name="on_input"),  # reads no parameter
             helper.make_node("MatMul", ["ex", "A"], ["y"], name="mm"),
             helper.make_node("MatMul", ["x", "B"], ["b"], name="side"),
             helper.make_node("Round", ["b"], ["side_out"], name="not_to_loss")]  # does not reach the loss
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 4]), f32("side_out", ["b", 4])],
                       _weights("A", "B"))
    assert [n.name for n in trained_path(model, {"A", "B"}, ["y"])] == ["mm"]
    check_differentiable(model, {"A", "B"}, ["y"])


def test_integer_tensors_stop_the_trained_path():
    # Shape of a trained tensor is int64: a Round on it needs no gradient (torch's shape arithmetic does this).
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"]),
             helper.make_node("Shape", ["a"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("Round", ["sf"], ["rs"], name="round_shape"),
             helper.make_node("ReduceSum", ["rs"], ["n"], keepdims=1),
             helper.make_node("Div", ["a", "n"], ["y"])]
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 4])], _weights("A"))
    check_differentiable(model, {"A"}, ["y"])


def test_contrib_simplified_layer_norm_is_refused():
    node = helper.make_node("SimplifiedLayerNormalization", ["a", "g"], ["y"], name="rms", domain="com.microsoft")
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"]), node]
    g = numpy_helper.from_array(np.ones(4, np.float32), "g")
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 4])], [*_weights("A"), g])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(GraphError, match=r"node 'rms' \(op SimplifiedLayerNormalization\).*use LayerNormalization"):
        check_differentiable(model, {"A", "g"}, ["y"])
