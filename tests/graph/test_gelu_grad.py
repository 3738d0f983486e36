"""The tanh GELU's fast CPU gradient (ortflow/graph/gradients/gelu_grad.py): same function, right gradient, CPU only."""

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
from ortflow.graph.exports.gelu import MS_DOMAIN, decompose_gelu, gelu_rewrites
from ortflow.graph.gradients.gelu_grad import restore_tanh_gelus, sigmoid_gelus
from tests.graph.gradcheck import Reference, engine_loss_and_gradients, sample_indices
from tests.support.exports import export_path
from tests.support.gelu_forms import gelu_mlp


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def op_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def fast_gelu_model(with_bias: bool) -> onnx.ModelProto:
    inputs = ["x", "bias"] if with_bias else ["x"]
    graph = helper.make_graph(
        [helper.make_node("FastGelu", inputs, ["y"], domain=MS_DOMAIN)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])],
        [numpy_helper.from_array(np.linspace(-2, 2, 5).astype(np.float32), "bias")])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_sigmoid_form_computes_fast_gelu_and_restores_to_it(with_bias):
    model = fast_gelu_model(with_bias)
    report: list[dict] = []
    rewritten = sigmoid_gelus(model, {}, report)
    assert "FastGelu" not in op_types(rewritten) and "Sigmoid" in op_types(rewritten)
    assert report[0]["pass"] == "sigmoid_gelus"
    onnx.checker.check_model(rewritten)
    # GELU's tails (|x| up to 12) and its bend: float32 rounding only.
    x = {"x": (np.random.default_rng(0).standard_normal((64, 5)) * 4).astype(np.float32)}
    want = run(model, x)[0]
    np.testing.assert_allclose(run(rewritten, x)[0], want, rtol=1e-6, atol=1e-6)
    restored = restore_tanh_gelus(rewritten)
    assert "Sigmoid" not in op_types(restored) and "FastGelu" in op_types(restored)
    assert "Constant" not in op_types(restored)  # the form's constants go with it
    np.testing.assert_allclose(run(restored, x)[0], want, rtol=1e-6, atol=1e-6)


def test_cpu_mode_rewrites_tanh_gelus_and_keeps_the_erf_gelu_fused(tmp_path):
    tanh = onnx.load(gelu_mlp(tmp_path / "t.onnx", "hf_tanh"))
    erf = onnx.load(gelu_mlp(tmp_path / "e.onnx", "torch_erf"))
    assert "Sigmoid" in op_types(gelu_rewrites(tanh, "cpu")) and "FastGelu" not in op_types(gelu_rewrites(tanh, "cpu"))
    assert "Gelu" in op_types(gelu_rewrites(erf, "cpu"))  # the engine's GeluGrad is the fast one for erf
    assert "FastGelu" in op_types(gelu_rewrites(tanh, "engine"))  # the GPU path keeps the engine's kernel
    assert gelu_rewrites(tanh, "as_exported") is tanh
    with pytest.raises(ValueError, match="GELU mode"):
        gelu_rewrites(tanh, "fast")


def _configured(tmp_path, path, device_rows: int = 4):
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
        "data": {"train": [str(tmp_path / "train.npz")], "eval_fraction": 0.25},
        "train": {"batch_size": device_rows, "num_train_steps": 1},
    })  # fmt: skip
    return cfg, configure(cfg)


@pytest.mark.parametrize("form", ["hf_tanh", "torch_tanh"])
def test_cpu_training_graph_has_no_fast_gelu_grad_and_matches_float64_gradients(tmp_path, form):
    path = gelu_mlp(tmp_path / "m.onnx", form)
    _, result = _configured(tmp_path, path)
    training = onnx.load(str(result.artifacts_dir / "training_model.onnx"))
    assert "SigmoidGrad" in op_types(training)
    assert not {"FastGelu", "FastGeluGrad", "Tanh"} & op_types(training)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 6)) * 2).astype(np.float32)
    labels = rng.integers(0, 3, 4)
    _, grads = engine_loss_and_gradients(result.artifacts_dir, [x, labels.astype(np.int64)])
    reference, worst = Reference(path, {"x": x}, labels), 0.0
    for name in sorted(grads):
        indices = sample_indices(grads[name].shape, np.random.default_rng(0), 40)
        want = reference.gradient_entries(name, indices)
        got = np.array([grads[name][i] for i in indices], np.float64)
        worst = max(worst, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-2)))
    # float32 rounding (about 1e-7 of the largest gradient); a wrong derivative is O(1e-4) or more off.
    assert worst < 1e-5, worst


def test_the_export_writes_the_standard_tanh_form_with_the_original_values(tmp_path):
    path = gelu_mlp(tmp_path / "m.onnx", "hf_tanh")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.standard_normal((24, 6)).astype(np.float32),
             labels=rng.integers(0, 3, 24).astype(np.int64))
    cfg, result = _configured(tmp_path, path)
    assert "sigmoid_gelus" in [r["pass"] for r in result.info["graph_rewrites"]]
    prepare_data(cfg)
    proto = onnx.load(str(export_model(cfg.output_dir, tmp_path / "model.onnx", checkpoint="initial").path))
    assert MS_DOMAIN not in {o.domain for o in proto.opset_import}
    assert "Tanh" in op_types(proto) and "Sigmoid" not in op_types(proto)
    feeds = {"x": (rng.standard_normal((7, 6)) * 4).astype(np.float32)}
    np.testing.assert_allclose(run(proto, feeds, ["logits"])[0], run(onnx.load(str(path)), feeds)[0], rtol=1e-5,
                               atol=1e-5)


def test_gpt2_fixture_trains_without_fast_gelu_grad_on_cpu(tmp_path):
    path = export_path("gpt2.onnx")
    _, result = _configured(tmp_path, path)
    training = onnx.load(str(result.artifacts_dir / "training_model.onnx"))
    kinds = [n.op_type for n in training.graph.node]
    assert "FastGeluGrad" not in kinds and "FastGelu" not in kinds
    assert kinds.count("SigmoidGrad") == 4  # one per layer's gelu_new
    # Same function: the first loss equals the exported model's (float32 rounding).
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (2, 16)).astype(np.int64)
    labels = rng.integers(0, 512, (2, 16)).astype(np.int64)
    loss, _ = engine_loss_and_gradients(result.artifacts_dir, [ids, labels])
    logits = run(onnx.load(str(path)), {"input_ids": ids})[0].astype(np.float64).reshape(-1, 512)
    logits -= logits.max(axis=1, keepdims=True)
    want = -(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))[np.arange(32), labels.reshape(-1)].mean()
    assert abs(loss - want) < 1e-5 * abs(want)
    # What the export does to the eval graph: the standard tanh form again (four of them), no sigmoid form left.
    exported = decompose_gelu(onnx.load(str(result.artifacts_dir / "eval_model.onnx")))
    assert [n.op_type for n in exported.graph.node].count("Tanh") == 4 and "Sigmoid" not in op_types(exported)
