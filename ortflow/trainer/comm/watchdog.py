"""Heartbeats and the collective watchdog.

Each rank keeps one small heartbeat file with two independent parts:

* the sequence number, time and label of the collective it last entered (written by the rank's main thread), and
* a liveness timestamp, refreshed every ``beat_s`` by the watchdog thread whether or not the rank is in a collective.

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
#: Folder of the run folder that holds the heartbeats (and stall messages).
HEARTBEAT_DIR = ".ranks"
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


class Watchdog:
    """Beats the heartbeat and aborts the job when the current collective exceeds ``timeout`` seconds."""

    def __init__(self, timeout: float, heartbeats: Heartbeats, on_timeout: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.heartbeats = heartbeats
        self.on_timeout = on_timeout
        self.clock = clock
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
        while not self._stop.wait(self.beat_s):
            self.heartbeats.beat()
            entered = self._entered
            if entered is not None and self.clock() - entered > self.timeout:
                waited = self.clock() - entered
                message = describe_stall(self.heartbeats, self.seq, self._label, waited, time.time(), self.stale_s,
                                         self._peer)
                self.on_timeout(message)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
