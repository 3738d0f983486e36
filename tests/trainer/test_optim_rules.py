"""The update rules against float64 numpy references and, for rule ``engine``, against the engine's own AdamW graph."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import Update, build_rule, build_update, whole_segments
from tests.support.tied_lm import TRAINABLE, build_tied_lm, lm_batch

SIZES = (700, 33, 20000, 1)  # a tensor larger than a chunk, odd sizes, a scalar
NAMES = ("h.weight", "h.bias", "big.weight", "norm.weight")
STEPS = 100


def lr_at(step: int) -> float:
    return 1e-2 * (0.5 + 0.5 * np.cos(step / STEPS))  # a varying rate, as a schedule gives


def run_rule(opt: OptimizerConfig, seed: int = 0):
    """STEPS updates of the rule in float32 on random gradients; returns (initial params, grads per step, final)."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    grads = [[(rng.standard_normal(s) * (1 + k % 3)).astype(np.float32) for s in SIZES] for k in range(STEPS)]
    params = [p.copy() for p in init]
    update = build_update(opt, whole_segments(NAMES, SIZES), params)
    for k in range(STEPS):
        update.step([g.copy() for g in grads[k]], lr_at(k))
    return init, grads, params


def assert_fp32_close(ours: list[np.ndarray], ref: list[np.ndarray]) -> None:
    # fp32 rounding: every element is within a few ulp of float32 at the reference's magnitude. 100 steps of
    # float32 arithmetic accumulate at most ~1e-5 relative to the parameter scale (rounding ~6e-8 per operation,
    # ~15 operations per step, errors partly cancelling); a wrong rule (epsilon placement, bias correction, decay
    # order) differs by 1e-3 or more.
    for o, r in zip(ours, ref, strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(o, r, rtol=0, atol=2e-5 * scale)


def torch_adamw_reference(init, grads, b1, b2, eps, wd, decay):
    params = [p.astype(np.float64) for p in init]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for k in range(STEPS):
        t, lr = k + 1, lr_at(k)
        for i, p in enumerate(params):
            g = grads[k][i].astype(np.float64)
            if decay[i]:
                p *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = np.sqrt(v[i]) / np.sqrt(1 - b2**t) + eps
            p -= lr / (1 - b1**t) * m[i] / denom
    return params


def test_adamw_torch_rule_matches_float64_reference_of_torch_adamw():
    opt = OptimizerConfig(name="adamw", beta1=0.9, beta2=0.99, epsilon=1e-6, weight_decay=0.1,
                          no_weight_decay=("*bias", "norm.*"))
    init, grads, ours = run_rule(opt)
    ref = torch_adamw_reference(init, grads, 0.9, 0.99, 1e-6, 0.1, [True, False, True, False])
    assert_fp32_close(ours, ref)
    # The engine's epsilon placement is measurably different on the same gradients (so the check above can fail).
    _, _, engine = run_rule(opt.model_copy(update={"rule": "engine"}))
    assert max(float(np.abs(a - b).max()) for a, b in zip(engine, ref, strict=True)) > 1e-4


def test_sgd_momentum_nesterov_matches_float64_reference():
    for nesterov in (False, True):
        opt = OptimizerConfig(name="sgd", momentum=0.9, nesterov=nesterov, dampening=0.0, weight_decay=0.01)
        init, grads, ours = run_rule(opt, seed=1)
        params = [p.astype(np.float64) for p in init]
        bufs = [None] * len(params)
        for k in range(STEPS):
            for i, p in enumerate(params):
                d = grads[k][i].astype(np.float64) + 0.01 * p
                bufs[i] = d.copy() if bufs[i] is None else 0.9 * bufs[i] + d
                d = d + 0.9 * bufs[i] if nesterov else bufs[i]
                p -= lr_at(k) * d
        assert_fp32_close(ours, params)


def test_sgd_dampening_matches_float64_reference():
    opt = OptimizerConfig(name="sgd", momentum=0.5, dampening=0.3)
    init, grads, ours = run_rule(opt, seed=2)
    params = [p.astype(np.float64) for p in init]
    bufs = [None] * len(params)
    for k in range(STEPS):
        for i, p in enumerate(params):
            d = grads[k][i].astype(np.float64)
            bufs[i] = d.copy() if bufs[i] is None else 0.5 * bufs[i] + 0.7 * d
            p -= lr_at(k) * bufs[i]
    assert_fp32_close(ours, params)


@pytest.mark.parametrize("ratio_min, ratio_max", [(0.0, None), (0.5, 2.0)])
def test_lamb_matches_float64_reference_of_the_paper(ratio_min, ratio_max):
    b1, b2, eps, wd = 0.9, 0.999, 1e-6, 0.01
    opt = OptimizerConfig(name="lamb", beta1=b1, beta2=b2, epsilon=eps, weight_decay=wd, ratio_min=ratio_min,
                          ratio_max=ratio_max, no_weight_decay=("*.bias",))
    init, grads, ours = run_rule(opt, seed=3)
    params = [p.astype(np.float64) for p in init]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    clipped = 0
    for k in range(STEPS):
        t = k + 1
        for i, p in enumerate(params):
            g = grads[k][i].astype(np.float64)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + eps) + (0 if NAMES[i] == "h.bias" else wd) * p
            wn, rn = np.linalg.norm(p), np.linalg.norm(r)
            q = wn / rn if wn > 0 and rn > 0 else 1.0
            bounded = min(max(q, ratio_min), ratio_max if ratio_max is not None else np.inf)
            clipped += bounded != q
            p -= lr_at(k) * bounded * r
    assert_fp32_close(ours, params)
    if ratio_max is not None:
        assert clipped > 0  # the bounds were exercised


def _engine_adamw_artifacts(folder: Path, eps: float, wd: float) -> Path:
    """The engine's AdamW graph for the tied LM, built as ortflow built it before owning the update."""
    from ortflow.engine import artifacts, onnxblock

    model = onnx.load(str(build_tied_lm(folder / "lm.onnx")))
    previous = Path.cwd()
    os.chdir(folder)
    try:
        artifacts.generate_artifacts(
            model, requires_grad=list(TRAINABLE), frozen_params=[], loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=eps, weight_decay=wd),
            artifact_directory=str(folder),
        )
    finally:
        os.chdir(previous)
        with contextlib.suppress(FileNotFoundError):
            (folder / "temp.onnx").unlink()
    return folder


def test_adamw_engine_rule_reproduces_the_engine_graph_bit_for_bit(tmp_path):
    from ortflow.engine import api

    art = _engine_adamw_artifacts(tmp_path, eps=1e-8, wd=0.05)
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
    module.train()
    ours = [np.array(state.parameters[n].data, copy=True).reshape(-1) for n in TRAINABLE]
    opt = OptimizerConfig(name="adamw", rule="engine", epsilon=1e-8, weight_decay=0.05)
    update = build_update(opt, whole_segments(TRAINABLE, [p.size for p in ours]), ours)
    rng = np.random.default_rng(0)
    for k in range(30):
        lr = 0.05 * (1 - k / 40)
        optimizer.set_learning_rate(lr)
        module(*lm_batch(rng))
        grads = [np.array(state.parameters[n].grad, copy=True).reshape(-1) for n in TRAINABLE]
        optimizer.step()
        module.lazy_reset_grad()
        update.step(grads, lr)
        for name, mine in zip(TRAINABLE, ours, strict=True):
            engine = state.parameters[name].data.reshape(-1)
            assert np.array_equal(mine, engine), f"step {k + 1}: {name} differs by {np.abs(mine - engine).max()}"
    # The torch rule on the same run would not be bit-identical (the check is sharp).
    assert update.step_count == 30


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_threads_give_the_same_bits_as_one_thread(name):
    opt = OptimizerConfig(name=name, weight_decay=0.01, momentum=0.9 if name == "sgd" else 0.0)
    rng = np.random.default_rng(4)
    init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SIZES] for _ in range(5)]
    results = []
    for threads in (1, 3):
        params = [p.copy() for p in init]
        # Many chunks (512 elements), so the threads really share the work.
        update = Update(build_rule(opt), whole_segments(NAMES, SIZES), params, [True] * 4, chunk=512, threads=threads)
        assert len(update._plan) == threads
        for g in grads:
            update.step([x.copy() for x in g], 1e-2)
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)
