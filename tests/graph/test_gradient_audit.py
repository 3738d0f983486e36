"""The gradient audit: every op variant torch.onnx.export writes (tests/support/audit_cases.py), trained through
configure, has the gradient of the ORIGINAL model to fp32 rounding (float64 central differences, tests/graph/audit.py);
the variants the engine gets wrong are rewritten (ortflow/graph/gradients/gradient_fixes.py) or refused with a fix
(ortflow/graph/gradients/differentiable.py). The engine-fact tests record what the engine does with each untouched, so a
later engine that fixes one shows up. Results: docs/engine.md, "Gradient audit".
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from ortflow.config import ConfigError, config_from_dict
from ortflow.configure.configure import configure
from ortflow.graph.gradients.gradient_fixes import expand_where_inputs, gradient_fixes
from tests.graph.audit import BOUND, audit
from tests.support.audit_cases import CASES_17, CASES_20
from tests.support.audit_graph import build_model

#: Case -> the op configure refuses (naming node, op and fix) because the CPU engine cannot train it.
REFUSED = {
    "conv_transpose": "ConvTranspose", "conv_transpose_outpad": "ConvTranspose",
    "resize_nearest_op17": "Resize", "resize_linear_op19": "Resize",
    "pad_reflect": "Pad", "pad_edge": "Pad", "pad_axes_input": "Pad",
    "sum3": "Sum", "batchnorm_training_statistics_read": "BatchNormalization",
}
CHECKED = {
    "opset17": [c for c in CASES_17 if c.name not in REFUSED],
    "opset18-20": [c for c in CASES_20 if c.name not in REFUSED],
}
BY_NAME = {c.name: c for c in CASES_17 + CASES_20}


@pytest.mark.parametrize("group", sorted(CHECKED))
def test_every_audited_gradient_equals_float64_differences_to_fp32_rounding(tmp_path, group):
    findings, _ = audit(tmp_path, CHECKED[group])
    assert sorted(findings) == sorted(c.name for c in CHECKED[group])
    wrong = {n: f"{f.worst:.2e} ({f.worst_tensor})" for n, f in findings.items() if not f.worst < BOUND}
    assert not wrong, wrong
    # The reference is honest at this bound: its differences at steps h and 2h agree 20 times closer (measured:
    # at most 1e-7, 200 times).
    noisy = {n: f.reference_noise for n, f in findings.items() if not f.reference_noise < BOUND / 20}
    assert not noisy, noisy


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_configure_refuses_what_the_engine_cannot_train_naming_node_and_op(tmp_path, name):
    path, _ = build_model(tmp_path / "m.onnx", [BY_NAME[name]])
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": [str(tmp_path / "t.npz")]},
                            "train": {"batch_size": 4, "num_train_steps": 1}})
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    message = str(err.value)
    assert f"{name}/{REFUSED[name]}" in message and f"op {REFUSED[name]}" in message
    assert "model.frozen" in message  # the way out besides rewriting the op


def test_configure_reports_each_rewrite(tmp_path):
    cases = [BY_NAME[n] for n in ("where_y_broadcast", "reduce_sum_noop", "slice_flip_last_axis",
                                  "batchnorm_training", "matmul_1d", "dropout_ratio_input_eval", "castlike_scale")]
    _, info = audit(tmp_path, cases, count=2)
    passes = {r["pass"]: r["changes"] for r in info["graph_rewrites"]}
    assert len(passes["expand_where_inputs"]) == 1
    assert len(passes["empty_axes_reductions"]) == 1
    assert len(passes["last_axis_slices"]) == 1
    assert len(passes["batchnorm_inference_form"]) == 1
    assert len(passes["vector_matmuls"]) == 1
    assert len(passes["inference_dropouts"]) == 1
    assert len(passes["castlike_to_cast"]) == 1


def test_nothing_to_fix_leaves_the_model_as_it_is(tmp_path):
    path, _ = build_model(tmp_path / "m.onnx", [BY_NAME[n] for n in ("where_same_shapes", "where_masked_fill_constant",
                                                                      "slice_flip", "reduce_sum_all")])
    model = onnx.load(str(path))
    report: list[dict] = []
    assert gradient_fixes(model, report) is model and report == []


def test_a_where_of_unknown_output_shape_is_expanded_to_a_computed_shape():
    # Symbolic dims: the target shape is Shape of a copy of the Where; the values stay the same.
    graph = helper.make_graph(
        [helper.make_node("Where", ["c", "x", "w"], ["y"], name="/Where")], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, ["n", 5]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])],
        [onnx.numpy_helper.from_array(np.arange(5, dtype=np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fixed = expand_where_inputs(model)
    ops = [n.op_type for n in fixed.graph.node]
    assert ops.count("Where") == 2 and "Shape" in ops and "Expand" in ops
    onnx.checker.check_model(fixed, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"c": rng.random((3, 5)) > 0.5, "x": rng.standard_normal((3, 5)).astype(np.float32)}
    np.testing.assert_array_equal(ReferenceEvaluator(fixed).run(None, feeds)[0],
                                  ReferenceEvaluator(model).run(None, feeds)[0])


# What the engine does with each variant untouched (every initializer trained, no ortflow pass). Should a later
# engine get one right, its test fails and the rewrite or refusal can go.
ENGINE_CRASHES = {
    "reduce_sum_noop": "Reduction on all axes",
    "slice_flip_last_axis": "narrowing_error",
    "batchnorm_training": "number of op outputs should be 1",
    "batchnorm_training_statistics_read": "number of op outputs should be 1",
    "conv_transpose": "Could not find an implementation for ConvTransposeGrad",
    "resize_nearest_op17": "Could not find an implementation for ResizeGrad",
    "pad_reflect": "Pad gradient currently supports constant mode only",
    "pad_axes_input": "Pads has incorrect number of values",
    "sum3": "gradient builder has not been registered: Sum",
    "matmul_1d": "Incompatible dimensions for matrix multiplication",
    "where_x_broadcast_column": "cannot be reshaped to the requested shape",
    "castlike_scale": "gradient builder has not been registered: CastLike",
}


@pytest.mark.parametrize("name", sorted(ENGINE_CRASHES))
def test_engine_fact_it_fails_on(tmp_path, name):
    with pytest.raises(Exception, match=ENGINE_CRASHES[name]):
        audit(tmp_path, [BY_NAME[name]], count=1, raw=True)


@pytest.mark.parametrize("name", ["where_y_broadcast", "where_x_broadcast_rank_up", "dropout_mask_declared",
                                  "dropout_mode_false"])
def test_engine_fact_its_gradient_is_silently_wrong(tmp_path, name):
    # A broadcast Where input: not summed over the broadcast axes. An inference-mode Dropout: the forward is the
    # identity, the gradient scaled by 1 / (1 - ratio). Wrong by O(1); 1e-7 with ortflow's rewrites.
    findings, _ = audit(tmp_path, [BY_NAME[name]], raw=True)
    assert findings[name].worst > 0.1, findings[name]


def test_pipeline_stages_get_the_rewrites_too(tmp_path):
    # Stages are cut from the model file, not from prepare_model's output (stage_artifacts.plan_stages).
    from ortflow.configure.stage_artifacts import plan_stages

    cases = [BY_NAME[n] for n in ("where_y_broadcast", "reduce_sum_noop", "slice_flip_last_axis", "matmul_1d")]
    path, _ = build_model(tmp_path / "m.onnx", cases)
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": [str(tmp_path / "t.npz")]},
                            "train": {"batch_size": 4, "num_train_steps": 1},
                            "distributed": {"num_ranks": 2, "pipeline_parallel_size": 2}})
    stages = plan_stages(cfg).stages
    nodes = [n for s in stages for n in s.model.graph.node]
    assert "where_y_broadcast/Where_7/Expand_2" in {n.name for n in nodes}
    assert not [n for n in nodes if n.op_type == "ReduceSum" and n.name.startswith("reduce_sum_noop/")]
    assert [n.op_type for n in nodes if n.name.startswith("slice_flip_last_axis/") and n.op_type in (
        "Transpose", "Slice")] == ["Transpose", "Slice", "Transpose"]
    assert "Squeeze" in {n.op_type for n in nodes if n.name.startswith("matmul_1d/")}
