"""Tiny models and engine artifacts for checkpoint, retention and export tests (made here, in the test's folder)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NUM_FEATURES = 8
HIDDEN = 16
NUM_CLASSES = 3


def build_tiny_mlp(path: Path, seed: int = 0) -> Path:
    """x[N, 8] -> Gemm -> Relu -> Gemm -> logits[N, 3]; opset 17, IR 8 so the engine runs it."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((NUM_FEATURES, HIDDEN)) * 0.3).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "fc1.bias"),
        numpy_helper.from_array((rng.standard_normal((HIDDEN, NUM_CLASSES)) * 0.3).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(NUM_CLASSES, np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["logits"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", NUM_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", NUM_CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def make_artifacts(folder: Path, seed: int = 0) -> Path:
    """Training, eval and optimizer graphs plus the initial checkpoint of the tiny MLP (AdamW, cross-entropy)."""
    from ortflow.engine import artifacts

    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(build_tiny_mlp(folder / "model.onnx", seed)))
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
