"""shapes_from_inputs: Shape of a computed tensor read from the graph inputs, on the Hugging Face GPT-2 export."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ortflow.graph.pipeline_parallel.pipeline_cuts import _free_nodes
from ortflow.graph.shapes import shapes_from_inputs, symbolic_shapes
from tests.support.exports import export_path


def _run(model, ids):
    return ort.InferenceSession(model.SerializeToString()).run(None, {"input_ids": ids})[0]


def test_gpt2_shape_arithmetic_then_depends_on_no_parameter_and_computes_the_same_at_any_batch_and_length():
    model = onnx.load(str(export_path("gpt2.onnx")))
    before = model.SerializeToString()
    trainable = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    report = []
    rewritten = shapes_from_inputs(model, report)
    shapes_of = {n.input[0] for n in rewritten.graph.node if n.op_type == "Shape"}
    assert shapes_of == {"input_ids"}  # every Shape of an activation (85 of them) now reads the input
    assert report and len(report[0]["changes"]) == 85
    # Every non-float tensor is now computed from the inputs and constants only (so no pipeline cut carries one).
    free = _free_nodes(rewritten.graph, trainable)
    tainted_ints = [n.output[0] for i, n in enumerate(rewritten.graph.node)
                    if i not in free and n.op_type in ("Shape", "Gather", "Concat", "Unsqueeze", "Squeeze", "Range")
                    and not any(x in trainable for x in n.input)]
    assert tainted_ints == []
    for batch, seq in ((1, 5), (3, 17)):
        ids = np.random.default_rng(batch).integers(0, 512, (batch, seq))
        np.testing.assert_array_equal(_run(rewritten, ids), _run(model, ids))
    assert model.SerializeToString() == before  # the input model is left as it was


def test_a_shape_with_a_derived_dim_is_left_as_it_was():
    # x [batch, seq] -> Concat(x, x) along seq: [batch, 2*seq]; its Shape cannot be read off one input dim.
    nodes = [helper.make_node("Concat", ["x", "x"], ["xx"], axis=1), helper.make_node("Shape", ["xx"], ["s"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("s", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = shapes_from_inputs(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Concat", "Shape"]



def test_a_shape_whose_dims_the_inference_guessed_equal_is_left_as_it_was():
    """A piece that adds two received activations whose dims carry different names (the token embedding's
    ``[unk__0, unk__1, C]`` and the position embedding's ``[1, seq, C]``): the inference guesses ``unk__1 = seq`` (in
    set order: either name, or another input dim merged in by chance), so the sum's Shape is not rewritten from either
    input; the inference renames the inputs' dims to the merged name, which must not hide the guess."""
    float_in = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    nodes = [helper.make_node("Add", ["tok", "pos"], ["sum"]), helper.make_node("Shape", ["sum"], ["s"])]
    graph = helper.make_graph(nodes, "g", [float_in("tok", ["unk__0", "unk__1", 4]), float_in("pos", [1, "seq", 4])],
                              [helper.make_tensor_value_info("s", TensorProto.INT64, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert symbolic_shapes(model)["sum"] == ["unk__0", None, 4]
    rewritten = shapes_from_inputs(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Add", "Shape"]
