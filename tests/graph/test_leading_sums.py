"""The leading-axis sums pass (ortflow/graph/gradients/leading_sums.py): which reductions it rewrites, which it keeps
and why, and that the rewritten training graph computes the same gradients and updates as the engine's own."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ortflow.config import config_from_dict
from ortflow.configure.artifacts import build_artifacts
from ortflow.configure.configure import fingerprint
from ortflow.configure.training_graph import sums_as_matmul_applies
from ortflow.engine import api
from ortflow.examples.gpt import build_gpt
from ortflow.graph.gradients.leading_sums import MARK, LeadingSumReport, sums_as_matmul
from tests.support.bias_lm import build_bias_lm, save


def _cfg(tmp_path, model, device="cpu", **dist):
    gpu = {"device": "cuda", "use_nccl": True} if device == "cuda" else {}
    return config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(tmp_path / "none.npz")]}, "train": {"batch_size": 4, "num_train_steps": 2},
        "distributed": {**gpu, **dist},
    })  # fmt: skip


def _rewritten_copy(src, dst) -> LeadingSumReport:
    """``src``'s artifacts copied to ``dst`` with the pass applied to the training model."""
    shutil.copytree(src, dst)
    details = LeadingSumReport()
    model = sums_as_matmul(onnx.load(str(src / "training_model.onnx")), details=details)
    onnx.checker.check_model(model)
    onnx.save(model, str(dst / "training_model.onnx"))
    return details


def _train(art, batches, lr=0.5):
    """Plain SGD on the engine's buffers: the gradients of every step and the final parameters."""
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    module.train()
    grads = []
    for ids, labels in batches:
        module(ids, labels)
        step = {name: np.array(p.grad, copy=True) for name, p in state.parameters}
        for name, p in state.parameters:
            p.data = (p.data - lr * step[name]).astype(np.float32)
        module.lazy_reset_grad()
        grads.append(step)
    return grads, {name: np.array(p.data, copy=True) for name, p in state.parameters}


def _assert_close(want: dict, got: dict, what: str) -> None:
    """Equal within float32 rounding: the MatMul adds the same terms in another order (and a sum of n terms moves
    by at most ~n ulps of its largest partial sum), so 1e-5 of each tensor's largest value, far below the O(1)
    error of a wrong sum (a missing row, a wrong axis)."""
    assert set(want) == set(got)
    for name in want:
        scale = max(float(np.abs(want[name]).max()), 1e-6)
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5 * scale, err_msg=f"{what}: {name}")


def test_bias_and_gain_sums_become_matmuls_and_the_row_bias_sum_stays(tmp_path):
    cfg = _cfg(tmp_path, save(build_bias_lm(), tmp_path / "lm.onnx"))
    build_artifacts(cfg, tmp_path / "art")
    details = _rewritten_copy(tmp_path / "art", tmp_path / "mm")
    # Gemm's bias, the Add bias, the per-channel gain (Mul) and the position table: sums over leading axes.
    assert sorted(details.rewritten) == ["/fc/Add_Grad/ReduceSum_2", "/gained/Mul_Grad/ReduceSum_4",
                                         "/pos/Add_Grad/ReduceSum_2", "/proj/Gemm_Grad/ReduceSum_3"]  # fmt: skip
    # The [T, 1] row bias sums over axes 0 and 2 of [B, T, d]: not a leading run, left to the engine.
    assert details.kept == {"/rows/Add_Grad/ReduceSum_2": "axes [2, 0] of a rank-3 input are not a leading run "
                                                          "that keeps a dim"}  # fmt: skip
    before = onnx.load(str(tmp_path / "art" / "training_model.onnx")).graph
    after = onnx.load(str(tmp_path / "mm" / "training_model.onnx")).graph
    assert [n.name for n in after.node if n.op_type == "ReduceSum"] == ["/rows/Add_Grad/ReduceSum_2"]
    assert sum(n.op_type == "MatMul" and n.doc_string == MARK for n in after.node) == 4
    # The engine's axes initializers go with their reductions; the kept reduction keeps its own.
    (kept,) = [n for n in after.node if n.op_type == "ReduceSum"]
    assert [t.name for t in after.initializer if "ReduceAxes_for_" in t.name] == [kept.input[1]]
    assert len([t for t in before.initializer if "ReduceAxes_for_" in t.name]) == 5
    # Inputs, outputs (the gradients the trainer reads) and initializers keep their names and types.
    for field in ("input", "output"):
        assert [(v.name, v.type) for v in getattr(before, field)] == [(v.name, v.type) for v in getattr(after, field)]
    assert [t.name for t in before.initializer if t.data_type == TensorProto.FLOAT] == [
        t.name for t in after.initializer if t.data_type == TensorProto.FLOAT]  # fmt: skip
    made = {o for n in after.node if n.doc_string == MARK for o in n.output}
    assert {"fc.bias_grad", "gain_grad", "wpe.weight_grad", "/proj/Gemm_Grad/dC_reduced"} <= made


@pytest.mark.parametrize("which", ["lm", "gpt"])
def test_rewritten_training_graph_gives_the_same_gradients_and_updates(tmp_path, which):
    rng = np.random.default_rng(1)
    if which == "lm":
        model, vocab, seq = save(build_bias_lm(), tmp_path / "m.onnx"), 16, 6
    else:
        model, vocab, seq = build_gpt(tmp_path / "m.onnx", vocab_size=64, seq_len=8, d_model=16, num_layers=2,
                                      num_heads=2), 64, 8  # fmt: skip
    build_artifacts(_cfg(tmp_path, model), tmp_path / "art")
    details = _rewritten_copy(tmp_path / "art", tmp_path / "mm")
    assert len(details.rewritten) >= 4
    batches = []
    for _ in range(4):
        tokens = rng.integers(0, vocab, (4, seq + 1))
        labels = tokens[:, 1:] if which == "lm" else tokens[:, 1:].reshape(-1)
        batches.append((tokens[:, :-1], labels))
    want_grads, want_params = _train(tmp_path / "art", batches)
    got_grads, got_params = _train(tmp_path / "mm", batches)
    for step, (want, got) in enumerate(zip(want_grads, got_grads, strict=True)):
        _assert_close(want, got, f"gradient at step {step}")
    _assert_close(want_params, got_params, "parameters after 4 SGD steps")
    # The graphs do differ: some bias gradient is not bitwise equal (else this test could not tell them apart).
    assert any(not np.array_equal(w[n], g[n]) for w, g in zip(want_grads, got_grads, strict=True) for n in w)


def _reduce_model(shape, axes, keepdims=1, dtype=TensorProto.FLOAT, opset=17, axes_input="const"):
    """One ReduceSum of input ``x`` (``shape``: ints, names or None) in several spellings."""
    nodes, inputs = [], [helper.make_tensor_value_info("x", dtype, shape)]
    if opset < 13:
        nodes.append(helper.make_node("ReduceSum", ["x"], ["y"], name="sum", axes=axes, keepdims=keepdims))
    else:
        if axes_input == "const":
            nodes.append(helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(
                np.array(axes, np.int64), "axes")))  # fmt: skip
        else:  # axes fed at run time
            inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [len(axes)]))
        nodes.append(helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum", keepdims=keepdims))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", dtype, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("shape, axes, keepdims, opset", [
    ([4, 3, 5], [0, 1], 0, 17), ([4, 3, 5], [1, 0], 1, 17), (["B", 3, 5], [0], 0, 17), (["B", "T", 5], [-3, -2], 0, 17),
    ([6, 5], [0], 1, 11), ([2, 3, 4, 5], [0, 1], 0, 13),
])  # fmt: skip
def test_rewritten_sums_equal_numpy_for_each_spelling(shape, axes, keepdims, opset):
    model = _reduce_model(shape, axes, keepdims, opset=opset)
    details = LeadingSumReport()
    out = sums_as_matmul(model, details=details)
    assert details.rewritten == ["sum"] and not any(n.op_type == "ReduceSum" for n in out.graph.node)
    concrete = [d if isinstance(d, int) else 2 + i for i, d in enumerate(shape)]
    x = np.random.default_rng(0).standard_normal(concrete).astype(np.float32)
    want = x.sum(axis=tuple(axes), keepdims=bool(keepdims))
    (got,) = ReferenceEvaluator(out).run(None, {"x": x})
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ones = [n for n in out.graph.node if n.doc_string == MARK and n.op_type in ("Constant", "Expand")
            and "ones" in n.output[0]]  # fmt: skip
    # A known N gets a Constant of ones; a symbolic one an Expand from the input's shape at run time.
    assert [n.op_type for n in ones] == (["Constant"] if all(isinstance(d, int) for d in shape) else ["Expand"])


def test_fp16_sum_keeps_its_type_and_same_leading_dims_share_one_ones_vector():
    x = helper.make_tensor_value_info
    nodes = [helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0, 1]), "axes")),
             helper.make_node("ReduceSum", ["a", "axes"], ["ya"], name="sa", keepdims=0),
             helper.make_node("ReduceSum", ["b", "axes"], ["yb"], name="sb", keepdims=0)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [x("a", TensorProto.FLOAT16, ["B", 3, 4]),
                                           x("b", TensorProto.FLOAT16, ["B", 3, 6])],
                              [x("ya", TensorProto.FLOAT16, [4]), x("yb", TensorProto.FLOAT16, [6])])  # fmt: skip
    out = sums_as_matmul(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    assert sum(n.op_type == "Expand" for n in out.graph.node) == 1  # one [1, B*3] ones for both
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float16), rng.standard_normal((2, 3, 6)).astype(np.float16)
    ya, yb = ReferenceEvaluator(out).run(None, {"a": a, "b": b})
    assert ya.dtype == np.float16 and yb.dtype == np.float16
    np.testing.assert_allclose(ya, a.astype(np.float32).sum((0, 1)), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(yb, b.astype(np.float32).sum((0, 1)), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("model, reason", [
    (_reduce_model([4, 3, 5], [1]), "not a leading run"),
    (_reduce_model([4, 3, 5], [0, 1, 2]), "not a leading run"),
    (_reduce_model([4, 3, "C"], [0]), "kept dims [3, 'C'] not all known"),
    (_reduce_model(None, [0]), "input rank unknown"),
    (_reduce_model([4, 3], [0], axes_input="runtime"), "axes known only at run time"),
    (_reduce_model([4, 3], [0], dtype=TensorProto.INT64), "element type INT64"),
])  # fmt: skip
def test_other_sums_are_left_alone_with_the_reason(model, reason):
    details = LeadingSumReport()
    out = sums_as_matmul(model, details=details)
    assert details.rewritten == [] and reason in details.kept["sum"]
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]


def test_configure_rewrites_gpu_training_graphs_unless_opted_out_and_the_fingerprint_tells(tmp_path):
    model = save(build_bias_lm(), tmp_path / "lm.onnx")
    on, off = _cfg(tmp_path, model, "cuda"), _cfg(tmp_path, model, "cuda", reduce_sum_as_matmul=False)
    nondet = _cfg(tmp_path, model, "cuda", deterministic_compute=False)
    assert sums_as_matmul_applies(on) and not sums_as_matmul_applies(off) and not sums_as_matmul_applies(nondet)
    assert not sums_as_matmul_applies(_cfg(tmp_path, model))  # the CPU's ReduceSum has no slow deterministic path
    assert len({fingerprint(on), fingerprint(off), fingerprint(nondet)}) == 2  # off and nondet build the same graph
    info = build_artifacts(on, tmp_path / "on")
    build_artifacts(off, tmp_path / "off")
    count = {name: sum(n.op_type == "ReduceSum" for n in onnx.load(str(tmp_path / name / "training_model.onnx"),
                                                                    load_external_data=False).graph.node)
             for name in ("on", "off")}  # fmt: skip
    assert count == {"on": 1, "off": 5}
    (entry,) = [r for r in info.rewrites if r["pass"] == "sums_as_matmul"]
    assert len(entry["changes"]) == 4
