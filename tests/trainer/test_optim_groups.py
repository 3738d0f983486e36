"""Parameter groups (optimizer.groups): AdamW and Lamb with two groups against float64 references, and the checks."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import GroupedUpdate, build_update, group_problems, whole_segments
from tests.trainer.test_optim_rules import NAMES, SIZES, STEPS, assert_fp32_close, lr_at, run_rule

# Two groups as users write them: biases at twice the rate without decay; the rest with the section's settings.
GROUPS = ({"params": ["*bias"], "lr_scale": 2.0, "weight_decay": 0.0, "betas": [0.8, 0.95]},)
IN_GROUP = [n.endswith("bias") for n in NAMES]


def test_adamw_two_groups_match_float64_reference_of_torch_adamw_param_groups():
    opt = OptimizerConfig(name="adamw", beta1=0.9, beta2=0.99, epsilon=1e-6, weight_decay=0.1, groups=GROUPS)
    init, grads, ours = run_rule(opt)
    params = [p.astype(np.float64) for p in init]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for k in range(STEPS):  # torch.optim.AdamW with two param_groups: each group's lr, betas, weight_decay
        t = k + 1
        for i, p in enumerate(params):
            lr, (b1, b2), wd = (2 * lr_at(k), (0.8, 0.95), 0.0) if IN_GROUP[i] else (lr_at(k), (0.9, 0.99), 0.1)
            g = grads[k][i].astype(np.float64)
            p *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            p -= lr / (1 - b1**t) * m[i] / (np.sqrt(v[i]) / np.sqrt(1 - b2**t) + 1e-6)
    assert_fp32_close(ours, params)
    # Without the groups the biases move measurably differently (so the check above can fail).
    _, _, plain = run_rule(opt.model_copy(update={"groups": ()}))
    assert float(np.abs(plain[1] - params[1]).max()) > 1e-3


def test_lamb_two_groups_match_float64_reference_of_the_paper():
    b1, b2, eps, wd = 0.9, 0.999, 1e-6, 0.01
    opt = OptimizerConfig(name="lamb", beta1=b1, beta2=b2, epsilon=eps, weight_decay=wd, groups=GROUPS)
    init, grads, ours = run_rule(opt, seed=3)
    params = [p.astype(np.float64) for p in init]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for k in range(STEPS):
        t = k + 1
        for i, p in enumerate(params):
            lr, (c1, c2), d = (2 * lr_at(k), (0.8, 0.95), 0.0) if IN_GROUP[i] else (lr_at(k), (b1, b2), wd)
            g = grads[k][i].astype(np.float64)
            m[i] = c1 * m[i] + (1 - c1) * g
            v[i] = c2 * v[i] + (1 - c2) * g * g
            r = (m[i] / (1 - c1**t)) / (np.sqrt(v[i] / (1 - c2**t)) + eps) + d * p
            wn, rn = np.linalg.norm(p), np.linalg.norm(r)
            p -= lr * (wn / rn if wn > 0 and rn > 0 else 1.0) * r
    assert_fp32_close(ours, params)


def test_absolute_group_rate_is_scheduled_like_the_peak():
    a = OptimizerConfig(learning_rate=1e-2, groups=({"params": ["h.*"], "learning_rate": 5e-3},))
    b = OptimizerConfig(learning_rate=1e-2, groups=({"params": ["h.*"], "lr_scale": 0.5},))
    assert all(np.array_equal(x, y) for x, y in zip(run_rule(a)[2], run_rule(b)[2], strict=True))


def test_first_matching_group_wins_and_the_state_reads_back_per_parameter():
    opt = OptimizerConfig(groups=({"params": ["*bias"], "lr_scale": 3.0}, {"params": ["h.*"], "lr_scale": 0.5}))
    params = [np.ones(s, dtype=np.float32) for s in SIZES]
    update = build_update(opt, whole_segments(NAMES, SIZES), params)
    assert isinstance(update, GroupedUpdate)
    assert [[NAMES[i] for i in idx] for idx in update.members] == [["h.bias"], ["h.weight"],
                                                                    ["big.weight", "norm.weight"]]
    update.step([np.full(s, 0.5, dtype=np.float32) for s in SIZES], 1e-2)
    for i, name in enumerate(NAMES):  # state views address each parameter's own moments
        m, _ = update.state_views(i)
        assert m.shape == (SIZES[i],) and np.allclose(m, 0.05), name
    moved = [1.0 - float(p[0]) for p in params]  # Adam's first step moves by lr * scale (sign of g)
    assert moved == pytest.approx([0.5e-2, 3e-2, 1e-2, 1e-2], rel=1e-4)
    assert update.step_count == 1
    update.step_count = 7
    assert all(part.step_count == 7 for part in update.parts)


def test_group_problems_list_unmatched_and_shadowed_patterns():
    opt = OptimizerConfig(groups=({"params": ["*bias"]}, {"params": ["h.bias", "h.*", "enc.*"]}))
    problems = group_problems(NAMES, opt)
    assert len(problems) == 2
    assert "optimizer.groups[1].params: 'h.bias' matches only parameters of optimizer.groups[0]" in problems[0]
    assert "optimizer.groups[1].params: 'enc.*' matches no trainable parameter" in problems[1]


def test_config_refuses_both_rates_and_betas_for_sgd():
    with pytest.raises(ValueError, match="lr_scale or learning_rate, not both"):
        OptimizerConfig(groups=({"params": ["*"], "lr_scale": 2.0, "learning_rate": 1e-3},))
    with pytest.raises(ValueError, match="betas apply to adamw and lamb"):
        OptimizerConfig(name="sgd", groups=({"params": ["*"], "betas": [0.9, 0.99]},))


def test_sgd_two_groups_match_float64_reference_of_torch_sgd_param_groups():
    opt = OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.01,
                          groups=({"params": ["*bias"], "lr_scale": 2.0, "weight_decay": 0.0},))
    init, grads, ours = run_rule(opt, seed=1)
    params = [p.astype(np.float64) for p in init]
    bufs = [None] * len(params)
    for k in range(STEPS):
        for i, p in enumerate(params):
            lr, wd = (2 * lr_at(k), 0.0) if IN_GROUP[i] else (lr_at(k), 0.01)
            d = grads[k][i].astype(np.float64) + wd * p
            bufs[i] = d.copy() if bufs[i] is None else 0.9 * bufs[i] + d
            p -= lr * bufs[i]
    assert_fp32_close(ours, params)
