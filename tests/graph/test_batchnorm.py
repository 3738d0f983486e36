"""BatchNormalization exported in inference mode: configure freezes its running statistics; the engine trains it with
batch statistics (gradients equal finite differences of a training-mode reference), updates the running statistics
with the ONNX momentum rule, and evaluates with them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortflow.configure.configure import configure
from ortflow.engine import api
from tests.graph.gradcheck import Reference, assert_gradients_match, engine_loss_and_gradients
from tests.graph.test_export_patterns import make_cfg
from tests.support.graph import batchnorm_classifier

STATS = ("bn.running_mean", "bn.running_var")


def _reference(path, x, y):
    """Finite differences over the trained parameters; the running statistics are fed as constants."""
    reference = Reference(path, {"x": x}, y)
    for name in STATS:
        reference.feeds[name] = reference.params.pop(name)
    return reference


def test_batchnorm_trains_with_batch_statistics_and_evaluates_with_running_ones(tmp_path):
    path = batchnorm_classifier(tmp_path / "bn.onnx")
    train_mode = batchnorm_classifier(tmp_path / "bn_train.onnx", training_mode=True)
    result = configure(make_cfg(tmp_path, path))  # nothing frozen in the config
    assert set(STATS) <= set(result.info["frozen"])
    assert "freeze_untrainable" in [r["pass"] for r in result.info["graph_rewrites"]]

    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.integers(0, 3, 5)
    loss, grads = engine_loss_and_gradients(result.artifacts_dir, [x, y.astype(np.int64)])
    batch_stats = _reference(train_mode, x, y)
    assert loss == pytest.approx(batch_stats.loss(batch_stats.params), rel=1e-5)
    assert assert_gradients_match(batch_stats, {n: g for n, g in grads.items() if n not in STATS}) > 0

    d = result.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
    module = api.Module(str(d / "training_model.onnx"), state, str(d / "eval_model.onnx"))
    module.eval()
    running = _reference(path, x, y)
    assert float(module(x, y.astype(np.int64))) == pytest.approx(running.loss(running.params), rel=1e-5)
    module.train()
    module(x, y.astype(np.int64))
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    h = x.astype(np.float64) @ initial["fc1.weight"] + initial["fc1.bias"]
    # ONNX's rule, momentum 0.9: running = 0.9 * running + 0.1 * batch statistic.
    want_mean = 0.9 * initial["bn.running_mean"] + 0.1 * h.mean(axis=0)
    np.testing.assert_allclose(np.array(state.parameters["bn.running_mean"].data), want_mean, rtol=1e-5, atol=1e-6)
