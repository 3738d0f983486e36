"""One interface for a training job on any scheduler: submit, stream its output, poll its state, cancel, exit status.

A :class:`Job` is what a launcher starts (:class:`ortflow.launch.local.LocalJob`, :mod:`ortflow.launch.slurm`,
:mod:`ortflow.launch.kubernetes`);
:func:`watch` drives any of them the same way: it forwards new output lines, polls the state until the job ends, and
on an interruption (a cancelled flow, a task timeout, Ctrl-C) asks the job to stop, which makes the ranks write a stop
checkpoint, waits for that within a grace period and ends the job when the period runs out. A requeued or preempted
job keeps its id and starts again from the run folder's newest complete checkpoint, so watching simply goes on.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ortflow.config.atomic import write_text_atomic
from ortflow.processes import despite_repeated_stops

log = logging.getLogger(__name__)

#: The run folder's record of the last job that trained it (launcher and job id): the run summary shows it.
LAUNCH_RECORD = "launch.json"
#: Seconds the ranks get to stop cleanly (finish the update, keep checkpoints whole) before they are killed.
STOP_GRACE_S = 30.0


class LaunchError(RuntimeError):
    """The launcher cannot be started (not found, bad host file)."""


@dataclass(frozen=True)
class LaunchResult:
    """How the job ended: the launcher's exit status and the last error lines any rank printed."""

    returncode: int
    error_lines: tuple[str, ...]
    signal: int = 0  # the stop signal this process received and passed on (0: none)
    launcher: str = "local"  # distributed.launcher that ran the job
    job_id: str | None = None  # the scheduler's id of the job (Slurm job id, MPIJob namespace/name)
    detail: str = ""  # the scheduler's last word on the job (its final state)
    retry: bool = True  # False: running the job again would not help (cancelled outside ortflow, can never start)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def summary(self) -> str:
        """A one-paragraph reason for a failed job."""
        if self.ok:
            return "training finished"
        if not self.retry and self.detail:  # the scheduler's reason is the whole story (scancel, can never start)
            return f"training stopped: {self.detail}"
        detail = "\n".join(self.error_lines) or "(no error lines captured; see the output above)"
        where = f" ({self.launcher} job {self.job_id}: {self.detail})" if self.detail and self.job_id else ""
        return f"training failed with exit status {self.returncode}{where}:\n{detail}{_signalled(self.error_lines)}"


#: MPICH's line for a rank that a signal ended: ``YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)``.
_SIGNALLED = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")


def _signalled(error_lines: tuple[str, ...]) -> str:
    """What a rank ended by a signal means, when no rank said why (a rank that failed says it in its own lines)."""
    found = next((m for m in map(_SIGNALLED.search, error_lines) if m), None)
    if found is None or any(line.startswith("[") for line in error_lines):
        return ""
    signum = int(found[1])
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    cause = (", sent by hand or by the kernel's out-of-memory killer (`dmesg` names its victims)"
             if signum == signal.SIGKILL else "")
    return (f"\na rank was ended by {name}{cause}; every checkpoint completed before is intact, and training run "
            "again resumes from the newest")


def is_error_line(line: str) -> bool:
    """Whether an output line reports an error (kept for the failure summary)."""
    return (any(tag in line for tag in ("ERROR", "Error", "Traceback", "error:", "Abort", "killed"))
            or _SIGNALLED.search(line) is not None)


#: The line a scheduler job prints when one of its attempts (a requeued job's next allocation) starts: the failure
#: summary keeps only the error lines after the last one.
ATTEMPT_LINE = re.compile(r"^ortflow: \w+ job \S+ attempt \d+")
#: Seconds between the lines that say why a job is still pending.
PENDING_REPORT_S = 60.0


class Phase(enum.Enum):
    """Where a job is: waiting for resources, running (or being requeued), or ended."""

    PENDING = "pending"
    RUNNING = "running"
    ENDED = "ended"


@dataclass(frozen=True)
class JobState:
    """A poll's answer: the phase, the scheduler's own word for it, and the exit status once ended."""

    phase: Phase
    detail: str
    returncode: int | None = None
    retry: bool = True  # ended: False when another submission would end the same way (scancel, never starts)
    known: bool = True  # False: the scheduler has not said the job's state yet (the phase is the watcher's guess)


class Job(Protocol):
    """A submitted training job."""

    launcher: str  # "local", "slurm", "kubernetes"
    job_id: str | None  # the scheduler's name for it (Slurm job id, MPIJob namespace/name); None for local

    def read_output(self) -> list[str]:
        """The output lines written since the last call (every rank's, prefixed with its rank)."""

    def poll(self) -> JobState:
        """The job's state now."""

    def cancel(self) -> None:
        """Ask the ranks to stop after the current update with a stop checkpoint; returns at once."""

    def kill(self) -> None:
        """End the job now (what is left of it after the grace period)."""


class TimeLimitReached(TimeoutError):
    """The watcher's own time limit passed: the job was stopped (stop checkpoint) before this was raised."""


def watch(
    job: Job,
    on_line: Callable[[str], None] = print,
    poll_s: float = 2.0,
    grace_s: float = STOP_GRACE_S,
    forward_signals: bool = False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    deadline: float | None = None,
    received: list[int] | None = None,
) -> LaunchResult:
    """Stream ``job``'s output until it ends; return its exit status and last error lines.

    Args:
        job: A submitted job.
        on_line: Receives every output line.
        poll_s: Seconds between state queries.
        grace_s: After a cancel, how long the ranks get to write their stop checkpoint before the job is ended.
        forward_signals: Own SIGTERM/SIGINT while watching (``ortflow train``): they cancel the job, watching goes on
            until it ends, and the result carries the signal. Only possible in the main thread.
        clock: Monotonic seconds (passed in by tests).
        sleep: Waits between polls (passed in by tests).
        deadline: A ``clock()`` value after which the job is stopped and :class:`TimeLimitReached` raised (a task's
            time limit, enforced here too: a timeout delivered as an exception into a busy process can be lost).
        received: With ``forward_signals``, the stop signals the command received before the watch began (its own
            handler kept them): the job is stopped at once; later ones are added.

    Raises:
        Whatever interrupted the watch (KeyboardInterrupt, a task timeout, Prefect's cancellation), after the job
        was cancelled and has ended or been killed.
    """
    errors: deque[str] = deque(maxlen=20)
    received = received if received is not None else []
    signum = 0
    cancelled_at: list[float] = []

    pending_since: list[float] = []
    lines: deque[str] = deque()  # read from the job, not yet passed on: a stop request raised meanwhile loses none

    def show(line: str) -> None:
        on_line(line)
        if ATTEMPT_LINE.match(line):
            errors.clear()  # the failure summary quotes the current attempt only
        if is_error_line(line):
            errors.append(line)

    def drain() -> None:
        _pass_on(job, lines, show)

    seen: list[JobState] = []  # the newest state polled: a stop request says what it does to a pending job
    restore = _cancel_on_signals(job, received, seen) if forward_signals else (lambda: None)
    try:
        state = job.poll()
        seen[:] = [state]
        while state.phase is not Phase.ENDED:
            drain()
            _report_pending(job, state, pending_since, on_line, clock)
            if received and not cancelled_at:
                cancelled_at.append(clock())
            if cancelled_at and clock() - cancelled_at[0] > grace_s:
                log.error("%s job%s did not stop within %.0f s: ending it", job.launcher,
                          f" {job.job_id}" if job.job_id else "", grace_s)
                job.kill()
                cancelled_at[0] = float("inf")  # once
            if deadline is not None and clock() >= deadline:
                raise TimeLimitReached(f"the time limit passed while the {job.launcher} job ran: it was stopped")
            sleep(poll_s)
            state = job.poll()
            seen[:] = [state]
        drain()
        signum = received[0] if received else 0  # a signal after the job ended does not make it a stopped one
    except BaseException:  # a cancelled flow, a timeout, Ctrl-C: the job must not outlive its watcher unasked
        stop(job, grace_s, on_line, clock, sleep, last=_known(job, seen), pending=lines)
        raise
    finally:
        restore()
    log.info("%s job%s ended: %s", job.launcher, f" {job.job_id}" if job.job_id else "", state.detail)
    code = state.returncode if state.returncode is not None else 1
    return LaunchResult(code, tuple(errors), signum, job.launcher, job.job_id,
                        state.detail, state.retry)


def _report_pending(job: Job, state: JobState, since: list[float], on_line: Callable[[str], None],
                    clock: Callable[[], float]) -> None:
    """Say why a pending job waits: once the scheduler has said it is pending, then every :data:`PENDING_REPORT_S`
    seconds while it stays pending. A state the scheduler has not said yet (the watcher's guess) is not reported."""
    if state.phase is not Phase.PENDING or not state.known:
        since.clear()
        return
    now = clock()
    if since and now - since[0] < PENDING_REPORT_S:
        return
    since[:] = [now]
    on_line(f"ortflow: {job.launcher} job {job.job_id} is pending: {state.detail}")


def stop(job: Job, grace_s: float, on_line: Callable[[str], None] = print,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
         last: JobState | None = None, pending: deque[str] | None = None) -> JobState:
    """Cancel ``job`` (stop checkpoint), stream its last lines while it ends, kill it if ``grace_s`` runs out.

    A repeated stop request while it waits (a second Ctrl-C, a process manager repeating its SIGTERM, which Prefect
    raises as an exception during a flow run) neither cuts the wait nor the ranks' last lines short: the grace
    bounds the wait. ``last``: the job's newest polled state, which the warning follows (a pending job is removed, no
    rank runs; a job whose state the scheduler has not said gets the stop signal); None: a running job.
    ``pending``: lines the interrupted watch read from the job and had not passed on yet; they come first.
    """
    log.warning("%s", _stop_words(job, last, f" ({grace_s:.0f} s grace)"))
    job.cancel()
    deadline = clock() + grace_s
    pending = deque() if pending is None else pending  # read from the job, not yet passed on: kept across retries

    def repeated() -> None:
        log.warning("already stopping: the ranks are writing their stop checkpoint")

    with _said_not_raised(repeated):
        state = despite_repeated_stops(
            lambda: _stream_until_ended(job, deadline, min(1.0, grace_s), on_line, clock, sleep, pending),
            on_repeat=repeated)
        despite_repeated_stops(lambda: _pass_on(job, pending, on_line), on_repeat=repeated)
    if state.phase is not Phase.ENDED:
        log.error("%s job%s did not stop within %.0f s: ending it", job.launcher,
                  f" {job.job_id}" if job.job_id else "", grace_s)
        job.kill()
        state = job.poll()
    return state


def _stream_until_ended(job: Job, deadline: float, poll_s: float, on_line: Callable[[str], None],
                        clock: Callable[[], float], sleep: Callable[[float], None], pending: deque[str]) -> JobState:
    """Poll ``job`` every ``poll_s`` and stream its lines until it ended or ``deadline`` passed; its last state."""
    state = job.poll()
    while state.phase is not Phase.ENDED and clock() < deadline:
        _pass_on(job, pending, on_line)
        sleep(poll_s)
        state = job.poll()
    return state


def _pass_on(job: Job, pending: deque[str], on_line: Callable[[str], None]) -> None:
    """Pass the job's new lines to ``on_line``, each dropped from ``pending`` once passed: a call interrupted half-way
    (a repeated stop request raised as an exception) leaves the rest to the next call instead of losing them."""
    pending.extend(job.read_output())
    while pending:
        on_line(pending[0])
        pending.popleft()


@contextlib.contextmanager
def _said_not_raised(on_repeat: Callable[[], None]) -> Iterator[None]:
    """In the main thread: SIGTERM and SIGINT call ``on_repeat`` instead of the installed handlers (Prefect's raises
    an exception during a flow run, Python's default KeyboardInterrupt) until the block ends, so that a repeated stop
    request cannot cut the job's last lines short wherever it lands. Elsewhere (no handler can be set): nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda _signum, _frame: on_repeat()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


#: Signals repeated within this many seconds of the first are one stop request (the ranks count the same way).
REPEAT_WINDOW_S = 5.0


def _known(job: Job, seen: list[JobState]) -> JobState:
    """The job's newest polled state; polled now when the watch has not polled it yet (a stop request before the
    first poll): the words of a stop request and what the job's ``cancel`` does both follow what the scheduler says."""
    if not seen:
        seen[:] = [job.poll()]
    return seen[0]


def _stop_words(job: Job, last: JobState | None, grace: str = "") -> str:
    """What a stop request does to the job in its newest polled state ``last``: a pending job is removed (no rank
    runs), a running one's ranks stop after the current update with a stop checkpoint, and one whose state the
    scheduler has not said gets the stop signal, as a running one does (its ``cancel`` removes a job only when the
    scheduler said it is pending)."""
    name = f"{job.launcher} job{f' {job.job_id}' if job.job_id else ''}"
    if last is not None and not last.known:
        return (f"sending the stop signal to the {name}: its state is unknown (the scheduler has not answered); "
                f"ranks that run stop after the current update{grace}")
    if last is not None and last.phase is Phase.PENDING:
        return f"removing the pending {name} from the queue: no rank is running, nothing to checkpoint"
    return f"asking the ranks of the {name} to stop after the current update{grace}"


def _cancel_on_signals(job: Job, received: list[int], seen: list[JobState]) -> Callable[[], None]:
    """While watching, SIGTERM/SIGINT cancel the job once (the ranks stop with a stop checkpoint); so does a signal
    already in ``received``. ``seen`` holds the job's newest polled state (empty before the first poll)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    first: list[float] = [time.monotonic()] if received else []  # signals before the job started: stopped below

    def ask(signum: int) -> None:
        log.warning("%s: %s", signal.Signals(signum).name, _stop_words(job, _known(job, seen)))

    def forward(signum: int, _frame: object) -> None:
        if not received:
            received.append(signum)
            first.append(time.monotonic())
            ask(signum)
        elif time.monotonic() - first[0] <= REPEAT_WINDOW_S:
            return  # a double Ctrl-C is one request: MPICH's mpiexec would kill the ranks on a second signal
        job.cancel()  # a signal repeated later means "now" to the ranks (and the first may have been missed)

    early = received[:1]
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    if early:
        ask(early[0])
        job.cancel()
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()] and None


def write_record(run_dir: Path, launcher: str, job_id: str | None) -> None:
    """Keep which launcher and job trained the run folder last (replaced atomically)."""
    path = Path(run_dir) / LAUNCH_RECORD
    write_text_atomic(path, json.dumps({"launcher": launcher, "job_id": job_id}) + "\n")


def read_record(run_dir: Path) -> dict | None:
    """The launcher and job id of the run folder's last training job, or None."""
    try:
        return json.loads((Path(run_dir) / LAUNCH_RECORD).read_text())
    except (OSError, ValueError):
        return None
