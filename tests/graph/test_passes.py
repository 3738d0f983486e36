"""Each preparation pass alone, on graphs built with onnx.helper: what it changes, that values are unchanged (ONNX
Runtime inference on the model before and after), that the input model is left as it was, and one log line."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.exports.logits import flatten_logits
from ortflow.graph.exports.untrainable import untrainable_initializers
from ortflow.graph.gradients.optional_outputs import declare_optional_outputs
from ortflow.graph.gradients.repeated import separate_repeated_inputs
from ortflow.graph.gradients.split import split_to_slices
from ortflow.graph.onnx_tools import GraphError


def make_model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def run(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_optional_outputs_declared_for_layernorm_and_dropout_values_unchanged(caplog):
    gamma = numpy_helper.from_array(np.linspace(0.5, 1.5, 4).astype(np.float32), "gamma")
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma"], ["ln"], name="ln", axis=-1),
             helper.make_node("Dropout", ["ln"], ["y"], name="drop"),
             helper.make_node("LayerNormalization", ["y", "gamma"], ["z", "", ""], name="ln2")]
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("z", ["b", 4])], [gamma])
    before = model.SerializeToString()
    report = []
    with caplog.at_level(logging.INFO, logger="ortflow.graph"):
        prepared = declare_optional_outputs(model, report)
    assert model.SerializeToString() == before  # pure: the input proto is untouched
    outputs = {n.name: list(n.output) for n in prepared.graph.node}
    assert outputs["ln"][0] == "ln" and len(outputs["ln"]) == 3 and all(outputs["ln"])
    assert outputs["drop"][0] == "y" and len(outputs["drop"]) == 2 and outputs["drop"][1]
    assert len(outputs["ln2"]) == 3 and all(outputs["ln2"])
    assert len(set(outputs["ln"] + outputs["drop"] + outputs["ln2"])) == 8  # fresh, distinct names
    assert [r["pass"] for r in report] == ["declare_optional_outputs"] and len(report[0]["changes"]) == 3
    assert len([r for r in caplog.records if "declare_optional_outputs" in r.getMessage()]) == 1
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(prepared, {"x": x})[0], run(model, {"x": x})[0])
    onnx.checker.check_model(prepared, full_check=True)


def test_complete_nodes_are_left_alone_and_nothing_is_reported():
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma"], ["y", "m", "s"], axis=-1)]
    gamma = numpy_helper.from_array(np.ones(4, np.float32), "gamma")
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 4])], [gamma])
    report = []
    assert declare_optional_outputs(model, report) == model
    assert report == []


def _split_model(split_inputs, split_init=(), opset=17, width=9, outputs=("a", "c"), **attrs):
    """x [b, width] -> Split into a, b, c on axis 1; the graph outputs ``outputs`` (b unused by default)."""
    nodes = [helper.make_node("Split", ["x", *split_inputs], ["a", "b", "c"], name="split", axis=1, **attrs)]
    inputs = [f32("x", ["b", width])] + [i for i in split_init if isinstance(i, onnx.ValueInfoProto)]
    inits = [i for i in split_init if isinstance(i, onnx.TensorProto)]
    return make_model(nodes, inputs, [f32(o, None) for o in outputs], inits, opset)


@pytest.mark.parametrize(
    ("case", "model", "feeds"),
    [
        ("constant sizes", _split_model(["s"], [numpy_helper.from_array(np.array([2, 3, 4], np.int64), "s")]), {}),
        ("equal split, known width", _split_model([]), {}),
        ("equal split, symbolic width", _split_model([], [], width="w"), {}),
        ("num_outputs, uneven (opset 18)", _split_model([], [], opset=18, width="w", num_outputs=3), {}),
        ("sizes from a graph input", _split_model(["s"], [helper.make_tensor_value_info("s", TensorProto.INT64, [3])]),
         {"s": np.array([4, 1, 4], np.int64)}),
    ],
)
def test_split_with_an_unused_output_becomes_slices_with_the_same_values(case, model, feeds):
    before = model.SerializeToString()
    report = []
    prepared = split_to_slices(model, report)
    assert model.SerializeToString() == before
    ops = [n.op_type for n in prepared.graph.node]
    slices_of_x = [n for n in prepared.graph.node if n.op_type == "Slice" and n.input[0] == "x"]
    assert "Split" not in ops and [n.output[0] for n in slices_of_x] == ["a", "c"], (case, ops)  # the USED outputs
    assert report and report[0]["pass"] == "split_to_slices"
    width = 10 if "uneven" in case else 9
    x = np.arange(2 * width, dtype=np.float32).reshape(2, width)
    for got, want in zip(run(prepared, {"x": x, **feeds}), run(model, {"x": x, **feeds}), strict=True):
        np.testing.assert_array_equal(got, want)


def test_split_whose_outputs_are_all_used_is_kept():
    model = _split_model([], outputs=("a", "b", "c"))
    assert split_to_slices(model) == model


def test_repeated_initializer_input_is_read_through_identity():
    s = numpy_helper.from_array(np.arange(9, dtype=np.float32).reshape(3, 3), "S")
    model = make_model([helper.make_node("MatMul", ["S", "S"], ["S2"], name="square"),
                        helper.make_node("MatMul", ["x", "S2"], ["y"])],
                       [f32("x", ["b", 3])], [f32("y", ["b", 3])], [s])
    report = []
    prepared = separate_repeated_inputs(model, report)
    square = next(n for n in prepared.graph.node if n.name == "square")
    assert square.input[0] == "S" and square.input[1] != "S"
    identity = next(n for n in prepared.graph.node if n.op_type == "Identity")
    assert list(identity.input) == ["S"] and identity.output[0] == square.input[1]
    assert list(prepared.graph.initializer) == list(model.graph.initializer)
    assert "reads 'S' twice" in report[0]["changes"][0]
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(run(prepared, {"x": x})[0], run(model, {"x": x})[0])


def _logits_model(dims):
    """x [*dims[:-1], 4] -> MatMul -> logits [*dims]."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32), "W")
    return make_model([helper.make_node("MatMul", ["x", "W"], ["logits"])], [f32("x", [*dims[:-1], 4])],
                      [f32("logits", dims)], [w])


@pytest.mark.parametrize("dims", [["b", "t", 5], ["b", "t", "v"], [2, 3, 5]])
def test_flatten_logits_adds_flat_scores_and_labels_and_keeps_the_output(dims):
    model = _logits_model(dims)
    report = []
    prepared, flat = flatten_logits(model, "logits", "labels", report)
    assert [o.name for o in prepared.graph.output] == ["logits", flat.scores]
    label = next(i for i in prepared.graph.input if i.name == "labels")
    assert label.type.tensor_type.elem_type == TensorProto.INT64
    declared = [d.dim_value or d.dim_param for d in label.type.tensor_type.shape.dim]
    assert declared == dims[:-1]
    # A node must read the flat labels for the engine's loss block to find them.
    assert any(flat.labels in n.output for n in prepared.graph.node)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    labels = np.arange(6, dtype=np.int64).reshape(2, 3) % 5
    probe = onnx.ModelProto.FromString(prepared.SerializeToString())  # to read the flat labels, output them too
    probe.graph.output.append(helper.make_tensor_value_info(flat.labels, TensorProto.INT64, None))
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    logits, scores, flat_labels = session.run(["logits", flat.scores, flat.labels], {"x": x, "labels": labels})
    assert logits.shape == (2, 3, 5) and scores.shape == (6, 5)
    np.testing.assert_array_equal(scores, logits.reshape(6, 5))
    np.testing.assert_array_equal(flat_labels, labels.reshape(-1))
    assert report[0]["pass"] == "flatten_logits"


def test_flatten_logits_leaves_2d_logits_alone():
    model = _logits_model(["b", 5])
    prepared, flat = flatten_logits(model, "logits", "labels")
    assert prepared == model and (flat.scores, flat.labels) == ("logits", "labels")


def test_flatten_logits_refuses_a_label_input_of_the_wrong_rank():
    model = _logits_model(["b", "t", 5])
    model.graph.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["b", "t", "x"]))
    with pytest.raises(GraphError, match=r"model.label_input: .*'labels' has 3 dims.*2 dims"):
        flatten_logits(model, "logits", "labels")


def test_batchnorm_running_statistics_are_listed_for_freezing_only_when_trained(tmp_path):
    from tests.support.graph import batchnorm_classifier

    model = onnx.load(str(batchnorm_classifier(tmp_path / "bn.onnx")))
    params = {t.name for t in model.graph.initializer}
    report = []
    assert untrainable_initializers(model, params, report) == ["bn.running_mean", "bn.running_var"]
    assert report[0]["pass"] == "freeze_untrainable" and len(report[0]["changes"]) == 2
    assert untrainable_initializers(model, params - {"bn.running_var"}) == ["bn.running_mean"]  # frozen by the user


def test_constants_feeding_only_inputs_without_gradient_are_listed_for_freezing():
    scalars = {n: numpy_helper.from_array(np.array(v, np.float32), n)
               for n, v in (("ratio", 0.1), ("lo", -1.0), ("hi", 1.0), ("zero", 0.0), ("two", 2.0), ("unused", 3.0))}
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Dropout", ["h", "ratio"], ["d"]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["c"]),
             helper.make_node("Greater", ["c", "zero"], ["pos"]),  # bool output: no gradient reaches 'zero' ...
             helper.make_node("Where", ["pos", "c", "two"], ["w"]),  # ... but 'two' is a Where branch: trained
             helper.make_node("Pow", ["w", "two"], ["y"])]
    model = make_model(nodes, [f32("x", ["b", 4])], [f32("y", ["b", 4])], [w, *scalars.values()])
    report = []
    frozen = untrainable_initializers(model, {"W", *scalars}, report)
    assert frozen == ["hi", "lo", "ratio", "unused", "zero"]
    text = " ".join(report[0]["changes"])
    assert "Dropout ratio" in text and "Clip bound" in text and "whose outputs are not floats" in text
    assert "'unused' is read by no node" in text


def test_prepare_model_keeps_every_initializer_and_leaves_its_input_alone(tmp_path):
    from ortflow.graph.prepare import prepare_model
    from tests.support.gpt import gpt2_style

    model = onnx.load(str(gpt2_style(tmp_path / "g.onnx")))
    before = model.SerializeToString()
    params = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    prepared = prepare_model(model, params, "cross_entropy", "logits", "labels")
    assert model.SerializeToString() == before
    assert [t.SerializeToString() for t in prepared.model.graph.initializer] == [
        t.SerializeToString() for t in model.graph.initializer]
    assert [r["pass"] for r in prepared.report] == [
        "declare_optional_outputs", "shapes_from_inputs", "declare_broadcast_shapes", "flatten_logits"]
    assert prepared.loss_input != "logits" and prepared.label_input != "labels"
    onnx.checker.check_model(prepared.model, full_check=True)


def test_broadcast_shapes_known_to_onnx_are_left_and_need_no_symbolic_inference(monkeypatch):
    # x [batch, 4] @ w [4, 3] + b [3]: onnx's inference knows the MatMul output as [batch, 3], so nothing is declared
    # and the symbolic inference (sympy, most of a small model's configure) is not run.
    from ortflow.graph import shapes

    def refuse(model):
        raise AssertionError("symbolic shape inference ran")

    monkeypatch.setattr(shapes, "_infer_symbolic_shapes", refuse)
    inits = [numpy_helper.from_array(np.ones((4, 3), np.float32), "w"),
             numpy_helper.from_array(np.ones(3, np.float32), "b")]
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
                       [f32("x", ["batch", 4])], [f32("y", ["batch", 3])], inits)
    report = []
    out = shapes.declare_broadcast_shapes(model, report)
    assert out.SerializeToString() == model.SerializeToString() and out is not model
    assert report == []


def _bias_model(with_mask: bool):
    """T5's shape of a broadcast table: RMS-normalise ``x [batch, seq, 4]`` (``ReduceMean`` with its axes an input,
    opset 18, as the dynamo exporter writes it), add a ``[1, seq, 4]`` table read by position and sliced with bounds
    computed from ``x``'s shape (onnx's inference knows none of the slice's dims); with ``with_mask``, scale by
    ``mask [batch, seq2]``, whose length the symbolic inference must guess equal to ``seq``."""
    table = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(16, 4), "table")
    consts = [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("zero", 0), ("one", 1), ("axes0", [0]), ("starts", [0]), ("axes1", [1]))]
    nodes = [helper.make_node("Constant", [], ["last"], value=numpy_helper.from_array(np.array([-1], np.int64))),
             helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
             helper.make_node("Mul", ["x", "ms"], ["xn"]),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["positions"]),
             helper.make_node("Unsqueeze", ["positions", "axes0"], ["ids"]),
             helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("Unsqueeze", ["n", "axes0"], ["ends"]),
             helper.make_node("Slice", ["rows", "starts", "ends", "axes1"], ["bias"]),
             helper.make_node("Add", ["xn", "bias"], ["y0" if with_mask else "y"])]
    inputs = [f32("x", ["batch", "seq", 4])]
    if with_mask:
        inputs.append(f32("mask", ["batch", "seq2"]))
        nodes += [helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"]),
                  helper.make_node("Mul", ["y0", "mask3"], ["y"])]
    return make_model(nodes, inputs, [f32("y", ["batch", "seq", 4])], [table, *consts], opset=18)


def test_broadcast_operand_after_a_reduce_mean_with_axes_input_is_declared():
    # ONNX Runtime's symbolic inference has no rule for ReduceMean reading its axes as an input (opset 18): it stopped
    # there, nothing was declared, and the engine passed the [batch, seq, 4] gradient to the [1, seq, 4] table unsummed
    from ortflow.graph import shapes

    report = []
    out = shapes.declare_broadcast_shapes(_bias_model(with_mask=False), report)
    assert report[0]["changes"] == ["'bias' declared [1, 'seq', 4]"]
    (bias,) = [v for v in out.graph.value_info if v.name == "bias"]
    assert [d.dim_value or d.dim_param for d in bias.type.tensor_type.shape.dim] == [1, "seq", 4]
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in _bias_model(with_mask=False).graph.node]


def test_broadcast_axis_is_declared_where_the_other_dims_are_a_guess():
    # The mask's length is guessed equal to seq, so the inference reports seq unknown: the table's broadcast axis (1)
    # is declared with the other dims left unknown, which the engine's gradient reads as equal to the output's
    from ortflow.graph import shapes

    report = []
    out = shapes.declare_broadcast_shapes(_bias_model(with_mask=True), report)
    assert "'bias' declared [1, None, 4]" in report[0]["changes"], report
    (bias,) = [v for v in out.graph.value_info if v.name == "bias"]
    dims = bias.type.tensor_type.shape.dim
    assert dims[0].dim_value == 1 and dims[2].dim_value == 4
    assert not dims[1].HasField("dim_value") and not dims[1].HasField("dim_param")
