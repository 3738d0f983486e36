"""Whether a local process still runs, and waiting for it to exit: what the ranks' lifeline, the job's guard and the
serving process share (Linux ``/proc`` and pidfds; a zombie, exited but not yet reaped, counts as gone)."""

from __future__ import annotations

import os
import select
import threading


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (False for a zombie or a pid that is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has exited (a zombie has); returns at once if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd (kernel < 5.3): poll, treating a zombie as dead
        while process_alive(pid):
            threading.Event().wait(0.5)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll(None):
            pass
    finally:
        os.close(fd)
