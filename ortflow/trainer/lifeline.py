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
import signal
import socket
import sys
import threading
from collections.abc import Callable

from ortflow.processes import wait_for_exit
from ortflow.protocol import EXIT_ORPHANED, LAUNCHER_HOST_ENV, LAUNCHER_PID_ENV

log = logging.getLogger(__name__)

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
        wait_for_exit(pid)
        on_death(pid)

    threading.Thread(target=watch, name="ortflow-lifeline", daemon=True).start()
    return pid


def _command(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return None
    return " ".join(w.decode(errors="replace") for w in words[:3] if w) or None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def launcher_processes(environ: dict[str, str] | os._Environ = os.environ) -> tuple[tuple[str, int], ...]:
    """``(description, pid)`` of the processes between this rank and the user on this host, for the watchdog.

    They are the rank's MPI proxy (its parent), ``mpiexec`` (the proxy's parent, on the launching host) and the
    launching process (``ortflow train`` or the flow, from the environment ``launch()`` sets).
    """
    found: list[tuple[str, int]] = []
    proxy = os.getppid()
    name = _command(proxy) or ""
    if "proxy" in name or "prted" in name or "orted" in name:
        found.append((f"the MPI proxy '{name.split()[0].rsplit('/', 1)[-1]}' (pid {proxy})", proxy))
        mpiexec = _parent_of(proxy)
        command = _command(mpiexec) if mpiexec else None
        if mpiexec and command and "mpiexec" in command.split()[0]:
            found.append((f"the launcher 'mpiexec' (pid {mpiexec})", mpiexec))
    try:
        pid = int(environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        pid = None
    if pid and environ.get(LAUNCHER_HOST_ENV) == socket.gethostname() and pid not in (p for _, p in found):
        found.append((f"the launching process '{_command(pid) or pid}' (pid {pid})", pid))
    return tuple(found)


def continued_signal() -> Callable[[], bool]:
    """A function that says whether this process has been continued (SIGCONT) since its previous call.

    Python runs signal handlers in the main thread only, between bytecodes, so a rank blocked in a collective would
    not see the signal in time; the interpreter's wakeup descriptor is written at once, by its C-level handler, and a
    watchdog thread reads it. Main thread only (where it cannot be set up, the function always says False).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: False
    read_end, write_end = os.pipe()
    for fd in (read_end, write_end):
        os.set_blocking(fd, False)
    try:
        signal.signal(signal.SIGCONT, lambda _signum, _frame: None)  # a Python handler: the C handler wakes the fd
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_end)
        os.close(write_end)
        return lambda: False

    def continued() -> bool:
        seen = False
        try:
            while True:
                data = os.read(read_end, 512)
                if not data:
                    break
                seen = seen or signal.SIGCONT in data
        except BlockingIOError:
            pass
        return seen

    return continued

