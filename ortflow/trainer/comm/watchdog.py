"""Heartbeats and the collective watchdog.

Each rank keeps one small heartbeat file with two independent parts:

* the sequence number, time and label of the collective it last entered (written by the rank's main thread), and
* a liveness timestamp, refreshed every ``beat_s`` by the watchdog thread whether or not the rank is in a collective.

The watchdog thread also watches the processes between the rank and the user on its host (its MPI proxy, ``mpiexec``
and the launching ``ortflow train``): one stopped longer than the timeout aborts the job, naming it, as a stalled
rank does. Time the rank itself spends stopped (the whole job paused and resumed) is not counted.

A rank that waits in a collective longer than the timeout reads every record and names the stalled ranks: those that
never reached this collective (sequence number behind), and those whose liveness timestamp has gone stale (a rank that
was SIGSTOPped, or wedged with the interpreter blocked, even inside the same collective). The message goes to stderr
(the job output, and so the Prefect log) and to ``stall-rank-N.txt`` beside the heartbeats, which the launcher
replays after the job ends in case the abort cut the stream; then the whole job is aborted.

Where each rank was is kept too: its Python stacks (every thread's) go to ``stacks-rank-N.txt`` beside the heartbeats,
and the message names the files of the ranks it reports. They are written without the interpreter's lock, so also by a
rank whose main thread holds it inside a native call that never returns (its output thread cannot run then: a dump
to stderr would stay in the pipe, unread, until the abort). Three ways (:class:`Watchdog` with ``stacks``):

* a rank whose watchdog thread has not run for half the timeout dumps its stacks (Python's ``faulthandler`` timer, a C
  thread, re-armed at every beat): a wedged rank's stacks are in its file before its peers' timeout ends the job;
* a rank that times out dumps its own and asks every other rank for theirs (``stacks-request`` beside the heartbeats,
  answered at their next beat), so a stalled rank whose Python still runs (waiting in a native call that released the
  lock, outside the watchdog) leaves its stacks too;
* ``kill -USR2 PID`` of a rank dumps its stacks at any time.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_RECORD = struct.Struct("<qd48s")  # collective sequence number, wall time entered, label
_BEAT = struct.Struct("<d")  # wall time of the last liveness beat, at _BEAT_OFFSET
_BEAT_OFFSET = 64
#: Name of the file a timed-out rank leaves its message in (``.format(rank=...)``).
STALL_FILE = "stall-rank-{rank:05d}.txt"
#: Name of the file a rank's Python stacks are dumped into (``.format(rank=...)``).
STACKS_FILE = "stacks-rank-{rank:05d}.txt"
#: The file a timed-out rank writes to ask every rank for its stacks.
STACKS_REQUEST = "stacks-request"


class Heartbeats:
    """One fixed-size record per rank in ``directory``: the collective it last entered, and its last liveness beat."""

    def __init__(self, directory: Path, rank: int, size: int):
        self.directory = directory
        self.rank = rank
        self.size = size
        directory.mkdir(parents=True, exist_ok=True)
        (directory / STALL_FILE.format(rank=rank)).unlink(missing_ok=True)  # an earlier run's message is not ours
        self._fd = os.open(directory / f"rank-{rank:05d}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write(0, "start")
        self.beat()

    def write(self, seq: int, label: str) -> None:
        """Record entering collective ``seq`` (main thread)."""
        os.pwrite(self._fd, _RECORD.pack(seq, time.time(), label.encode()[:48]), 0)

    def beat(self, now: float | None = None) -> None:
        """Record that this process is alive (watchdog thread); a separate field, so it never tears ``write``."""
        os.pwrite(self._fd, _BEAT.pack(time.time() if now is None else now), _BEAT_OFFSET)

    def _data(self, rank: int) -> bytes:
        try:
            return (self.directory / f"rank-{rank:05d}").read_bytes()
        except FileNotFoundError:
            return b""

    def read(self, rank: int) -> tuple[int, float, str] | None:
        """(sequence number, time entered, label) of a rank's last collective, or None before it started."""
        data = self._data(rank)
        if len(data) < _RECORD.size:
            return None
        seq, when, label = _RECORD.unpack(data[: _RECORD.size])
        return seq, when, label.rstrip(b"\0").decode(errors="replace")

    def last_beat(self, rank: int) -> float | None:
        """Wall time of a rank's last liveness beat, or None."""
        data = self._data(rank)
        if len(data) < _BEAT_OFFSET + _BEAT.size:
            return None
        return _BEAT.unpack(data[_BEAT_OFFSET : _BEAT_OFFSET + _BEAT.size])[0]

    def stacks_path(self, rank: int | None = None) -> Path:
        """The file a rank's Python stacks are dumped into (this rank's by default)."""
        return self.directory / STACKS_FILE.format(rank=self.rank if rank is None else rank)

    def leave_message(self, message: str) -> Path:
        """Write this rank's stall message beside the heartbeats (fsynced: the abort follows)."""
        path = self.directory / STALL_FILE.format(rank=self.rank)
        with open(path, "w") as f:
            f.write(message + "\n")
            f.flush()
            os.fsync(f.fileno())
        return path

    def close(self) -> None:
        os.close(self._fd)


def describe_stall(heartbeats: Heartbeats, my_seq: int, label: str, waited: float, now: float,
                   stale_s: float = float("inf"), peer: int | None = None, stacks: bool = False) -> str:
    """The message a waiting rank prints: which ranks are stalled, and where they are.

    A rank is stalled when it never reached collective ``my_seq`` or when its liveness beat is older than
    ``stale_s`` (stopped or wedged, possibly inside this same collective). For a point-to-point wait (``peer``
    given) the stalled rank is the peer, wherever it is. ``stacks``: the ranks dump their Python stacks
    (:class:`Watchdog`); the message names the files of the stalled ranks and of this one.
    """
    stalled, ranks = [], []
    for rank in range(heartbeats.size) if peer is None else [peer]:
        record = heartbeats.read(rank)
        if record is None:
            stalled.append(f"rank {rank} (no heartbeat: it never started)")
            continue
        before = len(stalled)
        seq, when, where = record
        beat = heartbeats.last_beat(rank)
        silent = beat is not None and now - beat > stale_s
        state = f", no sign of life for {now - beat:.0f} s" if silent else ""
        if peer is not None:  # the peer is stalled wherever it is
            stalled.append(f"rank {rank} (last entered #{seq} '{where}' {now - when:.0f} s ago{state})")
        elif seq < my_seq:
            stalled.append(f"rank {rank} (last entered collective #{seq} '{where}' {now - when:.0f} s ago{state})")
        elif silent and rank != heartbeats.rank:
            stalled.append(
                f"rank {rank} (stopped or wedged: no sign of life for {now - beat:.0f} s, inside collective #{seq} "
                f"'{where}')"
            )
        if len(stalled) > before:
            ranks.append(rank)
    names = "; ".join(stalled) or "none found (every rank is alive and arrived; check the logs)"
    files = ""
    if stacks:
        named = [r for r in ranks if r != heartbeats.rank] + [heartbeats.rank]
        files = " Python stacks: " + "; ".join(
            f"{'this rank' if r == heartbeats.rank else f'rank {r}'} {heartbeats.stacks_path(r)}" for r in named) + "."
    return (
        f"collective #{my_seq} '{label}' waited {waited:.0f} s (distributed.collective_timeout_s); "
        f"stalled: {names}.{files} Aborting the job; the last complete checkpoint is kept."
    )


def process_state(pid: int) -> str | None:
    """The state letter of a process (``T``: stopped by a signal, ``t``: stopped by a debugger, ``Z``: zombie), or
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Watchdog:
    """Beats the heartbeat and aborts the job when the current collective exceeds ``timeout`` seconds, or when a
    launcher process this rank depends on has been stopped that long.

    Time this rank itself spent stopped (SIGSTOP, then SIGCONT: a debugger, a pause from outside) does not count
    against the timeout: once the process has been continued (SIGCONT), the thread that beats every ``beat_s`` moves
    the start of the current wait forward by the gap since its previous round.

    Args:
        timeout: ``distributed.collective_timeout_s``.
        heartbeats: This rank's heartbeat file and its peers'.
        on_timeout: Called with the message once a wait or a stopped launcher exceeds the timeout.
        clock: Monotonic seconds (passed in so tests control time).
        launchers: ``(description, pid)`` of the processes between this rank and the user on this host (its MPI
            proxy, ``mpiexec``, ``ortflow train``); each is watched like a peer rank.
        state: Reads a process's state letter (passed in so tests need no stopped process).
        on_launcher_stopped: Called instead of ``on_timeout`` for a stopped launcher (an abort through the launcher
            could not get through it).
        continued: True once this process has been continued (SIGCONT) since the previous call
            (:func:`ortflow.trainer.lifeline.continued_signal`).
        stacks: Dump this rank's Python stacks into ``heartbeats.stacks_path()`` (the module docstring says when;
            one watchdog per process: the ``faulthandler`` timer and SIGUSR2 are the process's).
    """

    def __init__(self, timeout: float, heartbeats: Heartbeats, on_timeout: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, launchers: tuple[tuple[str, int], ...] = (),
                 state: Callable[[int], str | None] = process_state,
                 on_launcher_stopped: Callable[[str], None] | None = None,
                 continued: Callable[[], bool] = lambda: False, stacks: bool = False):
        self.timeout = timeout
        self.heartbeats = heartbeats
        self.on_timeout = on_timeout
        self.clock = clock
        self.launchers = launchers
        self._state = state
        self.on_launcher_stopped = on_launcher_stopped or on_timeout
        self._continued = continued
        self._stopped_since: dict[int, float] = {}
        self.seq = 0
        self.beat_s = min(1.0, timeout / 10)
        # A beat older than this is a stopped process: several missed beats, and never more than half the timeout.
        self.stale_s = min(max(4 * self.beat_s, 2.0), timeout / 2)
        self._label = ""
        self._peer: int | None = None
        self._entered: float | None = None
        self._stop = threading.Event()
        self._stacks = None
        if stacks:
            self._stacks = open(heartbeats.stacks_path(), "w")  # noqa: SIM115 - open for faulthandler until close()
            self._asked = self._request_time()  # a request older than this rank is not for it
            faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=True, chain=False)
            self._arm()
        self._thread = threading.Thread(target=self._run, name="ortflow-watchdog", daemon=True)
        self._thread.start()

    # -- this rank's Python stacks -----------------------------------------------------------------------------------
    @property
    def stacks_after(self) -> float:
        """Seconds without a beat after which this rank's stacks are dumped: half the timeout, so that a wedged rank's
        are written before its peers' timeout aborts the job."""
        return self.timeout / 2

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self.stacks_after, repeat=False, file=self._stacks)

    def dump_stacks(self, why: str) -> None:
        """Append every thread's Python stacks to this rank's stacks file, after a line saying why."""
        if self._stacks is None:
            return
        try:
            self._stacks.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {why} ---\n")
            self._stacks.flush()
            faulthandler.dump_traceback(file=self._stacks, all_threads=True)
        except (OSError, ValueError):
            pass

    def _request_path(self) -> Path:
        return self.heartbeats.directory / STACKS_REQUEST

    def _request_time(self) -> float:
        try:
            return self._request_path().stat().st_mtime
        except OSError:
            return 0.0

    def request_stacks(self) -> None:
        """Ask every rank for its stacks (each answers at its next beat)."""
        try:
            self._request_path().write_text(f"{self.heartbeats.rank}\n")
            self._asked = self._request_time()
        except OSError:
            pass

    def _answer_request(self) -> None:
        asked = self._request_time()
        if asked > self._asked:
            self._asked = asked
            self.dump_stacks("another rank reported a stall and asked for every rank's stacks")

    def enter(self, label: str, count: bool = True, peer: int | None = None) -> None:
        """Start timing a wait; ``count=False`` and the ``peer`` world rank for point-to-point waits, which only some
        ranks make (the collective sequence numbers must stay comparable across ranks)."""
        self.seq += count
        self._label = label
        self._peer = peer
        self.heartbeats.write(self.seq, label)
        self._entered = self.clock()

    def leave(self) -> None:
        self._entered = None

    def _run(self) -> None:
        last = self.clock()
        while not self._stop.wait(self.beat_s):
            self.heartbeats.beat()
            if self._stacks is not None:
                self._arm()  # the dump is due only once this thread misses the beats of half the timeout
                self._answer_request()
            if self.check(last):
                return
            last = self.clock()

    def check(self, last: float) -> bool:
        """One round of the watch (``last``: the clock at the previous round); True once it has called on_timeout."""
        now = self.clock()
        paused = now - last - self.beat_s
        if paused > 0 and self._continued():  # this process was stopped (the job paused): nobody's stall
            entered = self._entered
            if entered is not None:
                self._entered = entered + paused
            self._stopped_since.clear()
        entered = self._entered
        if entered is not None and now - entered > self.timeout:
            message = describe_stall(self.heartbeats, self.seq, self._label, now - entered, time.time(),
                                     self.stale_s, self._peer, stacks=self._stacks is not None)
            if self._stacks is not None:
                faulthandler.cancel_dump_traceback_later()
                self.dump_stacks(f"this rank timed out: {message}")
                self.request_stacks()
            self.on_timeout(message)
            return True
        stopped = self.stopped_launcher(now)
        if stopped:
            self.on_launcher_stopped(stopped)
            return True
        return False

    def stopped_launcher(self, now: float) -> str | None:
        """The message for a launcher process stopped (SIGSTOP, a stopped terminal job) longer than the timeout.

        A process counts as stopped from the round that first sees it so (never before it really stopped), so the
        job ends between ``timeout`` and ``timeout + beat_s`` after the stop.
        """
        for what, pid in self.launchers:
            if self._state(pid) not in ("T", "t"):
                self._stopped_since.pop(pid, None)
                continue
            since = self._stopped_since.setdefault(pid, now)
            if now - since > self.timeout:
                return (
                    f"{what} has been stopped for {now - since:.0f} s (longer than distributed.collective_timeout_s): "
                    f"the job cannot report or finish while it is; aborting the job, the last complete checkpoint is "
                    f"kept. Resume it with SIGCONT (or `fg`) within the timeout to keep the job"
                )
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._stacks is not None:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.unregister(signal.SIGUSR2)
            self._stacks.close()
            self._stacks = None
