"""A global batch means the same on any layout; the step-time breakdown; per-op profiling (ranks under mpiexec)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ortflow.launch.layout import Host, launch_layout
from ortflow.launch.local import launch
from ortflow.trainer.profiling import top_operators
from ortflow.trainer.timing import LABELS, PHASES, read_timing
from tests.faults.procs import ortflow_here
from tests.support.fixed_batch_mlp import build_fixed_batch_classifier
from tests.support.runs import final_parameters, make_run, run_ranks

pytestmark = pytest.mark.mpi
GLOBAL = {"batch_size": 4, "global_batch_size": 16, "num_train_steps": 6, "display_loss_steps": 1}


def _losses(cfg) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.tensorboard_dir))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def _run(tmp_path, name, ranks, **train):
    model = tmp_path / "fixed.onnx"
    if not model.exists():
        build_fixed_batch_classifier(model, batch=4)
    return make_run(tmp_path, name, model=model, distributed={"num_ranks": ranks}, train={**GLOBAL, **train},
                    data={"columns": {"x": "features"}}, checkpoint={"period": 0})  # fmt: skip


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """A finished 2-rank run of the global batch (an eval every 3 updates): one layout of the trajectory test, the run
    whose step-time breakdown is checked, and the unprofiled reference of the profiling test."""
    cfg = _run(tmp_path_factory.mktemp("layout"), "two", 2, evaluation_period=3)
    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    OUTPUTS[cfg.name] = out.stdout
    return cfg


#: The ranks' output of the module's runs, by run name.
OUTPUTS: dict[str, str] = {}


def test_every_rank_logs_its_peak_resident_memory_at_its_end(two):
    peaks = dict(re.findall(r"rank (\d+) peak resident memory ([0-9.]+) MiB", OUTPUTS[two.name]))
    assert sorted(peaks) == ["0", "1"]
    assert all(50 < float(mib) < 4096 for mib in peaks.values())  # a Python process with the engine loaded


def test_fixed_global_batch_gives_the_same_trajectory_on_every_layout(two):
    root = two.output_dir.parent  # the same model and data files as the 2-rank run
    one, auto = _run(root, "one", 1), _run(root, "auto", "auto")
    assert run_ranks(one).returncode == 0
    # auto on a (pretend) 4-core host: 4 ranks x 1 micro-batch of the model's fixed 4 rows, started like `ortflow train`
    layout, plan = launch_layout(auto, auto.output_dir, Host(4, 16 * 2**30))
    assert (layout.ranks, plan.batch_size, plan.accumulation) == (4, 4, 1)
    lines = []
    assert launch(auto.output_dir, layout.ranks, threads=1, on_line=lines.append).ok, "\n".join(lines)
    reference = _losses(one)
    assert len(reference) == 6 and reference[-1] < reference[0]  # it trained: 6 updates of 16 samples
    for run in (two, auto):
        # Same samples per update, same order: only the summation order of fp32 partial gradients differs.
        np.testing.assert_allclose(_losses(run), reference, rtol=2e-6, err_msg=run.name)
        for name, value in final_parameters(one).items():
            np.testing.assert_allclose(final_parameters(run)[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_global_batch_the_ranks_cannot_split_is_refused_naming_valid_choices(tmp_path):
    cfg = _run(tmp_path, "bad", 3, global_batch_size=18)  # 18 over 3 ranks: 6 rows each, but the model fixes 4
    out = run_ranks(cfg)
    assert out.returncode != 0
    assert "train.global_batch_size 18 cannot be split over 3 rank(s) and the model's fixed batch dim 4" in out.stdout
    assert "use a global batch of 12 or 24" in out.stdout


def test_breakdown_reports_each_phase_in_progress_tensorboard_and_timing_json(two):
    cfg = two
    record = json.loads((cfg.output_dir / "progress.json").read_text())
    # The last window's phases above 0.05%, largest first (which phases make it depends on the machine's load: the
    # final window holds an eval that can take nearly all of it).
    shown = re.findall(r"(\S+) ([0-9.]+)%", record["time"])
    assert shown and " ".join(f"{label} {share}%" for label, share in shown) == record["time"]
    assert {label for label, _ in shown} <= set(LABELS.values()) and "eval" in dict(shown)
    percents = [float(share) for _, share in shown]
    assert percents == sorted(percents, reverse=True) and 99.4 <= sum(percents) <= 100.5
    timing = read_timing(cfg.output_dir)
    assert set(timing["shares"]) == set(PHASES)
    assert abs(sum(timing["shares"].values()) - 1) < 1e-9
    seconds = timing["seconds"]
    assert seconds["forward_backward"] > 0 and seconds["eval"] > 0 and seconds["comm"] > 0
    assert seconds["checkpoint"] > 0  # the final checkpoint (period 0 still saves the last update)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.tensorboard_dir))
    events.Reload()
    shares = {p: [e.value for e in events.Scalars(f"time/{p}")] for p in PHASES}
    assert len(shares["forward_backward"]) == 6
    for step in range(6):
        assert abs(sum(shares[p][step] for p in PHASES) - 1) < 1e-5


def test_profiled_updates_write_a_trace_per_rank_and_leave_training_unchanged(two):
    plain = two
    profiled = _run(two.output_dir.parent, "profiled", 2, profile_steps=[2, 4], evaluation_period=3)
    out = run_ranks(profiled)
    assert out.returncode == 0, out.stdout
    folder = profiled.output_dir / "profile"
    assert (folder / "rank-0.json").exists() and (folder / "rank-1.json").exists()
    rows = top_operators(folder / "rank-0.json")
    ops = {r["op_type"]: r for r in rows}
    assert {"Gemm", "FusedGemm", "ReluGrad"} <= set(ops)  # forward and backward kernels of the profiled updates
    assert ops["ReluGrad"]["calls"] == 3 * 2  # 3 updates x 2 micro-batches of this rank (16 = 2 ranks x 4 rows x 2)
    meta = json.loads((folder / "rank-0.meta.json").read_text())
    assert meta["calls"] == 6 and meta["steps"] == [2, 4]
    assert "| op type | calls |" in (folder / "top_ops.md").read_text()
    # The profiling session shares the parameters and hands its gradients over: bit-identical training.
    for name, value in final_parameters(plain).items():
        np.testing.assert_array_equal(final_parameters(profiled)[name], value, err_msg=name)


def test_tune_times_candidates_and_auto_starts_the_recorded_winner(tmp_path):
    from ortflow.launch.layout import read_tuned
    from ortflow.launch.tune import tune

    cfg = _run(tmp_path, "tuned", "auto")
    host = Host(2, 16 * 2**30)
    path = tune(cfg, host, updates=2, warmup=1)
    record = json.loads(path.read_text())
    assert [(c["ranks"], c["threads"]) for c in record["candidates"]] == [(2, 1), (1, 2)]
    assert all(c["samples_per_s"] > 0 and c["samples_per_update"] == 16 for c in record["candidates"])
    best = max(record["candidates"], key=lambda c: c["samples_per_s"])
    assert read_tuned(cfg.output_dir, host).pair == (best["ranks"], best["threads"])
    assert launch_layout(cfg, cfg.output_dir, host)[0].pair == (best["ranks"], best["threads"])
    assert not (cfg.output_dir / "checkpoints").exists()  # tuning trains in memory only


def test_cli_train_np_auto_prints_the_layout_and_profiles(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    cfg = _run(tmp_path, "cli", 1)
    ortflow = str(Path(sys.executable).parent / "ortflow")
    out = subprocess.run([ortflow, "train", str(cfg.output_dir), "--np", "auto", "--threads", "1", "--profile", "2:2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    cores = len(__import__("os").sched_getaffinity(0))
    ranks = max(r for r in range(1, cores + 1) if 16 % (r * 4) == 0)
    assert f"layout: {ranks} rank(s) x 1 thread(s) (auto:" in out.stderr
    assert (cfg.output_dir / "profile" / "rank-0.json").exists()
    # A refusal (what it says, in this process), on a run not yet trained: a finished run is only reported complete.
    fresh = _run(tmp_path, "cli-fresh", 1)
    bad = ortflow_here("train", str(fresh.output_dir), "--np", "3")
    assert bad.returncode == 1
    assert "cannot be split over 3 rank(s) and the model's fixed batch dim 4" in bad.stdout
