"""Every schedule's lr sequence equals the reference formula, for 0, 1 and 10 warm-up updates.

The references are written here from their documented definitions, not from ortflow's code:

* Hugging Face transformers ``optimization.py``: ``get_constant_schedule_with_warmup``,
  ``get_linear_schedule_with_warmup``, ``get_cosine_schedule_with_warmup`` (num_cycles 0.5),
  ``get_cosine_with_min_lr_schedule_with_warmup`` (min_lr_rate), ``get_polynomial_decay_schedule_with_warmup``
  (lr_end, power): a ``LambdaLR`` whose multiplier at ``current_step`` is used by the optimizer step that follows
  ``current_step`` scheduler steps.
* torch ``torch.optim.lr_scheduler`` closed forms (its documentation): ``LinearLR`` factor
  ``start + (end - start) * min(t, total_iters) / total_iters``, ``CosineAnnealingLR``
  ``eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2``, ``PolynomialLR``
  ``base * (1 - min(t, total_iters) / total_iters) ** power``.
"""

import math

import pytest

from ortflow.config import LRScheduleConfig
from ortflow.trainer.lr_schedule import learning_rate

PEAK, TOTAL = 3e-4, 40


def hf_lambda(name: str, step: int, warmup: int, total: int, min_ratio: float, power: float) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant":
        return 1.0
    if name == "linear":  # HF's linear decays to 0; with a floor, the min_lr form of its cosine schedule
        factor = max(0.0, float(total - step) / float(max(1, total - warmup)))
        return factor * (1 - min_ratio) + min_ratio
    if name == "cosine":
        progress = float(step - warmup) / float(max(1, total - warmup))
        factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
        return factor * (1 - min_ratio) + min_ratio
    lr_end = PEAK * min_ratio  # polynomial
    if step > total:
        return lr_end / PEAK
    pct_remaining = 1 - (step - warmup) / (total - warmup)
    return ((PEAK - lr_end) * pct_remaining**power + lr_end) / PEAK


def schedule(name, warmup, min_ratio=0.0, power=1.0):
    """The schedule with the settings ``name`` uses (a floor under constant, a power under another than polynomial
    are refused; hf_lambda ignores them there)."""
    return LRScheduleConfig(name=name, warmup_steps=warmup, min_lr_ratio=0.0 if name == "constant" else min_ratio,
                            power=power if name == "polynomial" else 1.0)


@pytest.mark.parametrize("warmup", [0, 1, 10])
@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "polynomial"])
@pytest.mark.parametrize(("min_ratio", "power"), [(0.0, 1.0), (0.1, 2.0)])
def test_sequence_equals_hugging_face(name, warmup, min_ratio, power):
    got = [learning_rate(s, TOTAL, PEAK, schedule(name, warmup, min_ratio, power)) for s in range(TOTAL)]
    want = [PEAK * hf_lambda(name, s, warmup, TOTAL, min_ratio, power) for s in range(TOTAL)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    if warmup:
        assert got[0] == 0.0 and got[warmup] == pytest.approx(PEAK)  # HF: update 0 uses lr 0, update W the peak


@pytest.mark.parametrize("min_ratio", [0.0, 0.25])
def test_no_warmup_equals_torch_schedulers(min_ratio):
    t = range(TOTAL)
    eta_min = PEAK * min_ratio
    cosine = [eta_min + (PEAK - eta_min) * (1 + math.cos(math.pi * s / TOTAL)) / 2 for s in t]  # CosineAnnealingLR
    got = [learning_rate(s, TOTAL, PEAK, schedule("cosine", 0, min_ratio)) for s in t]
    assert got == pytest.approx(cosine, rel=1e-12)
    linear = [PEAK * (1.0 + (0.0 - 1.0) * min(s, TOTAL) / TOTAL) for s in t]  # LinearLR(1, 0, total_iters=T)
    assert [learning_rate(s, TOTAL, PEAK, schedule("linear", 0)) for s in t] == pytest.approx(linear, rel=1e-12)
    for power in (1.0, 2.0):
        poly = [PEAK * (1 - min(s, TOTAL) / TOTAL) ** power for s in t]  # PolynomialLR(total_iters=T, power)
        got = [learning_rate(s, TOTAL, PEAK, schedule("polynomial", 0, power=power)) for s in t]
        assert got == pytest.approx(poly, rel=1e-12)


@pytest.mark.parametrize("warmup", [0, 1, 10])
def test_training_runner_indexing_is_a_named_option(warmup):
    s = LRScheduleConfig(name="linear", warmup_steps=warmup, indexing="training_runner")
    got = [learning_rate(i, TOTAL, PEAK, s) for i in range(TOTAL)]
    want = [PEAK * (i + 1) / warmup if i < warmup else PEAK * (1 - (i - warmup) / max(1, TOTAL - warmup - 1))
            for i in range(TOTAL)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert got[-1] == pytest.approx(0.0, abs=1e-18)
