"""The autocast pass on graphs shaped like torch.onnx.export output (tests/support/tiny_lm.py), on the CPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.precision.autocast import (
    BFLOAT16,
    FLOAT,
    FLOAT16,
    AutocastError,
    autocast,
    autocast_report,
    convert_tensor,
    fold_parameter_casts,
    strip_autocast,
    to_bfloat16_bits,
)
from tests.support.tiny_lm import build_tiny_lm


def _types(model: onnx.ModelProto) -> dict[str, int]:
    graph = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {t.name: t.data_type for t in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def _run(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16])
def test_rewritten_graph_type_checks_and_runs_matmuls_in_the_compute_type(compute):
    model = autocast(build_tiny_lm(), compute)
    onnx.checker.check_model(model, full_check=True)  # strict type inference: every op's inputs agree
    types = _types(model)
    for node in _nodes(model, "MatMul") + _nodes(model, "Gather")[:1] + _nodes(model, "Erf"):
        assert all(types[i] == compute for i in node.input if types.get(i) in (FLOAT, compute)), node.name
        assert types[node.output[0]] == compute, node.name


def test_layer_norm_and_softmax_stay_fp32_with_casts_around():
    model = autocast(build_tiny_lm())
    types = _types(model)
    produced = {o: n for n in model.graph.node for o in n.output}
    for op in ("LayerNormalization", "Softmax"):
        (node,) = _nodes(model, op)
        assert types[node.input[0]] == FLOAT and types[node.output[0]] == FLOAT
        assert produced[node.input[0]].op_type == "Cast"  # fp16 activations cast up before the op
    (ln,) = _nodes(model, "LayerNormalization")
    assert list(ln.input[1:]) == ["ln.weight", "ln.bias"]  # its fp32 parameters read directly, no cast
    (softmax,) = _nodes(model, "Softmax")
    readers = [n for n in model.graph.node if softmax.output[0] in n.input]
    assert [r.op_type for r in readers] == ["Cast"]  # cast down once, then the fp16 MatMul with V


def test_inputs_outputs_and_weights_are_unchanged():
    original = build_tiny_lm()
    model = autocast(original)
    assert model.graph.input == original.graph.input and model.graph.output == original.graph.output
    assert [t.SerializeToString() for t in model.graph.initializer] == [
        t.SerializeToString() for t in original.graph.initializer]
    assert _types(model)["logits"] == FLOAT
    produced = {o: n for n in model.graph.node for o in n.output}
    assert produced["logits"].op_type == "Cast" and produced["logits"].name == "autocast/logits/output"
    assert original.graph.node[0].input[0] == "transformer.wte.weight"  # the input proto was not modified


def test_each_parameter_is_cast_once_even_when_tied():
    model = autocast(build_tiny_lm())
    casts = [n for n in _nodes(model, "Cast") if n.input[0].startswith(("transformer.", "attn.", "mlp."))]
    sources = [n.input[0] for n in casts]
    assert len(sources) == len(set(sources))
    wte_cast = next(n for n in casts if n.input[0] == "transformer.wte.weight")
    readers = {n.op_type for n in model.graph.node if wte_cast.output[0] in n.input}
    assert readers == {"Gather", "Transpose"}  # the tied embedding: one fp16 copy read by both uses
    report = autocast_report(build_tiny_lm())
    assert report.parameter_casts == len(casts) == 12  # every parameter but the fp32 LayerNorm's two
    assert report.kept_fp32 == {"LayerNormalization": 1, "Softmax": 1}


def test_fp16_outputs_follow_the_fp32_model_and_strip_restores_it_bit_for_bit():
    original = build_tiny_lm()
    ids = np.random.default_rng(0).integers(0, 32, (2, 8))
    reference = _run(original, ids)
    mixed = _run(autocast(original), ids)
    # fp16 keeps 11 significant bits (relative rounding 4.9e-4) per op; a few ops deep on O(1) values: 5e-3 is
    # ten roundings of the largest logit, far below the gap between a right and a wrong rewrite (O(0.1)).
    assert mixed.dtype == np.float32
    np.testing.assert_allclose(mixed, reference, atol=5e-3 * float(np.abs(reference).max()))
    restored = strip_autocast(autocast(original))
    assert helper.printable_graph(restored.graph) == helper.printable_graph(original.graph)
    assert np.array_equal(_run(restored, ids), reference)


def test_float_constants_are_converted_and_clipped_to_the_fp16_range():
    nodes = [
        helper.make_node("Constant", [], ["mask"], value=numpy_helper.from_array(np.array([-1e9, 0.0], np.float32))),
        helper.make_node("Add", ["x", "mask"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [2])],
                              [helper.make_tensor_value_info("y", FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = autocast(model)
    converted = next(n for n in out.graph.node if n.name == "autocast/mask/fp16")
    value = numpy_helper.to_array(converted.attribute[0].t)
    assert value.dtype == np.float16 and value.tolist() == [-65504.0, 0.0]  # -1e9 would be -inf in fp16
    assert autocast_report(model).clipped_constants == ["mask"]
    session = onnxruntime.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.isfinite(session.run(None, {"x": np.array([1.0, 2.0], np.float32)})[0]).all()


def test_bfloat16_bits_round_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], np.float32)
    bits = to_bfloat16_bits(values)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    assert back[0] == 1.0 and back[1] == 1.0  # halfway rounds to even (down)
    assert back[2] == 1.015625  # halfway rounds to even (up)
    assert back[3] == -2.5 and np.isfinite(back[4])


def test_configured_fp32_ops_and_cast_to_float_in_low_regions():
    model = autocast(build_tiny_lm(), fp32_ops=("LayerNormalization", "Softmax", "Erf"))
    types = _types(model)
    (erf,) = _nodes(model, "Erf")
    assert types[erf.input[0]] == FLOAT
    nodes = [helper.make_node("Cast", ["i"], ["f"], to=FLOAT), helper.make_node("Mul", ["f", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", FLOAT, [2])],
                              [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    out = autocast(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(out, full_check=True)
    assert out.graph.node[0].attribute[0].i == FLOAT16  # the int -> float Cast now makes fp16 directly
    assert strip_autocast(out).graph.node[0].attribute[0].i == FLOAT


def test_fold_parameter_casts_stores_compute_type_weights():
    model = fold_parameter_casts(autocast(build_tiny_lm()))
    onnx.checker.check_model(model, full_check=True)
    by_name = {t.name: t.data_type for t in model.graph.initializer}
    assert by_name["attn.q.weight__fp16"] == FLOAT16 and "attn.q.weight" not in by_name
    assert by_name["ln.weight"] == FLOAT  # read by the fp32 LayerNormalization: stays fp32


def test_a_tensor_without_type_information_is_a_clear_error():
    nodes = [helper.make_node("CustomThing", ["x"], ["h"], domain="com.microsoft"),
             helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, [2])],
                              [helper.make_tensor_value_info("y", FLOAT, [2])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    with pytest.raises(AutocastError, match="no type for 'h' \\(CustomThing.*precision.fp32_ops"):
        autocast(model)


def test_bf16_constants_beyond_its_range_are_clipped_not_infinite():
    # Hugging Face writes torch.finfo(float32).min as the additive attention mask; rounded to bf16 it is -inf, and
    # (1 - mask) * -inf is NaN where the mask is 1: the BERT fixture's bf16 loss was NaN at the first update on a GPU.
    from onnx import TensorProto

    from tests.support.exports import export_path

    model = autocast(onnx.load(str(export_path("bert.onnx"))), TensorProto.BFLOAT16)
    tensors = [n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute[0].name == "value"]
    tensors += list(model.graph.initializer)
    bf16 = [t for t in tensors if t.data_type == TensorProto.BFLOAT16]
    assert bf16, "the bf16 rewrite holds no bf16 constant"
    for t in bf16:
        values = (np.frombuffer(t.raw_data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        assert np.isfinite(values).all(), f"{t.name}: {values[~np.isfinite(values)][:3]}"
    lowest = np.array([np.finfo(np.float32).min], dtype=np.float32)
    tensor, changed = convert_tensor(lowest, "m", TensorProto.BFLOAT16)
    value = (np.frombuffer(tensor.raw_data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)[0]
    assert changed and np.isfinite(value) and value < -3.38e38


@pytest.mark.parametrize("compute", [FLOAT16, BFLOAT16])
def test_an_output_also_read_by_an_fp32_op_is_cast_back_once_under_its_name(compute):
    """A pipeline stage or tensor-parallel piece sends its residual stream and normalises it too: the output is made in
    the compute type and read in fp32 inside the graph; one Cast back under the output's name serves both."""
    x = helper.make_tensor_value_info("x", FLOAT, [2, 4])
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32), "w")
    scale, bias = numpy_helper.from_array(np.ones(4, np.float32), "g"), numpy_helper.from_array(np.zeros(4, np.float32),
                                                                                                "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),  # low: h is made in the compute type
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], name="ln", axis=-1)]  # reads h in fp32
    graph = helper.make_graph(nodes, "part", [x], [helper.make_tensor_value_info("h", FLOAT, [2, 4]),
                                                   helper.make_tensor_value_info("n", FLOAT, [2, 4])], [w, scale, bias])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mixed = autocast(original, compute)
    onnx.checker.check_model(mixed, full_check=True)  # every input is made before it is read
    assert [n.output for n in mixed.graph.node].count(["h"]) == 1
    assert _types(mixed)["h"] == FLOAT
    assert helper.printable_graph(strip_autocast(mixed).graph) == helper.printable_graph(original.graph)
    if compute == BFLOAT16:
        return  # the CPU engine has no bf16 MatMul to run it with
    feeds = {"x": np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)}
    h, n = onnxruntime.InferenceSession(mixed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    reference = feeds["x"] @ numpy_helper.to_array(w)
    np.testing.assert_allclose(h, reference, rtol=2e-2, atol=2e-2)
