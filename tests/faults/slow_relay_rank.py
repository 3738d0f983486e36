"""Test-only rank entry: ``python -m ortflow.trainer RUN_DIR`` whose output relays are slow to queue what they read
(python slow_relay_rank.py RUN_DIR).

Each relay's reader thread takes a chunk of the rank's output from its pipe and only then, half a second later, queues
it for the launcher: the moment a reader spends waiting for the interpreter's lock while the main thread runs on,
made long enough that the main thread always reaches its exit inside it. A rank that exits right after its last
message must still pass that message on.
"""

import os
import sys
import threading
import time

import ortflow.trainer.__main__ as entry

#: How long a relay's reader holds each chunk it has read before it queues it.
HOLD_S = 0.5

_real_read = os.read


def _slow_read(fd: int, size: int) -> bytes:
    data = _real_read(fd, size)
    if data and threading.current_thread().name.startswith("ortflow-output-read"):
        time.sleep(HOLD_S)
    return data


os.read = _slow_read
sys.exit(entry.main(sys.argv[1:]))
