"""Every layout has every feature: dp 2, pp 2, tp 2, pp 2 x tp 2 and dp 2 x tp 2 under mpiexec, with the per-op
profiler, the step-time breakdown and TensorBoard histograms on; and profiling leaves the training bitwise unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from ortflow.trainer.profiling import top_operators
from ortflow.trainer.timing import PHASES, read_timing
from tests.support.parallel_runs import gpt_run, newest
from tests.support.runs import run_ranks_together

pytestmark = pytest.mark.mpi

LAYOUTS = {
    "dp2": {"num_ranks": 2},
    "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
    "tp2": {"num_ranks": 2, "horizontal_parallel_size": 2},
    "pp2tp2": {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2},
    "dp2tp2": {"num_ranks": 4, "horizontal_parallel_size": 2},  # replicas of a split model: replica 0's gather
}
UPDATES = 4  # parallel_runs.TRAIN: 8 steps of 2 micro-batches, a report after every update
PROFILED = [2, 3]


def _events(cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.tensorboard_dir), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_writes_timing_profile_and_histograms_and_trains_as_without_them(root, name):
    dist = LAYOUTS[name]
    plain = gpt_run(root, f"{name}-plain", distributed=dist)
    traced = gpt_run(root, f"{name}-traced", distributed=dist, train={"profile_steps": PROFILED},
                     tensorboard={"histogram_names": ["*"]})
    for out in run_ranks_together(plain, traced, timeout=400):  # independent jobs: at once
        assert out.returncode == 0, out.stdout[-3000:]

    # The step-time breakdown: timing.json and the time/* scalars of every report.
    timing = read_timing(traced.output_dir)
    assert set(timing["shares"]) == set(PHASES) and abs(sum(timing["shares"].values()) - 1) < 1e-9
    seconds = timing["seconds"]
    assert seconds["forward_backward"] > 0 and seconds["update"] > 0 and seconds["eval"] > 0
    assert seconds["checkpoint"] > 0 and len(timing["windows"]) == UPDATES
    events = _events(traced)
    shares = {p: [e.value for e in events.Scalars(f"time/{p}")] for p in PHASES}
    assert all(len(shares[p]) == UPDATES for p in PHASES)
    for i in range(UPDATES):
        assert abs(sum(shares[p][i] for p in PHASES) - 1) < 1e-5

    # The per-op profile: a trace from every rank, rank 0's table, the training calls of the profiled updates.
    folder = traced.output_dir / "profile"
    for rank in range(dist["num_ranks"]):
        rows = top_operators(folder / f"rank-{rank}.json")
        assert rows and sum(r["calls"] for r in rows) > 0, rank
        meta = json.loads((folder / f"rank-{rank}.meta.json").read_text())
        assert meta["steps"] == PROFILED and meta["calls"] >= 2 * 2, meta  # 2 updates x 2 micro-batches at least
    assert "| op type | calls |" in (folder / "top_ops.md").read_text()
    assert not list(folder.glob(".rank-*"))  # every part's trace was merged into its rank's file

    # Histograms of the whole model (stages gathered, slices merged) on rank 0, at every report.
    final = read_params(newest(traced))  # the last update's parameters, every stage's slices merged
    tags = set(events.Tags()["histograms"])
    assert tags == {f"params/{n}" for n in final}
    for param, value in final.items():
        steps = events.Histograms(f"params/{param}")
        assert [h.step for h in steps] == list(range(1, UPDATES + 1)), param
        last = steps[-1].histogram_value
        assert last.num == value.size and last.min == float(value.min()) and last.max == float(value.max()), param
        assert last.sum == pytest.approx(float(value.sum()), rel=1e-5, abs=1e-6), param

    # The profiling sessions share the parameters and hand their gradients over: the same bits as without them.
    reference = read_params(newest(plain))
    assert sorted(reference) == sorted(final)
    for param, value in reference.items():
        np.testing.assert_array_equal(final[param], value, err_msg=param)
