"""configure on models shaped like torch.onnx.export output: it succeeds, the engine's gradients equal finite
differences of the ORIGINAL model (tests/graph/gradcheck.py justifies the tolerance), and one update lowers the loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

from ortflow.config import OptimizerConfig, config_from_dict
from ortflow.configure.configure import configure
from ortflow.engine import api
from ortflow.export.model import build_inference_model, default_outputs, label_names, load_parameters
from ortflow.trainer import optim
from tests.graph.gradcheck import Reference, assert_gradients_match, engine_loss_and_gradients
from tests.support.gelu_forms import gelu_lm, gelu_mlp
from tests.support.gpt import gpt2_style
from tests.support.graph import layernorm_classifier, split_unused_classifier, token_lm

LR = 0.05


def make_cfg(tmp_path: Path, model_path: Path, **model):
    return config_from_dict({
        "name": "t",
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path), **model},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": 4, "num_train_steps": 1},
        "optimizer": {"learning_rate": LR},
    })


def _classifier_batch(rng, batch=4, features=6, classes=3):
    return {"x": rng.standard_normal((batch, features)).astype(np.float32)}, rng.integers(0, classes, batch)


def _token_batch(rng, batch=3, seq_len=5, vocab=11):
    ids = rng.integers(0, vocab, (batch, seq_len)).astype(np.int64)
    return {"input_ids": ids}, np.roll(ids, -1, axis=1)


PATTERNS = {
    # name: (builder, batch maker, pass expected in configure.json's graph_rewrites)
    "layernorm_y_only": (layernorm_classifier, _classifier_batch, "declare_optional_outputs"),
    "fixed_batch_dropout": (lambda p: layernorm_classifier(p, batch=4, dropout=True),
                            _classifier_batch, "declare_optional_outputs"),
    "split_unused_output": (split_unused_classifier, _classifier_batch, "split_to_slices"),
    "btv_logits": (token_lm, _token_batch, "flatten_logits"),
    "gpt2_tied_shape_arithmetic": (lambda p: gpt2_style(p, vocab=11, seq_len=5),
                                   _token_batch, "flatten_logits"),
    # GELUs the engine does not fuse itself, fused by ortflow (graph/exports/gelu.py): gradients against the unfused
    # original
    "gelu_scaled_erf": (lambda p: gelu_mlp(p, "scaled_erf"), _classifier_batch, "fuse_gelu"),
    "gelu_torch_tanh_tied_lm": (lambda p: gelu_lm(p, "torch_tanh"), _token_batch, "fuse_gelu"),
}


def _engine_inputs(record: dict, feeds: dict[str, np.ndarray], labels: np.ndarray) -> list[np.ndarray]:
    by_name = {**feeds, record["label_input"]: labels.astype(np.int64)}
    return [by_name[i["name"]] for i in record["train_inputs"]]


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_configure_gradients_and_one_update(tmp_path, pattern):
    build, make_batch, expected_pass = PATTERNS[pattern]
    model_path = build(tmp_path / "model.onnx")
    original_bytes = model_path.read_bytes()
    result = configure(make_cfg(tmp_path, model_path))
    record = result.info
    assert expected_pass in [r["pass"] for r in record["graph_rewrites"]]
    assert model_path.read_bytes() == original_bytes  # the user's file is never rewritten

    feeds, labels = make_batch(np.random.default_rng(1))
    label_spec = next(i for i in record["train_inputs"] if i["name"] == "labels")
    assert len(label_spec["shape"]) == labels.ndim  # [B] for [B, C] logits, [B, T] for [B, T, V]
    inputs = _engine_inputs(record, feeds, labels)
    loss, grads = engine_loss_and_gradients(result.artifacts_dir, inputs)
    reference = Reference(model_path, feeds, labels)
    assert loss == pytest.approx(reference.loss(reference.params), rel=1e-5)
    assert assert_gradients_match(reference, grads) > 0

    state = api.CheckpointState.load_checkpoint(str(result.artifacts_dir / "checkpoint"))
    module = api.Module(str(result.artifacts_dir / "training_model.onnx"), state,
                        str(result.artifacts_dir / "eval_model.onnx"))
    names = sorted(n for n, p in state.parameters if p.requires_grad)
    params = [state.parameters[n].data.reshape(-1) for n in names]  # ortflow's update works on the engine's views
    update = optim.build_update(OptimizerConfig(), optim.whole_segments(names, [p.size for p in params]), params)
    module.eval()
    before = float(module(*inputs))
    module.train()
    module(*inputs)
    update.step([state.parameters[n].grad.reshape(-1) for n in names], LR)
    module.eval()
    after = float(module(*inputs))
    assert before == pytest.approx(loss, rel=1e-5)  # the eval graph computes the training graph's loss
    assert after < before


@pytest.mark.parametrize("pattern", ["btv_logits", "gpt2_tied_shape_arithmetic"])
def test_exported_model_keeps_the_original_btv_output(tmp_path, pattern):
    build, make_batch, _ = PATTERNS[pattern]
    model_path = build(tmp_path / "model.onnx")
    result = configure(make_cfg(tmp_path, model_path))
    eval_proto = onnx.load(str(result.artifacts_dir / "eval_model.onnx"))
    labels = label_names(eval_proto, result.info, None)
    outputs = default_outputs(eval_proto, result.info, labels)
    assert outputs == ["logits"]
    params = load_parameters(result.artifacts_dir / "checkpoint")
    exported = build_inference_model(eval_proto, params, outputs, labels)
    feeds, _ = make_batch(np.random.default_rng(2))
    got = onnxruntime.InferenceSession(exported.SerializeToString()).run(None, feeds)[0]
    want = onnxruntime.InferenceSession(str(model_path)).run(None, feeds)[0]
    assert got.shape == want.shape == (*feeds["input_ids"].shape, want.shape[-1])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
