"""The padding-row mask of a training graph's lookup gradient (ortflow/graph/gradients/padding_rows.py); the trained
values against torch's rule are in tests/trainer/test_padding_rows_mpi.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, shape_inference

from ortflow.graph.gradients.padding_rows import local_padding_rows, mask_padding_rows


def test_a_vocabulary_split_table_has_its_padding_row_on_the_rank_holding_it_shifted():
    rows = {"emb": 300, "kept": 0}
    slicing = {"emb": (0, 1), "kept": (1, 1)}  # kept: split along the embedding axis, every rank has every row
    table_rows = {"emb": 512, "kept": 64}
    assert local_padding_rows(rows, slicing, table_rows, 2, 0) == {"kept": 0}
    assert local_padding_rows(rows, slicing, table_rows, 2, 1) == {"emb": 44, "kept": 0}
    assert local_padding_rows({"emb": 0}, {}, {"emb": 512}, 2, 1) == {"emb": 0}


def _gradient_graph(grad_op: str = "GatherGrad") -> onnx.ModelProto:
    """A lookup and its gradient node as the engine writes them: ``GatherGrad(Shape(W), ids, dY)``; ``W`` read
    through an Identity (a tied table), its gradient a graph output."""
    nodes = [helper.make_node("Identity", ["W"], ["W_read"]),
             helper.make_node("Gather", ["W_read", "ids"], ["y"], axis=0),
             helper.make_node("Shape", ["W_read"], ["x_shape"]),
             helper.make_node(grad_op, ["x_shape", "ids", "dY"], ["W_grad"], domain="com.microsoft", axis=0)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("W", TensorProto.FLOAT, [5, 3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4]),
         helper.make_tensor_value_info("dY", TensorProto.FLOAT, [2, 4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3]),
         helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [5, 3])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_the_lookup_gradient_takes_nothing_from_the_padding_positions():
    model, unmasked = mask_padding_rows(_gradient_graph(), {"W": 2})
    assert unmasked == []
    rng = np.random.default_rng(0)
    ids = np.array([[2, 1, 2, 4], [0, 2, 3, 1]], np.int64)
    dy = rng.normal(size=(2, 4, 3)).astype(np.float32)
    feeds = {"W": rng.normal(size=(5, 3)).astype(np.float32), "ids": ids, "dY": dy}
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["W_grad"], feeds)[0]
    expected = np.zeros((5, 3), np.float32)
    for pos, row in np.ndenumerate(ids):
        if row != 2:
            expected[row] += dy[pos]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert not got[2].any()


def test_a_lookup_whose_gradient_the_pass_does_not_know_is_named():
    model = _gradient_graph()
    model.graph.node[3].input[1] = "dY"  # no gradient node reads the lookup's ids: another form
    model.graph.node[3].input[2] = "ids"
    _, unmasked = mask_padding_rows(model, {"W": 2})
    assert unmasked == ["Gather '' of 'W'"]


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_a_half_precision_lookup_gradient_is_masked_with_a_zero_of_its_type(dtype):
    """Mixed precision casts the table before its lookup: the gradient, and the mask's zero, are fp16 or bf16 (numpy
    has no bfloat16, so a zero built through numpy would be float32, and the engine refuses the Where at load)."""
    model = _gradient_graph()
    cast = model.graph.node[0]
    cast.op_type = "Cast"
    cast.attribute.append(helper.make_attribute("to", dtype))
    for value in (model.graph.input[2], *model.graph.output):
        value.type.tensor_type.elem_type = dtype
    masked, unmasked = mask_padding_rows(model, {"W": 2})
    assert unmasked == []
    (zero,) = [n for n in masked.graph.node if n.name.endswith("/zero_const")]
    assert zero.attribute[0].t.data_type == dtype
    shape_inference.infer_shapes(masked, check_type=True, strict_mode=True)  # the Where's types agree
