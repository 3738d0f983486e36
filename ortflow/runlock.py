"""One writer per run folder: an OS-level lock (``fcntl.flock``) on ``<folder>/.ortflow/lock``.

Whoever trains or writes a run folder holds its lock for as long as it does: the train stage and ``ortflow train``
(the ranks' parent), and the pipeline flow for the whole of its run. The holder writes its pid, host, flow-run id
and start time into the lock file, so a second writer is refused at once with a message naming it, or waits when
asked to. The kernel releases a ``flock`` when its holder's last file descriptor closes, so a lock left by a
process that died (killed, crashed, a zombie that has closed its files) never blocks anyone.

Locks are re-entrant within one process: the flow holds the run folder and its train task (same process, maybe
another thread) takes the same lock again without blocking itself.

This module imports nothing from ortflow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK_DIR = ".ortflow"
LOCK_NAME = "lock"


class RunFolderLocked(RuntimeError):
    """Another live process holds the run folder's lock; ``holder`` says who."""

    def __init__(self, folder: Path, holder: Holder | None, waited_s: float | None = None):
        self.folder = folder
        self.holder = holder
        who = holder.describe() if holder else "another process (it recorded no details)"
        waited = f" after waiting {waited_s:.0f}s" if waited_s else ""
        super().__init__(
            f"{folder} is in use by {who}{waited}: one run writes a run folder at a time. Wait for it to finish (or "
            f"stop it), or use another output_dir; to queue behind it instead of failing, ask to wait for the lock"
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder's lock, as recorded in the lock file."""

    pid: int | None
    host: str | None
    flow_run_id: str | None
    since: float | None
    purpose: str | None

    def describe(self) -> str:
        """``pid 123 on host-a (flow run 5f3e..., train) since 03:12:04 UTC``."""
        parts = [f"pid {self.pid} on {self.host}"]
        detail = [p for p in (f"flow run {self.flow_run_id}" if self.flow_run_id else None, self.purpose) if p]
        if detail:
            parts.append(f"({', '.join(detail)})")
        if self.since:
            parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since)))
        return " ".join(parts)


def lock_path(folder: Path | str) -> Path:
    """The lock file of a run folder."""
    return Path(folder) / LOCK_DIR / LOCK_NAME


def _read_holder(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return Holder(data.get("pid"), data.get("host"), data.get("flow_run_id"), data.get("since"), data.get("purpose"))


# Locks this process holds: path -> [fd, depth]. flock conflicts between two descriptors of one process, so a nested
# acquire of a path this process already holds only counts.
_HELD: dict[str, list[int]] = {}
_HELD_GUARD = threading.Lock()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise


def holder(folder: Path | str) -> Holder | None:
    """Who holds the folder's lock now, or None when nobody does (a dead holder's lock counts as free).

    Args:
        folder: The run folder.

    Returns:
        The recorded holder while a live process holds the lock (this one included), else None.
    """
    path = lock_path(folder)
    if str(path) in _HELD:
        return _read_holder(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if _try_flock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _read_holder(path) or Holder(None, None, None, None, None)
    finally:
        os.close(fd)


def _record(fd: int, flow_run_id: str | None, purpose: str | None) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "flow_run_id": flow_run_id, "since": time.time(),
            "purpose": purpose}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


@contextlib.contextmanager
def hold(
    folder: Path | str,
    wait: bool = False,
    timeout_s: float | None = None,
    flow_run_id: str | None = None,
    purpose: str | None = None,
    poll_s: float = 0.5,
) -> Iterator[Path]:
    """Hold the run folder's lock while the block runs.

    Args:
        folder: The run folder (created if missing).
        wait: Wait for the holder to finish instead of failing at once.
        timeout_s: With ``wait``, give up after this many seconds (None: wait as long as it takes).
        flow_run_id: Recorded for whoever is refused (the Prefect flow run doing the writing).
        purpose: Recorded too (``train``, ``pipeline``, ...).
        poll_s: Seconds between attempts while waiting.

    Yields:
        The lock file's path.

    Raises:
        RunFolderLocked: a live process holds the lock (at once, or after ``timeout_s`` when waiting).
    """
    path = lock_path(folder)
    key = str(path)
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield path
        finally:
            with _HELD_GUARD:
                _HELD[key][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        while not _try_flock(fd):
            waited = time.monotonic() - started
            if not wait or (timeout_s is not None and waited >= timeout_s):
                raise RunFolderLocked(Path(folder), _read_holder(path), waited if wait else None)
            time.sleep(poll_s)
        _record(fd, flow_run_id, purpose)
        with _HELD_GUARD:
            _HELD[key] = [fd, 1]
        try:
            yield path
        finally:
            with _HELD_GUARD:
                del _HELD[key]
            os.ftruncate(fd, 0)  # the file stays (unlinking a lock file races with the next opener)
    finally:
        os.close(fd)  # releases the flock


def training_folders(output_dir: Path | str, checkpoints_dir: Path | str) -> list[Path]:
    """The folders a training run writes and must hold alone: its run folder, and its checkpoint folder when that
    lies outside it (``checkpoint.dir``), so two runs pointed at one checkpoint folder cannot both write it."""
    run, ckpt = Path(output_dir).resolve(), Path(checkpoints_dir).resolve()
    return [run] if ckpt.is_relative_to(run) else [run, ckpt]


@contextlib.contextmanager
def hold_all(folders: list[Path], **kwargs) -> Iterator[list[Path]]:
    """Hold the locks of several folders (in sorted order, so two holders cannot deadlock); see :func:`hold`."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(hold(folder, **kwargs)) for folder in sorted(folders)]
