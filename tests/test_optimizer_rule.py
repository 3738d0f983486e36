"""The AdamW update ortflow builds is the rule the README and the config describe (the engine's adam_mode=1)."""

from __future__ import annotations

import numpy as np

from ortflow.config import config_from_dict
from ortflow.engine import api
from ortflow.examples.mlp import build_mlp
from ortflow.trainer.artifacts import build_artifacts

BETA1, BETA2, EPS, DECAY, LR = 0.9, 0.99, 1e-3, 0.1, 0.05


def documented(p, m, v, g, t, torch_rule=False):
    """One update in float64: the README's rule, or torch.optim.AdamW's (for contrast)."""
    m = BETA1 * m + (1 - BETA1) * g
    v = BETA2 * v + (1 - BETA2) * g * g
    if torch_rule:
        p = p * (1 - LR * DECAY)
        p = p - LR / (1 - BETA1**t) * m / (np.sqrt(v / (1 - BETA2**t)) + EPS)
    else:
        p = p - LR * np.sqrt(1 - BETA2**t) / (1 - BETA1**t) * m / (np.sqrt(v) + EPS)
        p = p - LR * DECAY * p
    return p, m, v


def test_adamw_matches_the_documented_rule_and_not_torchs(tmp_path):
    model = build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=6, num_classes=3, seed=0)
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(model)}, "data": {"train": "x.npz"},
        "train": {"batch_size": 8, "num_train_steps": 1},
        "optimizer": {"beta1": BETA1, "beta2": BETA2, "epsilon": EPS, "weight_decay": DECAY},
    })  # fmt: skip
    built = build_artifacts(cfg, tmp_path / "artifacts")
    state = api.CheckpointState.load_checkpoint(str(built.artifacts_dir / "checkpoint"))
    module = api.Module(str(built.artifacts_dir / "training_model.onnx"), state,
                        str(built.artifacts_dir / "eval_model.onnx"))  # fmt: skip
    optimizer = api.Optimizer(str(built.artifacts_dir / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    names = list(built.trainable)
    ours = {n: (np.array(state.parameters[n].data, np.float64), 0.0, 0.0) for n in names}
    torch = dict(ours)
    rng = np.random.default_rng(0)
    module.train()
    for t in range(1, 6):
        x = rng.standard_normal((8, 4)).astype(np.float32)
        module(x, rng.integers(0, 3, 8).astype(np.int64))
        for n in names:
            g = np.array(state.parameters[n].grad, np.float64)
            ours[n] = documented(*ours[n], g, t)
            torch[n] = documented(*torch[n], g, t, torch_rule=True)
        optimizer.step()
        module.lazy_reset_grad()
    for n in names:
        got = np.array(state.parameters[n].data, np.float64)
        scale = np.abs(got).max()
        assert np.abs(got - ours[n][0]).max() <= 1e-5 * scale, n  # float32 engine vs float64 rule: rounding only
    gap = max(np.abs(np.array(state.parameters[n].data) - torch[n][0]).max() for n in names)
    assert gap > 1e-3  # torch's placement of epsilon and decay gives visibly different weights
