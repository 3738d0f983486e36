"""The pipeline split pass, one model at a time (no engine, no processes)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.pipeline_parallel.pipeline_cuts import CutEstimate, SplitError, split_model
from ortflow.trainer.parallel.schedule import one_f_one_b
from tests.support.mlp_stack import B, T, V, build_torchlike, trainable


def run_stages(stages, ids):
    acts = {"input_ids": ids}
    for stage in stages:
        sess = ort.InferenceSession(stage.model.SerializeToString())
        feeds = {i.name: acts[i.name] for i in sess.get_inputs()}
        acts.update(zip(stage.sends, sess.run(list(stage.sends), feeds), strict=True))
    return acts["logits"]


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_chained_compute_the_model(num_stages):
    model = build_torchlike(num_blocks=4)
    cuts = CutEstimate(model, trainable(model)).choose(num_stages)
    stages = split_model(model, cuts, trainable(model))
    ids = np.random.default_rng(0).integers(0, V, (B, T))
    full = ort.InferenceSession(model.SerializeToString()).run(["logits"], {"input_ids": ids})[0]
    np.testing.assert_array_equal(run_stages(stages, ids), full)
    assert [s.receives for s in stages[1:]] == [(c,) for c in cuts]
    # Each parameter lives in exactly one stage; Constant nodes are copied to every stage that reads them.
    held = [p for s in stages for p in s.parameters]
    assert sorted(held) == trainable(model)
    assert all(any(n.op_type == "Constant" for n in s.model.graph.node) for s in stages)
    assert "input_ids" in stages[0].data_inputs


def test_automatic_cuts_balance_the_compute_not_the_parameters():
    model = build_torchlike(num_blocks=4)
    (cut,) = CutEstimate(model, trainable(model)).choose(2)
    # Per token: the embedding's Gather reads one 16-wide row of its [32, 16] table, each block 2 * 16 + 16 * 16 + 16
    # = 304, the LM head [16, 32] and ln_f 512 + 32. Before blocks.2.resid: 16 + 3 * 304 = 928, after it 304 + 544 =
    # 848 (the closest to half); a cut by parameter count (blocks.1.resid: 512 + 2 * 304 either side) would leave
    # 624 against 1152.
    assert cut == "blocks.2.resid"
    stages = split_model(model, [cut], trainable(model))
    sizes = {t.name: t.dims[0] * (t.dims[1] if len(t.dims) > 1 else 1) for t in model.graph.initializer}
    per_stage = [sum(sizes[p] for p in s.parameters) for s in stages]
    block = 2 * 16 + 16 * 16 + 16  # LayerNormalization + fc weight and bias
    assert per_stage == [512 + 3 * block, block + 32 + 512]


def test_cut_places_and_stage_shares_follow_the_estimate():
    model = build_torchlike(num_blocks=4)
    params = trainable(model)
    estimate = CutEstimate(model, params)
    places = estimate.places()
    # The residual stream after each block (the first of the places between two parameter reads), with the compute
    # before it out of 1776 (see above: 16 + 4 * 304 + 544).
    named = {p.name: (p.before, p.total) for p in places}
    assert named["blocks.2.resid"] == (928, 1776) and named["blocks.0.resid"] == (320, 1776), named
    assert [p.share for p in places] == sorted(p.share for p in places)
    assert estimate.shares(["blocks.2.resid"]) == [928 / 1776, 848 / 1776]
    assert estimate.shares(["blocks.0.resid", "blocks.2.resid"]) == [320 / 1776, 608 / 1776, 848 / 1776]


def test_tied_weights_across_a_cut_are_held_by_both_stages():
    model = build_torchlike(tied=True)
    stages = split_model(model, ["blocks.0.resid"], trainable(model))
    assert [s.shared for s in stages] == [{"wte": (0, 1)}, {"wte": (0, 1)}]
    assert all("wte" in s.parameters for s in stages)
    assert any(n.op_type == "Transpose" and n.input[0] == "wte" for n in stages[1].model.graph.node)
    ids = np.random.default_rng(0).integers(0, V, (B, T))
    full = ort.InferenceSession(model.SerializeToString()).run(["logits"], {"input_ids": ids})[0]
    np.testing.assert_array_equal(run_stages(stages, ids), full)


def _embed_relu_head() -> onnx.ModelProto:
    """input_ids -> Gather(wte) -> MatMul(w1) -> Relu -> MatMul(w2) -> logits: a single activation crosses after
    the Gather, after the first MatMul and after the Relu, with no parameter read between the last two (as a norm's
    parameter-free arithmetic sits between a residual add and the norm's weight)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("wte", (V, 8)), ("w1", (8, 8)), ("w2", (8, V)))]
    nodes = [helper.make_node("Gather", ["wte", "input_ids"], ["embed"], axis=0),
             helper.make_node("MatMul", ["embed", "w1"], ["hidden"]),
             helper.make_node("Relu", ["hidden"], ["act"]),
             helper.make_node("MatMul", ["act", "w2"], ["logits"])]
    graph = helper.make_graph(nodes, "embed_relu_head",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, T, V])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_automatic_cuts_never_leave_a_stage_without_parameters():
    model = _embed_relu_head()
    params = ["w1", "w2", "wte"]
    for num_stages in (2, 3):
        stages = split_model(model, CutEstimate(model, params).choose(num_stages), params)
        assert all(s.parameters for s in stages), [s.parameters for s in stages]
    # 4 stages would need the cuts after both the MatMul and the Relu, a stage holding nothing: refused with the most
    # stages the model splits into, before any stage is built.
    with pytest.raises(SplitError, match=r"make at most 3 stages.*use distributed.pipeline_parallel_size 3 or fewer, "
                                         r"or name the cuts in model.pipeline_cuts"):
        CutEstimate(model, params).choose(4)


def test_a_shape_tensor_crossing_the_cut_is_refused_naming_its_nodes():
    model = build_torchlike()
    # Cutting at the MatMul of block 0: its Shape -> Concat chain is made before and read (by Reshape) after.
    with pytest.raises(SplitError, match=r"non-float tensors.*'blocks.0.shape_back' \(made by Concat.*Reshape"):
        split_model(model, ["blocks.0.fc"], trainable(model))


def test_random_ops_are_refused():
    model = build_torchlike(dropout=True)
    with pytest.raises(SplitError, match=r"random operators.*Dropout"):
        split_model(model, ["blocks.0.resid"], trainable(model))


def test_bad_cut_names_and_order_are_refused():
    model = build_torchlike(num_blocks=3)
    with pytest.raises(SplitError, match="'nope' is not a tensor computed by the model"):
        split_model(model, ["nope"], trainable(model))
    with pytest.raises(SplitError, match="in graph order"):
        split_model(model, ["blocks.1.resid", "blocks.0.resid"], trainable(model))
    with pytest.raises(SplitError, match="does not depend on any trainable parameter"):
        split_model(model, ["blocks.0.td"], trainable(model))


def test_the_split_is_pure_and_logs_each_stage(caplog):
    model = build_torchlike()
    before = model.SerializeToString()
    with caplog.at_level(logging.INFO, logger="ortflow.graph.pipeline_parallel.pipeline_cuts"):
        split_model(model, ["blocks.0.resid"], trainable(model))
    assert model.SerializeToString() == before
    assert "pipeline stage 1" in caplog.text


@pytest.mark.parametrize(("num_stages", "num_micro"), [(2, 4), (4, 4), (3, 2), (4, 8)])
def test_one_f_one_b_orders_and_bounds_the_held_inputs(num_stages, num_micro):
    for stage in range(num_stages):
        order = one_f_one_b(stage, num_stages, num_micro)
        last = stage == num_stages - 1
        assert sorted(i for kind, i in order if kind == "B") == list(range(num_micro))
        if not last:
            assert [i for kind, i in order if kind == "F"] == list(range(num_micro))
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(num_micro))
        held, most = set(), 0
        for kind, i in order:
            held.add(i)
            most = max(most, len(held))
            if kind == "B":
                held.discard(i)
        assert most <= min(num_stages - stage, num_micro)  # 1F1B: at most P - s micro-batches' inputs held


@pytest.mark.parametrize("elem", [TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.DOUBLE])
def test_a_cut_crossed_by_an_activation_that_is_not_float32_is_refused_and_never_chosen(elem):
    """Stages send each other float32: a cut where a bfloat16 (float16, double) activation crosses is refused naming
    it and the way out, and the automatic cuts never go there."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in range(3)]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["h0"]),
         helper.make_node("Cast", ["h0"], ["narrow"], to=elem),
         helper.make_node("Cast", ["narrow"], ["wide"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["wide", "w1"], ["h1"]),
         helper.make_node("MatMul", ["h1", "w2"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    params = ["w0", "w1", "w2"]
    with pytest.raises(SplitError, match=r"cut 1 is crossed by 'narrow' \(made by Cast .*\) of type "
                                         + TensorProto.DataType.Name(elem).lower()
                                         + r": pipeline stages send each other float32 activations"):
        split_model(model, ["narrow"], params)
    assert [p.name for p in CutEstimate(model, params).places()] == ["h0", "h1"]
    assert CutEstimate(model, params).choose(2) in (["h0"], ["h1"])
