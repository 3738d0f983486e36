"""Rank output that never blocks the rank.

A rank's stdout and stderr are pipes to the launcher (``hydra_pmi_proxy``, then ``mpiexec``, then ``ortflow train``
or the flow). When any of them stops reading (stopped with SIGSTOP, wedged, busy), the pipes fill and the
next ``print`` or log line, Python's or the engine's own C++ one, blocks the rank inside a weight update, and with
it every other rank at the next collective, the watchdog's own message included.

:func:`never_block` puts a relay between each of the two descriptors and the launcher: fd 1 and fd 2 become the write
ends of private pipes that a reader thread empties at once into a bounded buffer, and a writer thread passes the
buffer on to the launcher, blocking only itself. When the launcher reads again, the buffer flows out. When the buffer
is full, new output is dropped and counted, and a line saying how much was dropped is written once the launcher reads
again. At exit the buffer is given a bounded time to drain: until every byte written before it is in the launcher's
pipe, counted wherever it is on the way (the private pipe, the buffer, the writer's hands).
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import select
import sys
import termios
import threading
import time
from collections import deque

#: Output a rank keeps while its launcher does not read (per stream); beyond it output is dropped and counted.
BUFFER_BYTES = 8 << 20
#: At exit, how long the buffered output may take to reach the launcher before the rank exits anyway.
EXIT_DRAIN_S = 2.0


class Relay:
    """The relay of one descriptor (1 or 2): a pipe in front of it, and the threads that empty the pipe."""

    def __init__(self, fd: int, limit: int = BUFFER_BYTES):
        self.fd = fd
        self.limit = limit
        self._target = os.dup(fd)  # the launcher's pipe
        read_end, write_end = os.pipe()
        os.set_inheritable(read_end, False)
        os.set_blocking(read_end, False)  # only the reader reads it, once poll says there is output
        os.dup2(write_end, fd)
        os.close(write_end)
        self._read_end = read_end
        self._chunks: deque[bytes] = deque()
        self._held = 0
        self.dropped = 0
        self._cond = threading.Condition()
        self._writing = False
        threading.Thread(target=self._read, name=f"ortflow-output-read-{fd}", daemon=True).start()
        threading.Thread(target=self._write, name=f"ortflow-output-write-{fd}", daemon=True).start()

    def _read(self) -> None:
        # Output moves from the pipe into the buffer under the lock, in one step, so that pending() finds every byte
        # in one or the other. Read outside the lock, the bytes the reader has taken but not yet queued would be
        # counted nowhere, and a rank exiting right after its last message (a refused config, then exit 1) would end
        # with that message in the reader's hands: lost, whether its output goes to a pipe or a file.
        poller = select.poll()
        poller.register(self._read_end, select.POLLIN)
        while True:
            poller.poll()  # wait for output without taking it
            with self._cond:
                try:
                    data = os.read(self._read_end, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                if self._held + len(data) > self.limit:
                    self.dropped += len(data)  # the launcher is not reading: drop, never block the rank
                else:
                    self._chunks.append(data)
                    self._held += len(data)
                self._cond.notify()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._chunks and not self.dropped:
                    self._cond.wait()
                if self._chunks:
                    data = self._chunks.popleft()
                    self._held -= len(data)
                else:
                    data = (f"[ortflow] {self.dropped} bytes of this rank's output were dropped while the launcher "
                            f"was not reading it\n").encode()
                    self.dropped = 0
                self._writing = True
            try:
                _write_all(self._target, data)
            except OSError:
                pass  # the launcher is gone: output has nowhere to go
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def pending(self) -> int:
        """Bytes written by the rank that have not reached the launcher yet (1 for a count of dropped bytes not yet
        reported, and for a chunk being written)."""
        queued = array.array("i", [0])
        with self._cond:  # nothing moves between the pipe, the buffer and the writer meanwhile
            try:
                fcntl.ioctl(self._read_end, termios.FIONREAD, queued)
            except OSError:
                queued[0] = 0
            return queued[0] + self._held + (1 if self.dropped else 0) + (1 if self._writing else 0)

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything written so far has been passed on (or ``timeout_s``); True when it has."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_RELAYS: list[Relay] = []


def never_block(limit: int = BUFFER_BYTES) -> list[Relay]:
    """Relay this process's stdout and stderr so that writing to them never blocks (once per process).

    Returns:
        The two relays (their ``dropped`` counts are what is being held back).
    """
    if _RELAYS:
        return _RELAYS
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _RELAYS.extend(Relay(fd, limit) for fd in (1, 2))
    atexit.register(_drain_at_exit)
    return _RELAYS


def _drain_at_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + EXIT_DRAIN_S
    for relay in _RELAYS:
        relay.drain(max(0.0, deadline - time.monotonic()))
