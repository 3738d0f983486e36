"""A stopped launcher never hangs the job, and a paused job resumes (see trials_launcher.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.faults import trials_launcher as launcher
from tests.faults.trials import Outcome


def check(outcome: Outcome) -> None:
    assert outcome.ok, f"{outcome.category}: {outcome.detail}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("launcher")


STOPPED_TEST = ("test_a_stopped_launcher_aborts_the_job_within_the_timeout_naming_it"
                "_and_a_stopped_proxy_is_ended_with_status_3")
PAUSED_TEST = "test_a_paused_launcher_or_ctrl_z_lets_the_job_finish"


@pytest.fixture(scope="module")
def launcher_trials(request, root):
    """The launcher trials of this module's selected tests, their jobs side by side (each mostly waits: for the
    collective timeout once its launcher is stopped, for a pause to end): configured here one after another, then
    run each in its own thread. Maps the stopped target (or "paused") to the future of the trial's outcome."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    targets = [item.callspec.params["target"] for item in selected if item.originalname == STOPPED_TEST]
    runs = {target: launcher.stopped_run(root, f"stopped-{target}") for target in targets}
    if any(item.originalname == PAUSED_TEST for item in selected):
        runs["paused"] = launcher.paused_run(root, "paused")
    with ThreadPoolExecutor(max(1, len(runs)), thread_name_prefix="launcher-trial") as pool:
        futures = {target: pool.submit(launcher.stopped_launcher_trial, root, target, f"stopped-{target}", cfg)
                   for target, cfg in runs.items() if target != "paused"}  # fmt: skip
        if "paused" in runs:  # one job: Ctrl-Z, then mpiexec paused
            futures["paused"] = pool.submit(launcher.paused_trial, root, ("tstp", "launcher"), "paused",
                                            runs["paused"])  # fmt: skip
        yield futures


@pytest.mark.mpi
@pytest.mark.faults
@pytest.mark.parametrize("target", ["cli", "launcher", "proxy"])
def test_a_stopped_launcher_aborts_the_job_within_the_timeout_naming_it_and_a_stopped_proxy_is_ended_with_status_3(
        launcher_trials, target):
    check(launcher_trials[target].result(timeout=500))


@pytest.mark.mpi
@pytest.mark.faults
def test_a_paused_launcher_or_ctrl_z_lets_the_job_finish(launcher_trials):
    check(launcher_trials["paused"].result(timeout=500))


WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from ortflow.trainer import output
relays = output.never_block(limit=1 << 20)
start = time.monotonic()
for i in range(20000):
    print(f"line {{i}} " + "x" * 200)
sys.stderr.write(f"wrote in {{time.monotonic() - start:.3f}} s\\n")
sys.stdin.readline()  # exit only once the test reads (the exit drain waits 2 s at most)
"""


def test_rank_output_never_blocks_when_nobody_reads_it(tmp_path):
    # 4 MB of output into a pipe nobody reads: without the relay the writer blocks after 64 KB, for ever.
    root = os.getcwd()
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and b"wrote in" not in _peek_stderr(proc):
        time.sleep(0.05)
    try:
        assert b"wrote in" in _peek_stderr(proc), "the writer blocked on its unread stdout"
        out, _ = proc.communicate(b"\n", timeout=60)  # now read: what was kept arrives, with the count of what was not
    finally:
        proc.kill()
    text = out.decode()
    assert text.startswith("line 0 ") and "bytes of this rank's output were dropped" in text


_SEEN: dict[int, bytes] = {}


def _peek_stderr(proc: subprocess.Popen) -> bytes:
    import fcntl

    fd = proc.stderr.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    try:
        chunk = os.read(fd, 65536) or b""
    except BlockingIOError:
        chunk = b""
    _SEEN[proc.pid] = _SEEN.get(proc.pid, b"") + chunk
    return _SEEN[proc.pid]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(tmp_path, clock, state=lambda pid: "S", launchers=(), continued=lambda: False):
    from ortflow.trainer.comm.watchdog import Heartbeats, Watchdog

    fired: list[str] = []
    dog = Watchdog(10.0, Heartbeats(tmp_path, 0, 1), fired.append, clock=clock, launchers=launchers, state=state,
                   continued=continued)
    dog.close()  # rounds are driven by hand below
    return dog, fired


def test_time_the_rank_itself_was_stopped_does_not_count_against_the_timeout(tmp_path):
    clock = FakeClock()
    signals: list[bool] = []
    dog, fired = _watchdog(tmp_path, clock, continued=lambda: bool(signals) and signals.pop())
    dog.enter("allreduce")
    last = clock.now
    clock.now += 60.0  # the rank stopped (SIGSTOP) for a minute inside the collective, then resumed (SIGCONT)
    signals.append(True)
    assert not dog.check(last) and not fired
    for _ in range(int(10.0 / dog.beat_s)):  # a real stall after the resume, round by round, still aborts
        last = clock.now
        clock.now += dog.beat_s
        if dog.check(last):
            break
    assert fired and "allreduce" in fired[0] and clock.now - 160.0 >= 9.0  # the minute paused was not counted


def test_a_gap_without_a_continue_signal_still_counts(tmp_path):
    clock = FakeClock()
    dog, fired = _watchdog(tmp_path, clock)
    dog.enter("allreduce")
    last = clock.now
    clock.now += 60.0  # the watchdog thread was late (a loaded machine), the rank was never stopped
    assert dog.check(last) and "allreduce" in fired[0]


def test_the_continue_signal_reaches_a_watchdog_thread_while_the_main_thread_is_busy():
    from ortflow.trainer.lifeline import continued_signal

    handler = signal.getsignal(signal.SIGCONT)
    continued = continued_signal()
    try:
        seen = []
        watcher = threading.Thread(target=lambda: seen.append(_wait_for(continued)))
        watcher.start()
        os.kill(os.getpid(), signal.SIGCONT)
        time.sleep(0.2)  # the main thread stays busy in C code (sleep) while the thread must see the signal
        watcher.join(timeout=10)
        assert seen == [True]
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCONT, handler)


def _wait_for(check) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_a_launcher_stopped_longer_than_the_timeout_is_named(tmp_path):
    clock = FakeClock()
    states = {7: "S"}
    dog, fired = _watchdog(tmp_path, clock, state=states.get, launchers=(("the launcher 'mpiexec' (pid 7)", 7),))
    last = clock.now
    for _ in range(30):  # 15 s of rounds while mpiexec runs: nothing
        clock.now += dog.beat_s
        assert not dog.check(last)
        last = clock.now
    states[7] = "T"
    for _ in range(int(10.0 / dog.beat_s) + 1):  # stopped (counted from the first round that sees it), not yet 10 s
        clock.now += dog.beat_s
        assert not dog.check(last), fired
        last = clock.now
    clock.now += dog.beat_s
    assert dog.check(last) and "the launcher 'mpiexec' (pid 7) has been stopped" in fired[0]


def test_a_launcher_continued_within_the_timeout_is_forgiven(tmp_path):
    clock = FakeClock()
    states = {7: "T"}
    dog, fired = _watchdog(tmp_path, clock, state=states.get, launchers=(("mpiexec", 7),))
    last = clock.now
    for step in range(60):
        states[7] = "S" if step % 8 == 7 else "T"  # stopped 7 s, continued, stopped again: never 10 s in a row
        clock.now += dog.beat_s
        assert not dog.check(last), fired
        last = clock.now
