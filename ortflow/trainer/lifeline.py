"""A rank follows the processes that started it: when they die, it exits within about a second.

Two links, because two processes can die:

* The rank's parent (MPICH's ``hydra_pmi_proxy``, or Open MPI's ``prted``): the kernel sends SIGKILL to the rank when
  it dies (``prctl(PR_SET_PDEATHSIG)``, set through ctypes; Linux only, a no-op elsewhere).
* The process that called :func:`ortflow.launch.local.launch` (``ortflow train``, or the Prefect flow): the launcher
  sits between it and the ranks, in its own session, and only noticed its death at its next output line (seconds
  later, mid-checkpoint). The launching process exports its pid and host name; a daemon thread in each rank on the
  same host waits on a pidfd of that pid (no polling, and a zombie counts as dead) and ends the rank when it exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Environment variables the launching process sets for its ranks (``ortflow.launch.local.launcher_environment``).
LAUNCHER_PID_ENV = "ORTFLOW_LAUNCHER_PID"
LAUNCHER_HOST_ENV = "ORTFLOW_LAUNCHER_HOST"
#: Exit status of a rank ended because its launching process died.
EXIT_ORPHANED = 137
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect: the kernel will never send the signal
        os.kill(os.getpid(), sig)
    return True


def _wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has exited (a zombie has); returns at once if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd (kernel < 5.3): poll, treating a zombie as dead
        while _alive(pid):
            threading.Event().wait(0.5)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll(None):
            pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _orphaned(pid: int) -> None:
    try:
        sys.stderr.write(f"ERROR: the launching process {pid} is gone; this rank exits now (no orphaned ranks)\n")
        sys.stderr.flush()
    except OSError:
        pass  # its output pipe may be gone with it
    os._exit(EXIT_ORPHANED)


def follow_launcher(environ: dict[str, str] | os._Environ = os.environ,
                    on_death: Callable[[int], None] = _orphaned) -> int | None:
    """Start a daemon thread that calls ``on_death(pid)`` when the launching process exits.

    Returns:
        The pid followed, or None (not started by ``launch()``, or launched from another host).
    """
    try:
        pid = int(environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return None
    if environ.get(LAUNCHER_HOST_ENV) != socket.gethostname():
        return None  # a pid means nothing on another host; there the launcher's own proxies end the ranks

    def watch() -> None:
        _wait_for_exit(pid)
        on_death(pid)

    threading.Thread(target=watch, name="ortflow-lifeline", daemon=True).start()
    return pid
