"""The trainer for real: ranks under ``mpiexec -n 2`` (the bundled MPICH), tiny MLP, tiny data."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ortflow.checkpoints import list_complete, verify
from ortflow.launch.local import launch
from ortflow.trainer.metrics import read_progress
from tests.support.runs import final_parameters, kill_and_resume, make_run, run_ranks, run_ranks_together

pytestmark = pytest.mark.mpi
FAULT = str(Path(__file__).with_name("fault_rank.py"))


def digests(output: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> parameter sha256, from the ranks' log lines."""
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The runs of :func:`two` and :func:`one`, trained at once (independent jobs)."""
    root = tmp_path_factory.mktemp("two")
    two = make_run(root, "two", distributed={"num_ranks": 2}, train={"batch_size": 4, "evaluation_period": 5},
                   checkpoint={"period": 2, "max_num_checkpoints": 3})
    one = make_run(root, "one", distributed={"num_ranks": 1}, train={"batch_size": 8})
    outs = run_ranks_together(two, one)
    for out in outs:
        assert out.returncode == 0, out.stdout
    return (two, outs[0]), one


@pytest.fixture(scope="module")
def two(finished):
    """One finished 2-rank run (batch 4 per rank, 20 updates, eval every 5, a checkpoint every 2 keeping 3), shared by
    the replica test, the retention test and the TensorBoard test; returns its config and output."""
    return finished[0]


@pytest.fixture(scope="module")
def one(finished):
    """One finished 1-rank run on batch 8 (the 2-rank run's two batches of 4 concatenated), 20 updates: the reference
    of the replica test and of the accumulation test."""
    return finished[1]


def test_two_ranks_match_one_rank_on_the_concatenated_batch(two, one):
    two, out_two = two
    p2, p1 = final_parameters(two), final_parameters(one)
    assert p2.keys() == p1.keys()
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert any(not np.array_equal(p1[n], final_parameters_initial(one)[n]) for n in p1)  # it really trained
    # Both ranks logged the same parameter digest at every checkpoint: bitwise identical replicas.
    seen = digests(out_two.stdout)
    steps = {step for _, step in seen}
    assert steps == set(range(2, 21, 2))  # every checkpoint, the deleted ones included
    for step in steps:
        assert seen[(0, step)] == seen[(1, step)]


def final_parameters_initial(cfg):
    from ortflow.engine import api

    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    return {name: np.array(p.data) for name, p in state.parameters if p.requires_grad}


def test_accumulation_equals_one_step_on_a_larger_batch(one):
    # 2 micro-batches of 4 per update against the 1-rank run's one batch of 8, 20 updates each.
    accumulated = make_run(one.output_dir.parent, "acc", distributed={"num_ranks": 1},
                           train={"batch_size": 4, "gradient_accumulation_steps": 2, "num_train_steps": 40})
    assert run_ranks(accumulated).returncode == 0
    pa, pl = final_parameters(accumulated), final_parameters(one)
    for name in pl:
        np.testing.assert_allclose(pa[name], pl[name], rtol=1e-5, atol=1e-7, err_msg=name)
    meta = list_complete(accumulated.checkpoints_dir)[-1].meta
    assert meta["step"] == 20 and meta["global_cursor"] == 160  # 20 updates x 2 micro-batches x 4 samples


def test_retention_keeps_the_newest_complete_checkpoints(two):
    cfg, _ = two
    names = sorted(p.name for p in cfg.checkpoints_dir.iterdir())
    assert names == ["step-00000016", "step-00000018", "step-00000020"]  # no temporary folders either
    for info in list_complete(cfg.checkpoints_dir):
        verify(info.path)


def test_the_final_checkpoint_is_written_once_and_records_the_final_eval_loss(two):
    cfg, out = two
    final = verify(cfg.checkpoints_dir / "step-00000020")
    assert final.eval_loss is not None and final.train_loss is not None  # meta.json amended after the evaluation
    assert len(re.findall(r"saved checkpoint \S*step-00000020", out.stdout)) == 1, out.stdout[-3000:]


def test_killed_job_resumes_to_bitwise_identical_parameters(tmp_path):
    settings = dict(distributed={"num_ranks": 2}, train={"num_train_steps": 300, "batch_size": 8},
                    checkpoint={"period": 25, "max_num_checkpoints": 2},
                    lr_schedule={"name": "cosine", "warmup_steps": 50})
    steady = make_run(tmp_path, "steady", **settings)
    killed = make_run(tmp_path, "killed", **settings)
    kill_and_resume(killed, min_step=60, end_step=300, beside=steady)
    a, b = final_parameters(steady), final_parameters(killed)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert list_complete(killed.checkpoints_dir)[-1].meta["global_cursor"] == 300 * 2 * 8


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path):
    cfg = make_run(tmp_path, "fail", distributed={"num_ranks": 2})
    started = time.monotonic()
    out = run_ranks(cfg, FAULT, "raise", timeout=60)
    assert out.returncode != 0
    assert "injected failure on rank 1" in out.stdout
    assert time.monotonic() - started < 30  # prompt: no rank waits for the collective timeout


def test_a_hung_rank_is_named_when_the_collective_times_out(tmp_path):
    cfg = make_run(tmp_path, "hang", distributed={"num_ranks": 2, "collective_timeout_s": 2.0})
    started = time.monotonic()
    out = run_ranks(cfg, FAULT, "hang", timeout=60)
    assert out.returncode != 0
    assert "stalled: rank 1" in out.stdout, out.stdout
    assert time.monotonic() - started < 30


def test_sigterm_stops_all_ranks_and_keeps_checkpoints_whole(tmp_path):
    cfg = make_run(tmp_path, "term", distributed={"num_ranks": 2}, train={"num_train_steps": 3000},
                   checkpoint={"period": 50, "max_num_checkpoints": 2})
    lines: list[str] = []
    proc_box = []

    import threading

    def terminate_when_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            progress = read_progress(cfg.output_dir)
            if progress and progress["step"] >= 60 and proc_box:
                os.killpg(proc_box[0].pid, signal.SIGTERM)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=terminate_when_running)
    watcher.start()
    result = launch(cfg.output_dir, 2, on_line=lines.append, on_start=proc_box.append)
    watcher.join()
    assert result.returncode != 0
    output = "\n".join(lines)
    assert "SIGTERM received" in output
    kept = list_complete(cfg.checkpoints_dir)
    assert kept and kept[-1].step < 3000
    for info in kept:
        verify(info.path)
    assert not [p for p in cfg.checkpoints_dir.iterdir() if p.name.startswith(".tmp")]
    # No rank outlives the launcher.
    time.sleep(0.5)
    alive = subprocess.run(["pgrep", "-f", f"ortflow.trainer {cfg.output_dir}"], capture_output=True, text=True)
    assert alive.stdout.strip() == ""
    # And the stopped run resumes from where it stopped.
    assert json.loads((kept[-1].path / "meta.json").read_text())["global_cursor"] == kept[-1].step * 2 * 4


def test_tensorboard_and_progress_written_by_rank_zero(two):
    cfg, _ = two
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.tensorboard_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/learning_rate", "train/grad_norm", "train/samples_per_s"} <= tags
    assert [e.step for e in events.Scalars("eval/loss")] == [5, 10, 15, 20]
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses[-1] < losses[0]
    progress = read_progress(cfg.output_dir)
    assert progress["step"] == progress["total"] == 20 and progress["final"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
