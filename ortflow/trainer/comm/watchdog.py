"""Heartbeats and the collective watchdog.

Each rank records, in a small heartbeat file, the sequence number and label of the collective it last entered. A rank
that waits longer than the timeout reads the other ranks' records, names those that never arrived (and where they
were last seen), and aborts the whole job.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_RECORD = struct.Struct("<qd48s")  # collective sequence number, wall time entered, label


class Heartbeats:
    """One fixed-size record per rank in ``directory``: the collective it last entered, and when."""

    def __init__(self, directory: Path, rank: int, size: int):
        self.directory = directory
        self.size = size
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank-{rank:05d}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write(0, "start")

    def write(self, seq: int, label: str) -> None:
        os.pwrite(self._fd, _RECORD.pack(seq, time.time(), label.encode()[:48]), 0)

    def read(self, rank: int) -> tuple[int, float, str] | None:
        try:
            data = (self.directory / f"rank-{rank:05d}").read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < _RECORD.size:
            return None
        seq, when, label = _RECORD.unpack(data[: _RECORD.size])
        return seq, when, label.rstrip(b"\0").decode(errors="replace")

    def close(self) -> None:
        os.close(self._fd)


def describe_stall(heartbeats: Heartbeats, my_seq: int, label: str, waited: float, now: float,
                   peer: int | None = None) -> str:
    """The message a waiting rank prints: which ranks never reached collective ``my_seq``, and where they are.

    For a point-to-point wait (``peer`` given) the stalled rank is the peer, wherever it is.
    """
    stalled = []
    for rank in range(heartbeats.size) if peer is None else [peer]:
        record = heartbeats.read(rank)
        if peer is not None and record is not None:
            stalled.append(f"rank {rank} (last entered #{record[0]} '{record[2]}' {now - record[1]:.0f} s ago)")
        elif record is None:
            stalled.append(f"rank {rank} (no heartbeat: it never started)")
        elif record[0] < my_seq:
            seq, when, where = record
            stalled.append(f"rank {rank} (last entered collective #{seq} '{where}' {now - when:.0f} s ago)")
    names = "; ".join(stalled) or "none found (a rank may have entered late; check the logs)"
    return (
        f"collective #{my_seq} '{label}' waited {waited:.0f} s (distributed.collective_timeout_s); "
        f"stalled: {names}. Aborting the job; the last complete checkpoint is kept."
    )


class Watchdog:
    """Aborts the job when the current collective exceeds ``timeout`` seconds."""

    def __init__(self, timeout: float, heartbeats: Heartbeats, on_timeout: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.heartbeats = heartbeats
        self.on_timeout = on_timeout
        self.clock = clock
        self.seq = 0
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
        poll = min(1.0, self.timeout / 10)
        while not self._stop.wait(poll):
            entered = self._entered
            if entered is not None and self.clock() - entered > self.timeout:
                waited = self.clock() - entered
                self.on_timeout(describe_stall(self.heartbeats, self.seq, self._label, waited, time.time(), self._peer))
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
