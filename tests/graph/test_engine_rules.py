"""What the engine gets wrong or refuses, and what configure does about it: measured against the engine itself."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.config import ConfigError
from ortflow.configure.configure import configure
from ortflow.engine import api, artifacts
from tests.graph.gradcheck import Reference, assert_gradients_match, engine_loss_and_gradients
from tests.graph.test_export_patterns import make_cfg
from tests.support.gpt import gpt2_style
from tests.support.graph import layernorm_classifier, split_unused_classifier


def _raw_engine_artifacts(model_path: Path, folder: Path) -> Path:
    """Artifacts built by the engine from the model as it is, without ortflow's preparation pass."""
    folder.mkdir()
    model = onnx.load(str(model_path))
    params = [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]
    cwd = os.getcwd()
    os.chdir(folder)  # the engine may write temp.onnx into the current folder
    try:
        artifacts.generate_artifacts(model, requires_grad=params, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    return folder


def _classifier_inputs(seed=1, batch=4, features=6, classes=3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, features)).astype(np.float32), rng.integers(0, classes, batch).astype(np.int64)


def test_split_with_unused_output_wrong_gradient_without_the_pass_right_with_it(tmp_path):
    model_path = split_unused_classifier(tmp_path / "split.onnx")
    x, y = _classifier_inputs()
    reference = Reference(model_path, {"x": x}, y)
    _, raw = engine_loss_and_gradients(_raw_engine_artifacts(model_path, tmp_path / "raw"), [x, y])
    # The engine's own graph: fc1's gradient is wrong (the fact docs/engine.md records and the pass exists for).
    with pytest.raises(AssertionError, match="fc1"):
        assert_gradients_match(reference, raw)
    result = configure(make_cfg(tmp_path, model_path))
    _, fixed = engine_loss_and_gradients(result.artifacts_dir, [x, y])
    assert assert_gradients_match(reference, fixed) > 0


def test_layernorm_with_only_y_fails_in_the_engine_and_trains_after_the_pass(tmp_path):
    model_path = layernorm_classifier(tmp_path / "ln.onnx")
    with pytest.raises(RuntimeError, match=r"OutputDefs\(\).size\(\)"):
        _raw_engine_artifacts(model_path, tmp_path / "raw")
    assert configure(make_cfg(tmp_path, model_path)).info["graph_rewrites"][0]["pass"] == "declare_optional_outputs"


def _square_param_model(path: Path) -> Path:
    """x [b, 3] -> MatMul(x, S @ S) -> MatMul W -> logits: S is read twice by one node and nowhere else."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((3, 3)) * 0.5).astype(np.float32), "S"),
             numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "W")]
    nodes = [helper.make_node("MatMul", ["S", "S"], ["S2"], name="square"),
             helper.make_node("MatMul", ["x", "S2"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_parameter_read_twice_by_one_node_fails_in_the_engine_and_trains_after_the_pass(tmp_path):
    model_path = _square_param_model(tmp_path / "sq.onnx")
    with pytest.raises(RuntimeError, match="Duplicate definition"):
        _raw_engine_artifacts(model_path, tmp_path / "raw")
    result = configure(make_cfg(tmp_path, model_path))
    x, y = _classifier_inputs(features=3)
    _, grads = engine_loss_and_gradients(result.artifacts_dir, [x, y])
    assert assert_gradients_match(Reference(model_path, {"x": x}, y), grads) > 0


def _act_model(path: Path, op: str, after: str, attrs: dict | None = None) -> Path:
    """x -> [Mul a] -> fc1 -> ... with ``op`` applied to ``after`` ('x': the input, 'fc1': fc1's output)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "fc2.weight")]
    first = "act" if after == "x" else "x"
    nodes = [helper.make_node("MatMul", [first, "fc1.weight"], ["fc1"], name="/fc1/MatMul")]
    act = helper.make_node(op, [after], ["act"], name=f"/act/{op}", **(attrs or {}))
    nodes.insert(0 if after == "x" else 1, act)
    nodes.append(helper.make_node("MatMul", ["fc1" if after == "x" else "act", "fc2.weight"], ["logits"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_op_without_gradient_is_refused_before_the_engine_naming_node_op_and_fixes(tmp_path):
    model_path = _act_model(tmp_path / "elu.onnx", "Elu", after="fc1")
    cfg = make_cfg(tmp_path, model_path)
    with pytest.raises(ConfigError) as err:
        configure(cfg)
    text = str(err.value)
    assert "node '/act/Elu' (op Elu)" in text and "Where(x > 0, x, alpha * (Exp(x) - 1))" in text
    assert "model.frozen: [fc1.weight]" in text
    assert not cfg.artifacts_dir.exists()  # refused before the engine ran
    # Both fixes the message gives work: freezing what feeds it ...
    assert configure(make_cfg(tmp_path, model_path, frozen=["fc1.weight"])).info["frozen"] == ["fc1.weight"]


def test_the_suggested_elu_rewrite_trains_with_right_gradients(tmp_path):
    # ... and writing Elu as the message says: Where(x > 0, x, alpha * (Exp(x) - 1)).
    model = onnx.load(str(_act_model(tmp_path / "elu.onnx", "Elu", after="fc1")))
    nodes = [n for n in model.graph.node if n.op_type != "Elu"]
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("zero", 0.0), ("one", 1.0))]
    nodes[1:1] = [helper.make_node("Constant", [], [c.name], value=c) for c in consts] + [
        helper.make_node("Greater", ["fc1", "zero"], ["pos"]), helper.make_node("Exp", ["fc1"], ["e"]),
        helper.make_node("Sub", ["e", "one"], ["em1"]), helper.make_node("Where", ["pos", "fc1", "em1"], ["act"])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(tmp_path / "where.onnx"))
    result = configure(make_cfg(tmp_path, tmp_path / "where.onnx"))
    x, y = _classifier_inputs(features=4)
    _, grads = engine_loss_and_gradients(result.artifacts_dir, [x, y])
    assert assert_gradients_match(Reference(tmp_path / "where.onnx", {"x": x}, y), grads) > 0


def test_op_without_gradient_off_the_trained_path_is_fine(tmp_path):
    # Elu on the input only: nothing upstream is trained, so the engine never differentiates it.
    assert configure(make_cfg(tmp_path, _act_model(tmp_path / "elu.onnx", "Elu", after="x"))).info["trainable"]


def test_engine_failure_for_an_unlisted_op_is_wrapped_with_node_and_op(tmp_path):
    model_path = _act_model(tmp_path / "hardmax.onnx", "Hardmax", after="fc1")
    with pytest.raises(ConfigError, match=r"node '/act/Hardmax' \(op Hardmax\) is on the trained path but the "
                                          r"engine has no gradient for Hardmax.*model.frozen: \[fc1.weight\]"):
        configure(make_cfg(tmp_path, model_path))


def test_initial_checkpoint_holds_the_models_weights_bit_for_bit(tmp_path):
    """Equal-valued initializers stay two parameters (no dedup) and tied weights one; every value is unchanged."""
    model = onnx.load(str(gpt2_style(tmp_path / "base.onnx")))
    wpe = next(t for t in model.graph.initializer if t.name == "transformer.wpe.weight")
    twin = onnx.TensorProto()
    twin.CopyFrom(wpe)
    twin.name = "transformer.wpe_twin.weight"
    model.graph.initializer.append(twin)
    x = next(n for n in model.graph.node if n.op_type == "Add" and "transformer.wpe.weight" in n.input)
    position = list(x.input).index("transformer.wpe.weight")
    bump = helper.make_node("Add", [x.input[position], twin.name], ["/pos_twice"], name="/pos_twice")
    x.input[position] = "/pos_twice"
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(x), bump)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    # Two more initializers with equal values: LayerNorm biases of zeros, each read once.
    for t in model.graph.initializer:
        if t.name in ("transformer.h.0.ln_1.bias", "transformer.h.0.ln_2.bias"):
            t.CopyFrom(numpy_helper.from_array(np.zeros(8, np.float32), t.name))
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    result = configure(make_cfg(tmp_path, path))
    state = api.CheckpointState.load_checkpoint(str(result.artifacts_dir / "checkpoint"))
    stored = {name: np.array(p.data, copy=True) for name, p in state.parameters}
    originals = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
                 if t.data_type == TensorProto.FLOAT}
    assert sorted(stored) == sorted(originals)
    for name, value in originals.items():
        assert stored[name].dtype == value.dtype and stored[name].shape == value.shape, name
        assert stored[name].tobytes() == value.tobytes(), name
    assert stored["transformer.wpe_twin.weight"].tobytes() == stored["transformer.wpe.weight"].tobytes()



def test_engine_failure_for_a_parameter_without_gradient_says_to_freeze_it(tmp_path):
    # The engine's message (measured: a trained Clip bound, before ortflow froze those) for a parameter whose inputs it
    # does not differentiate; configure freezes the ones it knows, and turns this failure for others into the fix.
    from ortflow.graph.gradients.differentiable import explain_engine_error

    model = onnx.load(str(_act_model(tmp_path / "m.onnx", "Relu", after="fc1")))
    message = ("[ONNXRuntimeError] : 1 : FAIL : graph_augmenter.cc:23 AddToExistingNodeArgs add graph outputs - "
               "failed to find NodeArg by name: fc2.weight_grad")
    text = explain_engine_error(message, model, {"fc1.weight", "fc2.weight"})
    assert text is not None and "parameter 'fc2.weight' gets no gradient" in text
    assert "model.frozen: [fc2.weight]" in text and "(MatMul) input 1" in text


def test_cross_entropy_inside_the_model_trains_as_model_output(tmp_path):
    """torch's F.cross_entropy exports as SoftmaxCrossEntropyLoss with only 'output'; the gradient needs 'log_prob'."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "fc.weight")
    nodes = [helper.make_node("MatMul", ["x", "fc.weight"], ["logits"], name="/fc/MatMul"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "target"], ["loss"], name="/loss")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
                                           helper.make_tensor_value_info("target", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path / "ce.onnx"
    onnx.save(model, str(path))
    result = configure(make_cfg(tmp_path, path, loss="model_output", loss_output="loss"))
    assert "declares log_prob" in result.info["graph_rewrites"][0]["changes"][0]
    x, y = _classifier_inputs(features=4)
    by_name = {"x": x, "target": y}
    inputs = [by_name[i["name"]] for i in result.info["train_inputs"]]
    _, grads = engine_loss_and_gradients(result.artifacts_dir, inputs)
    assert assert_gradients_match(Reference(path, {"x": x, "target": y}, y), grads) > 0
