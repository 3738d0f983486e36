"""Every stop of `ortflow train` ends with its documented status and leaves nothing behind: a signal given twice
(an impatient double Ctrl-C) still exits 130/143 with the stop checkpoint; Ctrl-Z does not pause training (its one
documented meaning), so a kill after it leaves no process; the shared memory of a killed job is reclaimed by the next
job. A stopped proxy (status 3, itself ended): test_launcher_stop.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ortflow.checkpoints import list_complete
from tests.faults import procs
from tests.support.runs import make_run

pytestmark = [pytest.mark.mpi, pytest.mark.faults]


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path, "run", num_rows=4096, distributed={"num_ranks": 2}, train={"num_train_steps": 100000},
                    checkpoint={"period": 100000, "max_num_checkpoints": 2})


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while procs.alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs.alive(pids)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("gap_s", [0.3, 1.0])
def test_a_signal_given_twice_stops_with_its_status_and_a_stop_checkpoint(run, sig, status, gap_s):
    proc = procs.start_train(run.output_dir)
    lines = procs.drain(proc)
    try:
        procs.wait_for_step(run.output_dir, 2, proc)
        tree = procs.descendants(proc.pid)
        os.kill(proc.pid, sig)
        time.sleep(gap_s)  # the second press of an impatient user, not a wait for something to start
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=120)
    finally:
        procs.kill_tree(proc.pid)
    text = "\n".join(lines)
    assert code == status, text[-3000:]
    assert "training failed" not in text and "Traceback" not in text, text[-3000:]
    assert list_complete(run.checkpoints_dir), "no stop checkpoint"
    assert not _gone_within(tree, 10), [procs.cmdline(p) for p in procs.alive(tree)]


def test_ctrl_z_keeps_the_job_running_and_a_kill_then_leaves_no_process_and_no_shared_memory_behind(run):
    before = _segments()
    proc = procs.start_train(run.output_dir)
    lines = procs.drain(proc)
    try:
        seen = procs.wait_for_step(run.output_dir, 2, proc)
        tree = procs.descendants(proc.pid)
        os.kill(proc.pid, signal.SIGTSTP)  # Ctrl-Z: documented not to pause training
        procs.wait_for_line(lines, "Ctrl-Z does not pause training", proc)  # delivered (a kill would drop it)
        procs.wait_for_step(run.output_dir, seen + 3, proc)  # the job runs on
        assert procs.state(proc.pid) not in ("T", None), procs.state(proc.pid)
        assert not [p for p in tree if procs.state(p) == "T"], "a process of the job was stopped"
        os.kill(proc.pid, signal.SIGKILL)  # `kill -9 %1`
        proc.wait(timeout=30)
        left = _gone_within(tree, 15)
    finally:
        procs.kill_tree(proc.pid)
    assert not left, [(procs.cmdline(p), procs.state(p)) for p in left]
    # The ranks died without MPI_Finalize: their shared memory stays until the next job on this host reclaims it.
    segments = _segments() - before
    assert segments, "the killed job left no segment in /dev/shm: nothing to reclaim"
    short = make_run(run.output_dir.parent, "next", distributed={"num_ranks": 2}, train={"num_train_steps": 2})
    out = subprocess.run([procs.ORTFLOW, "train", str(short.output_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-2000:]
    assert not (segments & _segments()), sorted(segments & _segments())


def _segments() -> set[str]:
    return {e.path for e in os.scandir("/dev/shm") if e.name.startswith("mpich_shm_")}
