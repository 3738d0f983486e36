"""The example model builders: shapes, initial loss, causality, and what the engine can run."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ortflow.examples import build_gpt, build_mlp

SEQ_LEN = 16


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt")
    path = build_gpt(folder / "gpt.onnx", seq_len=SEQ_LEN, d_model=32, num_layers=1, num_heads=2)
    return path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean())


def test_gpt_logits_are_flat_and_initial_loss_is_about_ln_vocab(gpt):
    _, session = gpt
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (3, SEQ_LEN)).astype(np.int64)
    (logits,) = session.run(["logits"], {"input_ids": ids})
    assert logits.shape == (3 * SEQ_LEN, 256)
    assert logits.dtype == np.float32
    assert cross_entropy(logits, rng.integers(0, 256, 3 * SEQ_LEN)) == pytest.approx(math.log(256), abs=0.15)


def test_gpt_is_causal(gpt):
    _, session = gpt
    ids = np.random.default_rng(1).integers(0, 256, (2, SEQ_LEN)).astype(np.int64)
    changed = ids.copy()
    cut = 10
    changed[:, cut] = (changed[:, cut] + 7) % 256
    before = session.run(["logits"], {"input_ids": ids})[0].reshape(2, SEQ_LEN, 256)
    after = session.run(["logits"], {"input_ids": changed})[0].reshape(2, SEQ_LEN, 256)
    np.testing.assert_array_equal(before[:, :cut], after[:, :cut])
    # The changed position and every later one do see the change.
    assert np.all(np.abs(before[:, cut:] - after[:, cut:]).max(axis=-1) > 1e-4)


def test_gpt_batch_rows_are_independent(gpt):
    _, session = gpt
    ids = np.random.default_rng(2).integers(0, 256, (2, SEQ_LEN)).astype(np.int64)
    both = session.run(["logits"], {"input_ids": ids})[0]
    first = session.run(["logits"], {"input_ids": ids[:1]})[0]
    np.testing.assert_allclose(both[:SEQ_LEN], first, atol=1e-5)


def test_gpt_floats_that_are_not_parameters_are_constants(gpt):
    # The engine trains every float initializer: the causal mask and scales must not be initializers.
    path, _ = gpt
    model = onnx.load(str(path))
    names = {t.name for t in model.graph.initializer}
    assert "attn.causal_mask" not in names
    assert all(n.endswith((".weight", ".bias")) for n in names)
    assert all(node.op_type != "Split" for node in model.graph.node)
    assert model.opset_import[0].version == 17 and model.ir_version == 9
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            assert len(node.output) == 3


def test_gpt_rejects_heads_that_do_not_divide_the_width(tmp_path):
    with pytest.raises(ValueError, match=r"num_heads \(3\) must divide d_model \(32\)"):
        build_gpt(tmp_path / "bad.onnx", d_model=32, num_heads=3)


def test_mlp_shapes(tmp_path):
    path = build_mlp(tmp_path / "mlp.onnx", num_features=5, hidden=7, num_classes=4)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"features": np.ones((6, 5), np.float32)})
    assert logits.shape == (6, 4)
    model = onnx.load(str(path))
    assert model.opset_import[0].version == 17 and model.ir_version <= 9
    assert sorted(t.name for t in model.graph.initializer) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
