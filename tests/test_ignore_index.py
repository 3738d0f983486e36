"""model.ignore_index reaches the engine's cross-entropy: rows with that label do not count in the loss."""

from __future__ import annotations

import numpy as np

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.engine import api
from ortflow.examples.mlp import build_mlp


def test_rows_labelled_ignore_index_are_left_out_of_the_loss(tmp_path):
    model = tmp_path / "mlp.onnx"
    build_mlp(model, num_features=4, hidden=8, num_classes=3, seed=0)
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(model), "ignore_index": -100},
        "data": {"train": ["unused.npz"]}, "train": {"batch_size": 4, "num_train_steps": 1},
    })
    configure(cfg)
    art = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    module.eval()
    x = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    with_ignored = float(module(x, np.array([0, 2, -100, 1], dtype=np.int64)))
    without_row = float(module(x[[0, 1, 3]], np.array([0, 2, 1], dtype=np.int64)))
    np.testing.assert_allclose(with_ignored, without_row, rtol=1e-6)
