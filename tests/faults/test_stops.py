"""Every stop of `ortflow train` ends with its documented status and leaves nothing behind: a signal given twice
(an impatient double Ctrl-C), then repeated until the command has exited (a process manager), still exits 130/143
with one stop checkpoint, every rank stopped at the same update; Ctrl-Z does not pause training (its one
documented meaning), so a kill after it leaves no process; the shared memory of a killed job is reclaimed by the next
job. A stopped proxy (status 3, itself ended): test_launcher_stop.py."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import signal
import subprocess
import threading
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
def test_a_signal_given_twice_then_repeated_until_the_command_exits_stops_with_its_status_and_a_stop_checkpoint(
        run, sig, status):
    proc = procs.start_train(run.output_dir)
    lines = procs.drain(proc)
    try:
        procs.wait_for_step(run.output_dir, 2, proc)
        tree = procs.descendants(proc.pid)
        os.kill(proc.pid, sig)
        procs.wait_for_line(lines, "to stop after the current update", proc)
        os.kill(proc.pid, sig)  # the second press of an impatient user, while the ranks stop
        _wait_for(lambda: list_complete(run.checkpoints_dir), proc)  # the ranks have stopped
        # A process manager repeating the signal: it reaches the command while its job ends and after it has ended.
        after_job = _repeat_until_exit(proc, sig)
        code = proc.wait(timeout=120)
    finally:
        procs.kill_tree(proc.pid)
    text = "\n".join(lines)
    assert code == status, text[-3000:]
    assert after_job, "no signal reached the command between the end of its job and its exit"
    assert "training failed" not in text and "Traceback" not in text, text[-3000:]
    steps = [c.step for c in list_complete(run.checkpoints_dir)]
    assert len(steps) == 1, f"checkpoints {steps}, want the one stop checkpoint"
    # Every rank stopped after the same update, with the same parameters, and said so through `ortflow train`.
    digests = {(int(step), digest) for _, digest, step in re.findall(PARAMETERS, text)}
    assert digests == {(steps[0], next(iter(digests))[1])} and len(re.findall(PARAMETERS, text)) == 2, digests
    assert text.count(f"stop requested: ranks stopped together after step {steps[0]}") == 2, text[-3000:]
    assert not _gone_within(tree, 10), [procs.cmdline(p) for p in procs.alive(tree)]


PARAMETERS = r"rank (\d) parameters sha256 ([0-9a-f]{64}) at step (\d+)"


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the command exited ({proc.returncode}) first"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _repeat_until_exit(proc: subprocess.Popen, sig: int) -> int:
    """Send ``sig`` every few milliseconds until ``proc`` exits; returns how many were sent once its job had ended
    (no process left below it)."""
    after_job = 0
    while proc.poll() is None:
        ended = not procs.descendants(proc.pid)
        os.kill(proc.pid, sig)  # a zombie until waited for: the pid stays ours
        after_job += ended
        time.sleep(0.002)
    return after_job


def test_ctrl_z_keeps_the_job_running_and_a_kill_then_leaves_no_process_and_no_shared_memory_behind(run):
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
        # This job's own segments (other jobs on the host make and reclaim theirs meanwhile), held mapped here so
        # that no other job's start reclaims them before the next job of this test.
        segments = _mapped_segments(tree)
        assert segments, "the job's ranks map no segment in /dev/shm"
        with _held(segments):
            os.kill(proc.pid, signal.SIGKILL)  # `kill -9 %1`
            proc.wait(timeout=30)
            left = _gone_within(tree, 15)
            # The ranks died without MPI_Finalize: their shared memory stays until the next job reclaims it.
            kept = {path for path in segments if os.path.exists(path)}
    finally:
        procs.kill_tree(proc.pid)
    assert not left, [(procs.cmdline(p), procs.state(p)) for p in left]
    assert kept == segments, f"the killed job left {sorted(kept)} of {sorted(segments)}: nothing to reclaim"
    short = make_run(run.output_dir.parent, "next", distributed={"num_ranks": 2}, train={"num_train_steps": 2})
    out = procs.ortflow_here("train", str(short.output_dir))  # the next job on this host (launched in-process)
    assert out.returncode == 0, out.stdout[-2000:]
    assert not [path for path in segments if os.path.exists(path)], out.stdout[-2000:]


def _mapped_segments(pids: list[int]) -> set[str]:
    """The MPICH segments in /dev/shm that processes ``pids`` map."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                found |= {line.split(maxsplit=5)[-1].strip() for line in maps if " /dev/shm/mpich_shm_" in line}
        except OSError:
            continue
    return {path for path in found if not path.endswith(" (deleted)")}


@contextlib.contextmanager
def _held(paths: set[str]):
    """Map ``paths`` in this process for the block: a mapped segment is never reclaimed."""
    with contextlib.ExitStack() as stack:
        for path in sorted(paths):
            with open(path, "rb") as f:
                stack.enter_context(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        yield


def test_train_stop_signals_end_it_before_the_job_are_kept_for_it_stay_handled_to_exit_off_main_untouched():
    from ortflow.cli import stop_signals as module

    before = {sig: signal.getsignal(sig) for sig in module.STOP_SIGNALS}
    with pytest.raises(module.StoppedBeforeJob) as stopped, module.stop_signals():
        signal.raise_signal(signal.SIGINT)  # nothing started yet: the command ends at once
    assert stopped.value.signum == signal.SIGINT
    assert {sig: signal.getsignal(sig) for sig in module.STOP_SIGNALS} == before  # in-process: given back

    with module.stop_signals() as stops:
        stops.phase = "job"  # starting the job, its watcher not there yet: kept for it
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        stops.phase = "after"  # the job has ended: noted and ignored
        signal.raise_signal(signal.SIGTERM)
    assert stops.received == [signal.SIGTERM, signal.SIGTERM]

    seen = []  # called from another thread (no handlers there): nothing is installed, nothing breaks

    def elsewhere() -> None:
        with module.stop_signals() as stops:
            seen.append(stops.phase)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == ["job"] and {sig: signal.getsignal(sig) for sig in module.STOP_SIGNALS} == before

    module.mark_process_entry()  # the `ortflow` process: ignored from the end of the command to the exit
    try:
        with module.stop_signals():
            pass
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in module.STOP_SIGNALS)
    finally:
        module._process_entry[0] = False
        for sig, handler in before.items():
            signal.signal(sig, handler)
