"""watch() and stop() over a fake job: the one way every launcher's job is followed, cancelled and ended."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from ortflow.launch.job import (
    JobState,
    LaunchResult,
    Phase,
    TimeLimitReached,
    read_record,
    stop,
    watch,
    write_record,
)


class FakeJob:
    """A job that prints ``lines`` one per poll and ends ``run_polls`` polls after it starts, or ``stop_polls`` polls
    after a cancel (never, with None: ranks that do not stop)."""

    launcher, job_id = "fake", "7"

    def __init__(self, lines=(), run_polls: int = 3, stop_polls: int | None = 1, code: int = 0):
        self.pending = list(lines)
        self.run_polls, self.stop_polls, self.code = run_polls, stop_polls, code
        self.polls, self.cancelled_at, self.killed = 0, None, False
        self.calls: list[str] = []

    def read_output(self) -> list[str]:
        return [self.pending.pop(0)] if self.pending else []

    def poll(self) -> JobState:
        self.polls += 1
        if self.killed:
            return JobState(Phase.ENDED, "killed", 137)
        if self.cancelled_at is not None and self.stop_polls is not None \
                and self.polls - self.cancelled_at >= self.stop_polls:
            return JobState(Phase.ENDED, "stopped", 143)
        if self.cancelled_at is None and self.polls > self.run_polls:
            return JobState(Phase.ENDED, "done", self.code)
        return JobState(Phase.RUNNING, "running")

    def cancel(self) -> None:
        self.calls.append("cancel")
        self.cancelled_at = self.polls

    def kill(self) -> None:
        self.calls.append("kill")
        self.killed = True


def test_watch_forwards_every_line_and_keeps_the_error_lines():
    job = FakeJob(lines=["[0] step 1", "[1] Traceback (most recent call last):", "[1] ValueError: bad"], run_polls=5,
                  code=1)
    seen: list[str] = []
    result = watch(job, seen.append, sleep=lambda s: None)
    assert seen == ["[0] step 1", "[1] Traceback (most recent call last):", "[1] ValueError: bad"]
    errors = ("[1] Traceback (most recent call last):", "[1] ValueError: bad")
    assert result == LaunchResult(1, errors, 0, "fake", "7", "done")


def test_a_rank_ended_by_a_signal_is_named_with_its_likely_causes_and_that_a_rerun_resumes():
    # What mpiexec (MPICH) printed for `kill -9` of a rank mid-training; the rank itself said nothing.
    mpich = ["=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "=   PID 6986 RUNNING AT vm",
             "=   EXIT CODE: 9", "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)"]
    result = watch(FakeJob(lines=["[0] step 1410/3000 | loss 0.01", *mpich], run_polls=6, code=9), lambda line: None,
                   sleep=lambda s: None)
    summary = result.summary()
    assert "a rank was ended by SIGKILL" in summary and "out-of-memory killer" in summary, summary
    assert "training run again resumes from the newest" in summary, summary
    # A rank that said why it failed is not second-guessed by the launcher's cleanup.
    refused = LaunchResult(1, ("[0] 03:51:14 ERROR rank 0 refused: shard damaged; stopping every rank", mpich[-1]))
    assert "ended by" not in refused.summary()


def test_an_interrupted_watch_cancels_the_job_and_lets_it_stop_within_the_grace():
    job = FakeJob(run_polls=100, stop_polls=2)
    ticks = iter(range(100))

    def sleep(_s: float) -> None:
        if job.polls == 3 and "cancel" not in job.calls:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        watch(job, lambda line: None, grace_s=30, sleep=sleep, clock=lambda: float(next(ticks)))
    assert job.calls == ["cancel"]  # stopped by itself: no kill


def test_a_watch_past_its_deadline_stops_the_job_then_raises_a_timeout():
    # A task's time limit is enforced by the watch loop itself, not only by Prefect's exception into the thread.
    job = FakeJob(run_polls=100, stop_polls=2)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(TimeoutError, match="time limit passed"):
        watch(job, lambda line: None, poll_s=1.0, grace_s=30, clock=lambda: now[0], sleep=sleep, deadline=5.0)
    assert job.calls == ["cancel"]  # the ranks were asked to stop (stop checkpoint) and stopped: no kill
    assert 5.0 <= now[0] < 10.0
    assert issubclass(TimeLimitReached, TimeoutError)


def test_a_stop_signal_received_before_the_watch_cancels_the_job_as_it_starts_and_the_result_carries_it():
    previous = signal.getsignal(signal.SIGTERM)
    job = FakeJob(run_polls=100, stop_polls=2)
    received = [signal.SIGTERM]  # noted by `ortflow train` while it started the job
    result = watch(job, lambda line: None, sleep=lambda s: None, forward_signals=True, received=received)
    # once, at the start: after the one poll that says whether it is pending or running (what the cancel does)
    assert job.calls == ["cancel"] and job.cancelled_at == 1
    assert (result.returncode, result.signal) == (143, signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is previous


class QueuedJob(FakeJob):
    """A job that waits for resources until it is cancelled (which removes it, as scancel does a pending Slurm job)."""

    def poll(self) -> JobState:
        self.polls += 1
        if self.cancelled_at is not None:
            return JobState(Phase.ENDED, "CANCELLED", 1)
        return JobState(Phase.PENDING, "PENDING (Resources)")


@pytest.mark.parametrize("job", [QueuedJob(), FakeJob(run_polls=100, stop_polls=1)], ids=["pending", "running"])
def test_a_stop_signal_says_a_pending_job_is_removed_and_a_running_ones_ranks_are_asked_to_stop(job, caplog):
    def sleep(_s: float) -> None:
        if job.polls == 2:
            signal.raise_signal(signal.SIGTERM)  # the handler watch() installed runs here, in the main thread

    with caplog.at_level("WARNING", logger="ortflow.launch.job"):
        result = watch(job, lambda line: None, sleep=sleep, forward_signals=True)
    assert job.calls == ["cancel"] and result.signal == signal.SIGTERM
    said = [r.getMessage() for r in caplog.records]
    if isinstance(job, QueuedJob):
        assert said == ["SIGTERM: removing the pending fake job 7 from the queue: no rank is running, nothing to "
                        "checkpoint"], said
    else:
        assert said == ["SIGTERM: asking the ranks of the fake job 7 to stop after the current update"], said


def test_an_interrupted_watch_of_a_pending_job_says_it_is_removed(caplog):
    job = QueuedJob()

    def sleep(_s: float) -> None:
        if job.polls == 2 and "cancel" not in job.calls:
            raise KeyboardInterrupt

    with caplog.at_level("WARNING", logger="ortflow.launch.job"), pytest.raises(KeyboardInterrupt):
        watch(job, lambda line: None, grace_s=30, sleep=sleep)
    assert job.calls == ["cancel"]
    assert [r.getMessage() for r in caplog.records] == [
        "removing the pending fake job 7 from the queue: no rank is running, nothing to checkpoint"]


def test_a_job_that_does_not_stop_within_the_grace_is_killed():
    job = FakeJob(run_polls=100, stop_polls=None)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    state = stop(job, grace_s=30, on_line=lambda line: None, clock=lambda: now[0], sleep=sleep)
    assert job.calls == ["cancel", "kill"] and state.phase is Phase.ENDED
    assert 30 <= now[0] <= 32  # waited the grace period, not less


def test_the_launch_record_is_replaced_by_each_job(tmp_path):
    assert read_record(tmp_path) is None
    write_record(tmp_path, "slurm", "42")
    write_record(tmp_path, "local", None)
    assert read_record(tmp_path) == {"launcher": "local", "job_id": None}


def test_a_repeated_interruption_while_the_job_stops_neither_cuts_the_wait_nor_its_last_lines_short():
    # A process manager repeating its SIGTERM during a flow run: Prefect raises each one as an exception.
    job = FakeJob(lines=["[1] stop requested", "[0] stop requested", "[0] saved checkpoint"], run_polls=100,
                  stop_polls=3)
    seen: list[str] = []
    interruptions = [KeyboardInterrupt(), KeyboardInterrupt()]

    def sleep(_s: float) -> None:
        if interruptions:
            raise interruptions.pop()

    state = stop(job, grace_s=30, on_line=seen.append, clock=lambda: 0.0, sleep=sleep)
    assert not interruptions and state.phase is Phase.ENDED and state.returncode == 143
    assert job.calls == ["cancel"]  # stopped by itself, once asked: no kill, no second cancel
    assert seen == ["[1] stop requested", "[0] stop requested", "[0] saved checkpoint"]


class BatchJob(FakeJob):
    """A fake job whose lines all come in one read, as a local job's do when its ranks print them between two polls."""

    def read_output(self) -> list[str]:
        lines, self.pending = self.pending, []
        return lines


LAST_LINES = ["[0] saved checkpoint step-29", "[0] peak resident memory 160 MiB", "[0] stop requested"]


def test_an_interruption_while_the_last_lines_are_passed_on_loses_none_of_them():
    job = BatchJob(lines=LAST_LINES, run_polls=100, stop_polls=3)
    seen: list[str] = []
    interruptions = [KeyboardInterrupt()]

    def on_line(line: str) -> None:
        if line == LAST_LINES[1] and interruptions:  # raised before the line is shown, with one left behind it
            raise interruptions.pop()
        seen.append(line)

    state = stop(job, grace_s=30, on_line=on_line, clock=lambda: 0.0, sleep=lambda _s: None)
    assert not interruptions and state.returncode == 143
    assert seen == LAST_LINES


def test_a_stop_request_raised_while_the_watch_passes_lines_on_loses_none_of_them():
    """The first stop request raised as an exception (Prefect's SIGTERM during a flow run) in the middle of a batch of
    lines: the job is stopped, the rest of the batch comes first, then the job's last lines, then the request goes
    on."""
    job = BatchJob(lines=LAST_LINES, run_polls=100, stop_polls=3)
    seen: list[str] = []
    interruptions = [KeyboardInterrupt()]

    def on_line(line: str) -> None:
        if line == LAST_LINES[1] and interruptions:
            raise interruptions.pop()
        seen.append(line)

    with pytest.raises(KeyboardInterrupt):
        watch(job, on_line=on_line, clock=lambda: 0.0, sleep=lambda _s: None)
    assert job.calls == ["cancel"] and seen == LAST_LINES


def test_a_repeated_stop_signal_while_the_job_stops_is_said_not_raised_and_the_handlers_come_back(caplog):
    """A process manager repeating SIGTERM during a flow run: Prefect's handler would raise it wherever it lands.
    While the job stops, a repeat is a warning; afterwards the handler installed before is back."""
    job = BatchJob(lines=LAST_LINES, run_polls=100, stop_polls=3)
    seen: list[str] = []

    def raising(_signum, _frame):
        raise KeyboardInterrupt

    def on_line(line: str) -> None:
        if line == LAST_LINES[1]:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line is passed on
        seen.append(line)

    before = {sig: signal.signal(sig, raising) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.WARNING, logger="ortflow"):
            state = stop(job, grace_s=30, on_line=on_line, clock=lambda: 0.0, sleep=lambda _s: None)
        assert signal.getsignal(signal.SIGTERM) is raising and signal.getsignal(signal.SIGINT) is raising
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert state.returncode == 143 and seen == LAST_LINES
    assert "already stopping: the ranks are writing their stop checkpoint" in caplog.text


def test_an_error_while_the_job_stops_is_not_taken_for_a_repeated_interruption():
    job = FakeJob(run_polls=100, stop_polls=3)

    def sleep(_s: float) -> None:
        raise OSError("scontrol vanished")

    with pytest.raises(OSError, match="scontrol vanished"):
        stop(job, grace_s=30, on_line=lambda line: None, clock=lambda: 0.0, sleep=sleep)
