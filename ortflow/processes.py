"""Whether a local process or process group still runs, and waiting for a process to exit: what the ranks' lifeline,
the job's guard and the serving process share (Linux ``/proc`` and pidfds; a zombie, exited but not yet reaped,
counts as gone); the shared-memory segments that ranks which died left behind; and a launcher's process tree (MPICH
starts each proxy and rank in a session of its own), to watch or to kill; and finishing a step of a stop while the
stop signal repeats."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

#: Where MPICH keeps its shared-memory segments, and their names' prefix.
SHM_DIR, MPICH_SHM_PREFIX = "/dev/shm", "mpich_shm_"


_T = TypeVar("_T")


def despite_repeated_stops(call: Callable[[], _T], on_repeat: Callable[[], None] = lambda: None) -> _T:
    """``call()`` to its end while a stop request repeats: a repeated interruption (KeyboardInterrupt, Prefect's
    ``TerminationSignal``, which Prefect raises for each SIGTERM during a flow run) calls ``on_repeat`` and then
    ``call`` again, so it must be safe to call again; errors, ``SystemExit`` and ``GeneratorExit`` go through."""
    while True:
        try:
            return call()
        except BaseException as err:  # noqa: BLE001 - only a repeated interruption is kept from going through
            if isinstance(err, (Exception, SystemExit, GeneratorExit)):
                raise
            on_repeat()


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


def remove_orphan_segments(since: float, directory: str = SHM_DIR, prefix: str = MPICH_SHM_PREFIX,
                           settle_s: float = 1.0) -> list[str]:
    """Remove the shared-memory segments ``directory/prefix*`` of this user, written at or after ``since`` (a
    ``time.time()`` value), that no process of this user maps.

    MPICH's ranks unlink their segment in ``MPI_Finalize``; ranks that are killed or abort leave it in ``/dev/shm``,
    a few MB of memory each until the host reboots. A segment that a live rank maps is kept; so is one that is not
    ``settle_s`` old yet when looked at again after waiting for it (at most ``settle_s``): a rank of another job
    between making and mapping it. Returns the removed paths.
    """
    uid = os.getuid()
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return []
    written = {}
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and st.st_mtime >= since:
            written[entry.path] = st.st_mtime
    if not written:
        return []
    time.sleep(max(0.0, min(settle_s, max(written.values()) + settle_s - time.time())))
    candidates = set(written)
    # Newest processes first (the ranks that map a live segment are recent): the scan ends once every segment is seen
    # mapped, sparing the maps of every other process of this user.
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int, reverse=True):
        if not candidates:
            break
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue  # another user's process cannot map this user's segments (MPICH makes them 0600)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    candidates.discard(line.split(maxsplit=5)[-1].strip())
        except OSError:
            continue  # gone meanwhile
    removed = []
    for path in sorted(candidates):
        try:
            if os.stat(path).st_mtime > time.time() - settle_s:
                continue  # written again just now: in use
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def launcher_tree(root: int, ranks: bool = False) -> list[tuple[int, str, str]]:
    """``(pid, name, state)`` of the launcher ``root`` and the MPI proxies below it (and every other process below it
    with ``ranks``)."""
    parents: dict[int, int] = {}
    info: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = tail.split()
        parents[int(entry)] = int(fields[1])
        info[int(entry)] = (head.split("(", 1)[1], fields[0])
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        name, state = info.get(pid, ("?", "?"))
        if pid == root or ranks or any(tag in name for tag in ("proxy", "prted", "orted")):
            found.append((pid, name, state))
        todo += [child for child, parent in parents.items() if parent == pid]
    return found


def kill_tree(root: int) -> None:
    """SIGKILL the launcher ``root``'s process group and every process below it: MPICH starts each proxy and rank in a
    session of its own, which a signal to the group does not reach (a stopped proxy would stay stopped for ever)."""
    below = [pid for pid, _name, _state in launcher_tree(root, ranks=True) if pid != root]
    try:
        os.killpg(root, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
