"""Whether a local process or process group still runs, and waiting for a process to exit: what the ranks' lifeline,
the job's guard and the serving process share (Linux ``/proc`` and pidfds; a zombie, exited but not yet reaped,
counts as gone)."""

from __future__ import annotations

import os
import select
import threading


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (False for a zombie or a pid that is gone)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting for their reaper do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            return True
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
