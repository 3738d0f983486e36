"""graph/pipeline_parallel/batchnorm_forward.py: a stage's eval model that normalises by the batch when its flag input
is true and by the running statistics when false, on the committed torch CNN export and on a one-node model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.pipeline_parallel.batchnorm_forward import switch_to_batch_statistics
from tests.support.exports import export_path

FLAG = "use_batch"


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()  # no Conv + BatchNorm fusion: in a stage's eval model the statistics are inputs
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _one_batchnorm(opset: int, mean: np.ndarray, var: np.ndarray) -> onnx.ModelProto:
    channels = mean.size
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
             (("scale", np.linspace(0.5, 1.5, channels)), ("bias", np.linspace(-1, 1, channels)), ("mean", mean),
              ("var", var))]  # fmt: skip
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], name="bn",
                            epsilon=1e-5, momentum=0.9)  # fmt: skip
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, channels, 3]) for n in ("x", "y"))
    graph = helper.make_graph([node], "bn", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_the_flag_picks_batch_statistics_or_the_running_ones():
    rng = np.random.default_rng(0)
    mean, var = rng.normal(size=5), rng.uniform(0.5, 2, size=5)
    model = _one_batchnorm(17, mean, var)
    x = (rng.normal(size=(4, 5, 3)) * 3 + 2).astype(np.float32)
    before = _run(model, {"x": x})
    assert switch_to_batch_statistics(model, FLAG) == ["bn"]
    onnx.checker.check_model(model, full_check=True)
    np.testing.assert_array_equal(_run(model, {"x": x, FLAG: np.array(False)}), before)
    scale, bias = np.linspace(0.5, 1.5, 5)[None, :, None], np.linspace(-1, 1, 5)[None, :, None]
    xd = x.astype(np.float64)
    by_batch = (xd - xd.mean(axis=(0, 2), keepdims=True)) / np.sqrt(xd.var(axis=(0, 2), keepdims=True) + 1e-5)
    np.testing.assert_allclose(_run(model, {"x": x, FLAG: np.array(True)}), by_batch * scale + bias, rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    by_running = (xd - mean[None, :, None]) / np.sqrt(var[None, :, None] + 1e-5) * scale + bias
    np.testing.assert_allclose(before, by_running, rtol=1e-5, atol=1e-5)


def test_the_cnn_export_switches_both_batchnorms_and_keeps_its_eval_output():
    model = onnx.load(str(export_path("cnn.onnx")))
    pixels = np.random.default_rng(1).normal(size=(6, 1, 16, 16)).astype(np.float32)
    before = _run(model, {"pixels": pixels})
    assert len(switch_to_batch_statistics(model, FLAG)) == 2
    np.testing.assert_array_equal(_run(model, {"pixels": pixels, FLAG: np.array(False)}), before)
    assert not np.allclose(_run(model, {"pixels": pixels, FLAG: np.array(True)}), before, atol=1e-3)


def test_a_model_without_running_statistics_is_left_alone():
    model = _one_batchnorm(17, np.zeros(3), np.ones(3))
    model.graph.node[0].attribute.append(helper.make_attribute("training_mode", 1))
    model.graph.node[0].output.extend(["m", "v"])
    text = model.SerializeToString()
    assert switch_to_batch_statistics(model, FLAG) == [] and model.SerializeToString() == text
