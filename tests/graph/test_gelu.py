"""The GELU fusion pass (ortflow/graph/exports/gelu.py) on GELUs as exporters write them, and its inverse for export."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.export import export_model
from ortflow.graph.exports.gelu import MS_DOMAIN, decompose_gelu, fuse_gelu
from tests.support.gelu_forms import FORMS, gelu_lm, gelu_mlp


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def features(seed: int = 0, rows: int = 7) -> dict[str, np.ndarray]:
    # Wide spread: GELU's tails (x << 0, x >> 0) and its bend (|x| < 3) are all exercised.
    return {"x": (np.random.default_rng(seed).standard_normal((rows, 6)) * 4).astype(np.float32)}


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == MS_DOMAIN]


@pytest.mark.parametrize("form", FORMS)
def test_every_exported_form_becomes_one_engine_node_with_the_same_values(tmp_path, form):
    model = onnx.load(gelu_mlp(tmp_path / "m.onnx", form))
    fc1 = next(n.output[0] for n in model.graph.node if n.op_type == "Add" and "fc1.bias" in n.input)
    report: list[dict] = []
    fused = fuse_gelu(model, report)

    want = "FastGelu" if "tanh" in form else "Gelu"
    assert [(n.op_type, list(n.input)) for n in fused_nodes(fused)] == [(want, [fc1])]
    assert not {"Erf", "Tanh", "Pow", "Div"} & {n.op_type for n in fused.graph.node}
    assert not [n for n in fused.graph.node if n.op_type == "Mul"]  # every Mul was part of the GELU
    assert MS_DOMAIN in {o.domain for o in fused.opset_import}
    assert report[0]["pass"] == "fuse_gelu" and want in report[0]["changes"][0]
    onnx.checker.check_model(fused)
    assert len(fused_nodes(model)) == 0  # the input model is left as it was
    np.testing.assert_allclose(run(fused, features())[0], run(model, features())[0], rtol=1e-5, atol=1e-5)


def test_a_gelu_whose_intermediate_is_read_elsewhere_is_left_alone(tmp_path):
    model = onnx.load(gelu_mlp(tmp_path / "m.onnx", "torch_erf", extra_reader=True))
    assert fuse_gelu(model) is model


def test_a_near_miss_constant_is_not_a_gelu(tmp_path):
    model = onnx.load(gelu_mlp(tmp_path / "m.onnx", "torch_erf"))
    for node in model.graph.node:  # 0.5 -> 0.55: x * (1 + erf) * 0.55 is not GELU
        if node.op_type == "Constant" and numpy_helper.to_array(node.attribute[0].t).item() == 0.5:
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(0.55, np.float32), node.output[0]))
    assert fuse_gelu(model) is model


def test_a_pipeline_cut_inside_a_gelu_keeps_it(tmp_path):
    model = onnx.load(gelu_mlp(tmp_path / "m.onnx", "torch_erf"))
    erf = next(n.output[0] for n in model.graph.node if n.op_type == "Erf")
    assert fuse_gelu(model, keep={erf}) is model
    assert len(fused_nodes(fuse_gelu(model, keep={"x"}))) == 1  # a kept name outside the GELU does not matter


def test_two_gelus_in_one_graph_are_both_fused(tmp_path):
    model = onnx.load(gelu_lm(tmp_path / "a.onnx", "torch_tanh"))
    second = onnx.load(gelu_lm(tmp_path / "b.onnx", "hf_erf"))
    assert [n.op_type for n in fused_nodes(fuse_gelu(model))] == ["FastGelu"]
    assert [n.op_type for n in fused_nodes(fuse_gelu(second))] == ["Gelu"]


@pytest.mark.parametrize("form", ["torch_erf", "hf_tanh"])
def test_decompose_writes_standard_ops_that_fuse_again(tmp_path, form):
    model = onnx.load(gelu_mlp(tmp_path / "m.onnx", form))
    fused = fuse_gelu(model)
    plain = decompose_gelu(fused)
    assert not fused_nodes(plain) and MS_DOMAIN not in {o.domain for o in plain.opset_import}
    onnx.checker.check_model(plain, full_check=True)
    np.testing.assert_allclose(run(plain, features())[0], run(model, features())[0], rtol=1e-5, atol=1e-5)
    assert [n.op_type for n in fused_nodes(fuse_gelu(plain))] == [n.op_type for n in fused_nodes(fused)]


@pytest.mark.parametrize("op_type", ["Gelu", "FastGelu"])
def test_decompose_keeps_an_fp16_graph_in_fp16(op_type):
    # A mixed-precision export in the compute type: the constants must be fp16 too, or the graph does not type-check.
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x"], ["y"], domain=MS_DOMAIN)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    plain = decompose_gelu(model)
    onnx.checker.check_model(plain, full_check=True)
    x = np.linspace(-4, 4, 10, dtype=np.float16).reshape(2, 5)
    np.testing.assert_allclose(run(plain, {"x": x})[0].astype(np.float32), run(model, {"x": x})[0].astype(np.float32),
                               atol=4e-3)


def test_configure_fuses_and_the_export_is_standard_onnx_with_the_original_values(tmp_path):
    path = gelu_mlp(tmp_path / "m.onnx", "torch_erf")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.standard_normal((24, 6)).astype(np.float32),
             labels=rng.integers(0, 3, 24).astype(np.int64))
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
        "data": {"train": [str(tmp_path / "train.npz")], "eval_fraction": 0.25},
        "train": {"batch_size": 4, "num_train_steps": 1},
    })
    result = configure(cfg)
    assert "fuse_gelu" in [r["pass"] for r in result.info["graph_rewrites"]]
    training = onnx.load(str(result.artifacts_dir / "training_model.onnx"))
    assert {"Gelu", "GeluGrad"} <= {n.op_type for n in training.graph.node}
    assert "Erf" not in {n.op_type for n in training.graph.node}
    prepare_data(cfg)

    exported = export_model(cfg.output_dir, tmp_path / "model.onnx", checkpoint="initial").path
    proto = onnx.load(str(exported))
    assert MS_DOMAIN not in {o.domain for o in proto.opset_import}
    assert "Erf" in {n.op_type for n in proto.graph.node}
    np.testing.assert_allclose(run(proto, features(), ["logits"])[0], run(onnx.load(str(path)), features())[0],
                               rtol=1e-5, atol=1e-5)


def test_the_switch_leaves_the_exported_gelu_as_it_was(tmp_path):
    # torch's approximate="tanh" export: a form the engine's own graph optimizer does not fuse (it fuses torch_erf,
    # hf_erf and hf_tanh itself when it builds the training graph; docs/engine.md, "GELU").
    path = gelu_mlp(tmp_path / "m.onnx", "torch_tanh")
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(path), "fuse_gelu": False},
        "data": {"train": [str(tmp_path / "train.npz")]}, "train": {"batch_size": 4, "num_train_steps": 1},
    })
    result = configure(cfg)
    assert "fuse_gelu" not in [r["pass"] for r in result.info["graph_rewrites"]]
    training = onnx.load(str(result.artifacts_dir / "training_model.onnx"))
    assert "Tanh" in {n.op_type for n in training.graph.node}
    assert not {"FastGelu", "FastGeluGrad"} & {n.op_type for n in training.graph.node}


def _opset20_gelu_mlp(path, approximate: str):
    from tests.support.graph import Builder

    b = Builder(0)
    logits = b.linear(b.op("Gelu", [b.linear("x", "fc1", 6, 16)], approximate=approximate), "fc2", 16, 3)
    graph = helper.make_graph(b.nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["b", 3])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], producer_name="pytorch")
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _worst_gradient_error(tmp_path, path, logits: str) -> float:
    """Largest difference of the engine's gradients from float64 central differences, relative to each tensor's
    largest gradient (tests/graph/gradcheck.py), over 40 entries per tensor."""
    from tests.graph.gradcheck import Reference, engine_loss_and_gradients, sample_indices

    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": [str(tmp_path / "t.npz")]},
                            "train": {"batch_size": 4, "num_train_steps": 1}})
    result = configure(cfg)
    rng = np.random.default_rng(1)
    feeds, labels = {"x": (rng.standard_normal((4, 6)) * 2).astype(np.float32)}, rng.integers(0, 3, 4)
    _, grads = engine_loss_and_gradients(result.artifacts_dir, [feeds["x"], labels.astype(np.int64)])
    reference, worst = Reference(path, feeds, labels, output=logits), 0.0
    for name in sorted(grads):
        indices = sample_indices(grads[name].shape, np.random.default_rng(0), 40)
        want = reference.gradient_entries(name, indices)
        got = np.array([grads[name][i] for i in indices], np.float64)
        worst = max(worst, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-2)))
    return worst


def test_opset20_tanh_gelu_trains_with_its_own_gradient(tmp_path):
    path = _opset20_gelu_mlp(tmp_path / "m.onnx", "tanh")
    logits = onnx.load(str(path)).graph.output[0].name
    unfused = configure(config_from_dict({
        "output_dir": str(tmp_path / "r0"), "model": {"path": str(path), "fuse_gelu": False},
        "data": {"train": [str(tmp_path / "t.npz")]}, "train": {"batch_size": 4, "num_train_steps": 1}}))
    prepared = onnx.load(str(unfused.artifacts_dir / "training_model.onnx"))
    # A correctness fix: it runs with the fusion switched off too.
    assert {"FastGelu", "FastGeluGrad"} <= {n.op_type for n in prepared.graph.node}
    assert "GeluGrad" not in {n.op_type for n in prepared.graph.node}
    # fp32 rounding only; the engine's own gradient for Gelu(approximate="tanh") was 2.3e-4 off (the erf form's).
    assert _worst_gradient_error(tmp_path, path, logits) < 1e-5


def test_engine_fact_it_differentiates_opset20_tanh_gelu_as_the_erf_form(tmp_path, monkeypatch):
    # Why tanh_gelu_gradients exists: the engine's own gradient of the untouched node. Should a later engine get it
    # right, this fails and the rewrite can go.
    from ortflow.engine import artifacts

    path = _opset20_gelu_mlp(tmp_path / "m.onnx", "tanh")
    model = onnx.load(str(path))
    params = [t.name for t in model.graph.initializer]
    (tmp_path / "art").mkdir()
    monkeypatch.chdir(tmp_path)  # the generator writes a temporary file into the current folder
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=str(tmp_path / "art"))
    ops = {n.op_type for n in onnx.load(str(tmp_path / "art" / "training_model.onnx")).graph.node}
    assert {"Gelu", "GeluGrad"} <= ops and "FastGeluGrad" not in ops
