"""Process helpers for the fault tests: start ``ortflow train``, find its process tree, signal parts of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ortflow.trainer.metrics import read_progress

ORTFLOW = str(Path(sys.executable).parent / "ortflow")


def children_map() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (not zombies)."""
    tree, out, todo = children_map(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ranks_of(pid: int) -> list[int]:
    """The rank processes (``-m ortflow.trainer`` or a test entry) below ``pid``."""
    return [p for p in descendants(pid) if "ortflow.trainer" in cmdline(p) or "inject.py" in cmdline(p)]


def launcher_of(pid: int) -> int | None:
    """The mpiexec process below ``pid``."""
    return next((p for p in descendants(pid) if os.path.basename(cmdline(p).split(" ")[0]) == "mpiexec"), None)


def start_train(run_dir: Path, *extra: str) -> subprocess.Popen:
    """``ortflow train RUN_DIR`` in its own session, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([ORTFLOW, "train", str(run_dir), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)


class Lines(list):
    """The output lines of a job, appended by a reader thread as they come (see :func:`drain`)."""

    reader: threading.Thread

    def complete(self, timeout: float = 60) -> list[str]:
        """Wait until the reader has read the output to its end (every process holding the pipe has exited) and
        return the lines; raises if the pipe is still open after ``timeout`` s."""
        self.reader.join(timeout)
        if self.reader.is_alive():
            raise TimeoutError(f"the job's output was still open {timeout:g} s later (a process of it lives on)")
        return list(self)


def drain(proc: subprocess.Popen) -> Lines:
    """Read the job's output in a thread into the returned list: a job whose pipe nobody reads blocks on a full pipe
    (64 KB, a few hundred progress lines), and a blocked ``ortflow train`` cannot exit when a rank is killed."""
    lines = Lines()
    lines.reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    lines.reader.start()
    return lines


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until the run's progress record reaches ``step``; returns the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_progress(run_dir)
        if record and record.get("step", 0) >= step:
            return record["step"]
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) before step {step}: {proc.stdout.read()}")
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} within {timeout} s")


def wait_for_line(lines: list[str], text: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    """Wait until a line containing ``text`` is in ``lines`` (filled by :func:`drain`); returns that line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((line for line in list(lines) if text in line), None)
        if found is not None:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {proc.returncode}) without printing {text!r}")
        time.sleep(0.05)
    raise TimeoutError(f"no line with {text!r} within {timeout} s")


def signal_target(proc: subprocess.Popen, target: str, sig: int) -> list[int]:
    """Send ``sig`` to part of the job: cli, launcher, group (the launcher's process group) or all. Returns pids."""
    launcher = launcher_of(proc.pid)
    if target == "cli":
        pids = [proc.pid]
    elif target == "launcher":
        pids = [launcher]
    elif target == "group":
        os.killpg(launcher, sig)
        return [launcher]
    elif target == "all":  # docker stop, systemd, Kubernetes: every process of the tree at once
        pids = [proc.pid, *descendants(proc.pid)]
    else:
        raise ValueError(target)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it (test cleanup)."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, T for stopped, Z), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def ortflow_here(*args: str) -> subprocess.CompletedProcess:
    """``ortflow ARGS`` run in this process (no interpreter start, no imports again): its exit status and its output
    (both streams) in ``.stdout``. For checks of what a command says and its status; an exception the command let
    escape is appended as the traceback a terminal would show. Commands that start ranks launch them as usual."""
    import traceback

    from typer.testing import CliRunner

    from ortflow.cli.app import app

    result = CliRunner().invoke(app, list(args))
    out = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        out += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess([ORTFLOW, *args], result.exit_code, out)
