"""Gradients of the engine's training graph against central finite differences of the user's ORIGINAL model.

The reference runs the original ONNX model in float64 with onnx's ReferenceEvaluator (numpy, every float tensor
cast to double), so the finite differences are accurate to ~1e-9 with a step of 1e-6; the engine computes in
float32. Tolerance (see :func:`assert_gradients_match`): a float32 forward/backward of these 2-layer models
accumulates at most ~1e3 roundings of 6e-8, so ~1e-4 of a tensor's largest gradient; a wrong gradient (the engine's
Split bug, a gradient left out) is wrong by O(1) of it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ortflow.engine import api

RTOL = 1e-3
ATOL_OF_MAX = 1e-4
STEP = 1e-6


def to_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model in float64 with its float initializers turned into graph inputs (fed per evaluation)."""
    model = copy.deepcopy(model)
    graph = model.graph
    floats = [t for t in graph.initializer if t.data_type == TensorProto.FLOAT]
    for t in floats:
        graph.input.append(helper.make_tensor_value_info(t.name, TensorProto.DOUBLE, list(t.dims)))
    kept = [t for t in graph.initializer if t.data_type != TensorProto.FLOAT]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    del graph.value_info[:]
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
    return model


def parameters_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer
            if t.data_type == TensorProto.FLOAT}


class Reference:
    """The mean cross-entropy (classes on the last axis) of the original model, in float64."""

    def __init__(self, model_path: Path, feeds: dict[str, np.ndarray], labels: np.ndarray, output: str = "logits"):
        original = onnx.load(str(model_path))
        self.params = parameters_of(original)
        self.session = ReferenceEvaluator(to_double(original))
        self.feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
        self.labels, self.output = labels.reshape(-1), output

    def loss(self, params: dict[str, np.ndarray]) -> float:
        logits = self.session.run([self.output], {**self.feeds, **params})[0]
        flat = logits.reshape(-1, logits.shape[-1])
        flat = flat - flat.max(axis=1, keepdims=True)
        logp = flat - np.log(np.exp(flat).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(self.labels)), self.labels].mean())

    def gradient_entries(self, name: str, indices: list[tuple[int, ...]]) -> np.ndarray:
        """Central differences of the loss at the given entries of parameter ``name``."""
        out = []
        for index in indices:
            plus = {k: v.copy() for k, v in self.params.items()}
            minus = {k: v.copy() for k, v in self.params.items()}
            plus[name][index] += STEP
            minus[name][index] -= STEP
            out.append((self.loss(plus) - self.loss(minus)) / (2 * STEP))
        return np.array(out)


def engine_loss_and_gradients(artifacts_dir: Path, inputs: list[np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """One forward/backward of the training model on fresh initial parameters; no update."""
    state = api.CheckpointState.load_checkpoint(str(artifacts_dir / "checkpoint"))
    module = api.Module(str(artifacts_dir / "training_model.onnx"), state, str(artifacts_dir / "eval_model.onnx"))
    module.train()
    loss = float(module(*inputs))
    grads = {name: np.array(p.grad, copy=True) for name, p in state.parameters}
    return loss, grads


def sample_indices(shape: tuple[int, ...], rng: np.random.Generator, count: int = 12) -> list[tuple[int, ...]]:
    """Up to ``count`` entries of a tensor: all of a small one, else a random subset (always the first and last)."""
    size = int(np.prod(shape))
    flat = np.arange(size) if size <= count else np.unique([0, size - 1, *rng.choice(size, count - 2, replace=False)])
    return [tuple(int(i) for i in np.unravel_index(f, shape)) for f in flat]


def assert_gradients_match(reference: Reference, grads: dict[str, np.ndarray], seed: int = 0) -> int:
    """Every trained parameter's gradient equals finite differences (sampled entries); returns entries checked."""
    rng = np.random.default_rng(seed)
    assert set(grads) == set(reference.params), (sorted(grads), sorted(reference.params))
    checked = 0
    for name in sorted(grads):
        got = grads[name]
        indices = sample_indices(got.shape, rng)
        want = reference.gradient_entries(name, indices)
        got_entries = np.array([got[i] for i in indices], np.float64)
        # A gradient that is exactly 0 in float64 (a bias before BatchNormalization) is fp32 noise (~1e-8) in the
        # engine: the absolute floor, 1e-6, is still far below the O(1e-2..1) gradients of a wrong result.
        scale = max(np.abs(want).max(), 1e-2)
        np.testing.assert_allclose(got_entries, want, rtol=RTOL, atol=ATOL_OF_MAX * scale, err_msg=name)
        checked += len(indices)
    return checked
