"""The per-phase timer with a passed-in clock."""

from __future__ import annotations

import pytest

from ortflow.trainer.timing import PHASES, PhaseTimer, read_timing


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_laps_charge_the_time_since_the_previous_lap():
    clock = Clock()
    timer = PhaseTimer(clock)
    for phase, seconds in (("data", 1.0), ("forward_backward", 6.0), ("update", 1.0), ("eval", 2.0)):
        clock.now += seconds
        timer.lap(phase)
    shares = timer.shares()
    assert shares["forward_backward"] == pytest.approx(0.6) and shares["eval"] == pytest.approx(0.2)
    assert timer.training_seconds() == pytest.approx(8.0)  # eval and checkpoint do not count for throughput
    assert timer.describe().startswith("fwd+bwd 60.0% eval 20.0%")
    assert set(timer.scalars()) == {f"time/{p}" for p in PHASES}


def test_exchange_splits_transfer_from_waiting_for_the_slowest_rank():
    clock = Clock()
    timer = PhaseTimer(clock)
    for spent in (0.5, 0.1, 0.3):  # the fastest exchange (0.1 s) is taken as the bare transfer
        clock.now += spent
        timer.lap_exchange()
    assert timer.total["comm"] == pytest.approx(0.5 + 0.1 + 0.1)  # the running minimum at each exchange
    assert timer.total["comm"] + timer.total["comm_wait"] == pytest.approx(0.9)
    assert timer.total["comm_wait"] == pytest.approx(0.2)  # the third exchange waited 0.2 s beyond the bare 0.1 s


def test_windows_reset_but_the_run_total_is_kept(tmp_path):
    clock = Clock()
    timer = PhaseTimer(clock)
    clock.now += 2.0
    timer.lap("forward_backward")
    timer.new_window()
    clock.now += 1.0
    timer.lap("checkpoint")
    assert timer.shares()["checkpoint"] == 1.0
    timer.write_summary(tmp_path)
    summary = read_timing(tmp_path)
    assert summary["wall_s"] == pytest.approx(3.0)
    assert summary["shares"]["forward_backward"] == pytest.approx(2 / 3)
