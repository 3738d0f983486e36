"""LR schedules: the TrainingRunner indexing at the end of warm-up and at the last step (test_lr_reference.py checks
the default, Hugging Face's, against reference formulas)."""

import math

import pytest

from ortflow.config import LRScheduleConfig
from ortflow.trainer.lr_schedule import learning_rate

PEAK, TOTAL, WARMUP, FLOOR = 1e-3, 100, 10, 0.1


def schedule(name: str, **kw) -> LRScheduleConfig:
    floor = 0.0 if name == "constant" else FLOOR  # a floor under constant is refused: it has none
    return LRScheduleConfig(name=name, warmup_steps=WARMUP, min_lr_ratio=floor, indexing="training_runner", **kw)


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "polynomial"])
def test_warmup_is_linear_and_ends_at_peak(name):
    s = schedule(name)
    assert learning_rate(0, TOTAL, PEAK, s) == pytest.approx(PEAK / WARMUP)
    assert learning_rate(4, TOTAL, PEAK, s) == pytest.approx(PEAK * 5 / WARMUP)
    assert learning_rate(WARMUP - 1, TOTAL, PEAK, s) == pytest.approx(PEAK)  # last warm-up step reaches the peak
    assert learning_rate(WARMUP, TOTAL, PEAK, s) == pytest.approx(PEAK)  # first decay step starts at the peak


@pytest.mark.parametrize(
    ("name", "expected_last"),
    [("constant", PEAK), ("linear", PEAK * FLOOR), ("cosine", PEAK * FLOOR), ("polynomial", PEAK * FLOOR)],
)
def test_last_step(name, expected_last):
    power = {"power": 2.0} if name == "polynomial" else {}  # the others refuse a power
    assert learning_rate(TOTAL - 1, TOTAL, PEAK, schedule(name, **power)) == pytest.approx(expected_last)


def test_midpoints_follow_the_formulas():
    mid = WARMUP + (TOTAL - WARMUP - 1) // 2
    p = (mid - WARMUP) / (TOTAL - WARMUP - 1)
    floor = PEAK * FLOOR
    assert learning_rate(mid, TOTAL, PEAK, schedule("linear")) == pytest.approx(floor + (PEAK - floor) * (1 - p))
    cosine = floor + (PEAK - floor) * 0.5 * (1 + math.cos(math.pi * p))
    assert learning_rate(mid, TOTAL, PEAK, schedule("cosine")) == pytest.approx(cosine)
    poly = floor + (PEAK - floor) * (1 - p) ** 3.0
    assert learning_rate(mid, TOTAL, PEAK, schedule("polynomial", power=3.0)) == pytest.approx(poly)


def test_no_warmup_starts_at_peak():
    assert learning_rate(0, TOTAL, PEAK, LRScheduleConfig(name="cosine")) == pytest.approx(PEAK)


def test_step_outside_run_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        learning_rate(TOTAL, TOTAL, PEAK, schedule("linear"))
