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
"""

from __future__ import annotations

import os
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
                   stale_s: float = float("inf"), peer: int | None = None) -> str:
    """The message a waiting rank prints: which ranks are stalled, and where they are.

    A rank is stalled when it never reached collective ``my_seq`` or when its liveness beat is older than
    ``stale_s`` (stopped or wedged, possibly inside this same collective). For a point-to-point wait (``peer``
    given) the stalled rank is the peer, wherever it is.
    """
    stalled = []
    for rank in range(heartbeats.size) if peer is None else [peer]:
        record = heartbeats.read(rank)
        if record is None:
            stalled.append(f"rank {rank} (no heartbeat: it never started)")
            continue
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
    names = "; ".join(stalled) or "none found (every rank is alive and arrived; check the logs)"
    return (
        f"collective #{my_seq} '{label}' waited {waited:.0f} s (distributed.collective_timeout_s); "
        f"stalled: {names}. Aborting the job; the last complete checkpoint is kept."
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
    """

    def __init__(self, timeout: float, heartbeats: Heartbeats, on_timeout: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, launchers: tuple[tuple[str, int], ...] = (),
                 state: Callable[[int], str | None] = process_state,
                 on_launcher_stopped: Callable[[str], None] | None = None,
                 continued: Callable[[], bool] = lambda: False):
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
        self._thread = threading.Thread(target=self._run, name="ortflow-watchdog", daemon=True)
        self._thread.start()

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
                                     self.stale_s, self._peer)
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
