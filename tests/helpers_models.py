"""Tiny models and engine artifacts for checkpoint, retention and export tests (made here, in the test's folder)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import onnx

from ortflow.examples.mlp import build_mlp

NUM_FEATURES = 8
HIDDEN = 16
NUM_CLASSES = 3


def make_artifacts(folder: Path, seed: int = 0) -> Path:
    """Training, eval and optimizer graphs plus the initial checkpoint of the tiny MLP (AdamW, cross-entropy)."""
    from ortflow.engine import artifacts

    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(build_mlp(folder / "model.onnx", NUM_FEATURES, HIDDEN, NUM_CLASSES, seed)))
    previous = Path.cwd()
    os.chdir(folder)  # generate_artifacts may drop temp.onnx into the current folder
    try:
        artifacts.generate_artifacts(
            model,
            requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
            frozen_params=[],
            loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=artifacts.OptimType.AdamW,
            artifact_directory=str(folder),
        )
    finally:
        os.chdir(previous)
        with contextlib.suppress(FileNotFoundError):
            (folder / "temp.onnx").unlink()
    return folder


def batch(n: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random (x, labels) batch for the tiny MLP."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, NUM_FEATURES)).astype(np.float32), rng.integers(0, NUM_CLASSES, n).astype(np.int64)


def train_steps(artifacts_dir: Path, state, num_steps: int, seed: int = 0, lr: float = 0.05):
    """Run ``num_steps`` AdamW updates on random batches; returns (module, optimizer) so the state stays alive."""
    from ortflow.engine import api

    module = api.Module(str(artifacts_dir / "training_model.onnx"), state, str(artifacts_dir / "eval_model.onnx"))
    optimizer = api.Optimizer(str(artifacts_dir / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(lr)
    module.train()
    for i in range(num_steps):
        x, y = batch(8, seed + i)
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    return module, optimizer


def snapshot(state) -> dict[str, np.ndarray]:
    """Copies of every parameter's values."""
    return {name: np.array(param.data, copy=True) for name, param in sorted(state.parameters)}
