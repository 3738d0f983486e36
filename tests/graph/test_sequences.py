"""The dynamo exporter's sequence ops become tensor ops the engine differentiates, computing the same values."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from ortflow.graph.exports.constant_folding import fold_int_constants
from ortflow.graph.exports.sequences import sequences_to_tensors
from ortflow.graph.gradients.differentiable import check_differentiable
from tests.support.exports import export_path

F = onnx.TensorProto.FLOAT


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.int64), name))


def _split_model(positions, width=6, part=2, dims=None):
    """x [2, width] @ w, split into parts of ``part`` along axis 1 as a sequence, the ``positions`` read and summed."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), _const("size", part),
             helper.make_node("SplitToSequence", ["h", "size"], ["seq"], axis=1)]
    outs = []
    for k, p in enumerate(positions):
        nodes += [_const(f"i{k}", p), helper.make_node("SequenceAt", ["seq", f"i{k}"], [f"part{k}"])]
        outs.append(f"part{k}")
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    w = numpy_helper.from_array(np.arange(4 * width, dtype=np.float32).reshape(4, width) / 10, "w")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, dims or [2, 4])],
                              [helper.make_tensor_value_info("y", F, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]


@pytest.mark.parametrize("positions,expected", [((0, 1, 2), "Split"), ((2, 0), "Slice"), ((1,), "Slice")])
def test_split_sequence_reads_become_split_or_slices_with_the_same_values(positions, expected):
    model = _split_model(positions)
    report = []
    rewritten = sequences_to_tensors(model, report)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "SplitToSequence" not in ops and "SequenceAt" not in ops
    assert expected in ops and report[0]["pass"] == "sequences_to_tensors"
    if expected == "Slice":
        assert "Split" not in ops  # a Split with an unused output gets a wrong gradient in the engine
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_array_equal(_run(rewritten, x), _run(model, x))
    check_differentiable(rewritten, {"w"}, ["y"])  # the weight is reachable from the output


def test_sequences_read_another_way_are_left_and_named_by_the_differentiability_check():
    model = _split_model((0,))
    model.graph.node.append(helper.make_node("SequenceLength", ["seq"], ["n"]))
    model.graph.output.append(helper.make_tensor_value_info("n", onnx.TensorProto.INT64, []))
    rewritten = sequences_to_tensors(model)
    assert "SplitToSequence" in [n.op_type for n in rewritten.graph.node]


def test_concat_from_sequence_of_a_construct_becomes_concat():
    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["seq"]),
             helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0, new_axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rewritten = sequences_to_tensors(model)
    assert [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"] == ["Unsqueeze", "Unsqueeze", "Concat"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(rewritten, x), _run(model, x))


def test_gpt2_noopt_export_attention_split_becomes_one_split_per_block():
    from ortflow.graph.exports.torch_params import torch_parameters

    model = torch_parameters(onnx.load(str(export_path("gpt2-dynamo-noopt.onnx")))).model
    rewritten = sequences_to_tensors(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Split") == 4 and "SequenceAt" not in ops


def test_integer_constant_arithmetic_is_folded_and_floats_are_not():
    nodes = [_const("a", [2, 3]), helper.make_node("Cast", ["a"], ["b"], to=onnx.TensorProto.INT64),
             helper.make_node("Reshape", ["x", "b"], ["r"]),
             helper.make_node("Constant", [], ["f"], value_float=2.0), helper.make_node("Mul", ["r", "f"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [6])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    folded = fold_int_constants(model)
    assert [n.op_type for n in folded.graph.node] == ["Constant", "Constant", "Reshape", "Constant", "Mul"]
    inferred = onnx.shape_inference.infer_shapes(folded)
    dims = [d.dim_value for v in inferred.graph.value_info if v.name == "r" for d in v.type.tensor_type.shape.dim]
    assert dims == [2, 3]
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(_run(folded, x), _run(model, x))
