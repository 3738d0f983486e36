"""A job's guard: a small process, in a session of its own, that takes a local job over when its launching process is
killed, so that the ranks still stop with a stop checkpoint.

Whoever kills the launching process with SIGKILL (a Prefect process worker does so to its flow-run processes when
it is stopped, with no signal before it) gives it no chance to stop the ranks. The guard outlives it:

* the ranks follow the guard instead of the launching process (``ORTFLOW_LAUNCHER_PID`` names the guard), so they do
  not exit the moment the launching process dies;
* the guard holds the read end of the job's output pipe, so ``mpiexec`` can still write its ranks' lines (it would
  die of SIGPIPE otherwise), and copies them to its log once it has taken over;
* when the launching process exits without having told the guard that the job ended, the guard SIGTERMs the job's
  process group (every rank stops after the same update and writes a stop checkpoint), waits for the job to end
  within the stop grace (then SIGKILL), and calls its ``then`` function with the run folder (the Prefect flow run
  reports its final state there).

The launching process talks to the guard through the guard's standard input: ``job PGID`` once the job started,
``done`` when it no longer needs the guard (the job ended, or it stopped the job itself). When the launching process
asks the ranks to stop itself (a flow run cancelled, a task's time limit, Prefect's SIGTERM), it appends the job's
lines it reads from then on to the guard's log as it reads them (:class:`StopTranscript`): a process killed during
that stop has read lines it never forwarded, and the guard's report sends them on with its own.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from ortflow.processes import group_alive, wait_for_exit

#: The guard's log in the run folder (what it did, and the ranks' last lines once it took the job over).
GUARD_LOG = "launch-guard.log"


class JobGuard:
    """Start the guard of a job about to be launched from this process.

    Args:
        run_dir: The run folder (the guard's log goes there; ``then`` receives it).
        grace_s: How long the ranks get to write their stop checkpoint after the guard asks them to stop.
        then: ``module:function`` the guard calls with the run folder after it stopped an orphaned job (imported when
            the take-over starts, while the ranks stop; a released guard never imports it).
    """

    def __init__(self, run_dir: Path, grace_s: float, then: str | None = None):
        # The job's output: the launcher writes, this process reads, and the guard once this process is gone.
        self.read_fd, self.write_fd = os.pipe()
        cmd = [sys.executable, "-P", "-m", "ortflow.launch.guard", "--follow", str(os.getpid()), "--run-dir",
               str(run_dir), "--output-fd", str(self.read_fd), "--grace", str(grace_s)]
        if then:
            cmd += ["--then", then]
        with open(Path(run_dir) / GUARD_LOG, "a") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                         pass_fds=(self.read_fd,), start_new_session=True)

        self.transcript = StopTranscript(Path(run_dir) / GUARD_LOG)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def job_started(self, pgid: int) -> None:
        """Tell the guard the job's process group (the launcher's pid: it runs in a session of its own)."""
        self._say(f"job {pgid}")

    def release(self, timeout_s: float = 10.0) -> None:
        """The job ended or was stopped here: the guard exits."""
        self._say("done")
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _say(self, line: str) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the guard is gone: the ranks follow it and end, the job's own exit status says so


class StopTranscript:
    """The job's lines the launching process reads once it has asked the ranks to stop, appended to the guard's log
    ``log`` as they are read (one write per line, in append mode beside the guard's own writes), after a line that
    names the process. Before :meth:`start` it writes nothing."""

    def __init__(self, log: Path):
        self.log = log
        self._file: TextIO | None = None

    def start(self) -> None:
        """The launching process asks the ranks to stop now (once; later calls do nothing)."""
        if self._file is not None:
            return
        try:
            file = open(self.log, "a", buffering=1)  # noqa: SIM115 - open until this process exits
            file.write(f"{time.strftime('%H:%M:%S')} the launching process {os.getpid()} {_ASKED}\n")
        except OSError:
            return  # the transcript is a record: a run folder that cannot take it does not stop the stop
        self._file = file

    def write(self, line: str) -> None:
        """A line of the job's output (without its newline), read by the launching process."""
        if self._file is not None:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError):  # a full disk, a closed file: the line is forwarded all the same
                pass


#: The guard's log line that starts a take-over (what follows it is the job's output and the guard's own lines).
_TAKE_OVER = "is gone before its job ended"
#: The launching process's line in the guard's log before the job's lines it reads while it stops the job itself.
_ASKED = "asked the ranks to stop; the lines it read follow"
_PROCESS = re.compile(r"the launching process (\d+) ")


def taken_over_lines(log: Path) -> list[str]:
    """The job's output lines of its last take-over: those the guard copied to its log ``log``, and before them those
    the killed launching process had read while it was stopping the job itself (which it may or may not have
    forwarded before it was killed)."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return []
    starts = [i for i, line in enumerate(lines) if _TAKE_OVER in line]
    if not starts:
        return []
    start = starts[-1]
    killed = _PROCESS.search(lines[start])
    previous = starts[-2] if len(starts) > 1 else -1
    asked = [i for i in range(previous + 1, start) if _ASKED in lines[i] and killed
             and (found := _PROCESS.search(lines[i])) and found.group(1) == killed.group(1)]
    first = asked[-1] if asked else start
    return [line for line in lines[first + 1:] if not _OWN.match(line)]


_OWN = re.compile(r"^\d\d:\d\d:\d\d (asking the ranks|no job was started|the job did not stop|waiting for .* to "
                  r"import|reporting the stop|the launching process \d+ )")


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def _resolve(spec: str) -> Callable[[Path], object]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def take_over(pgid: int | None, output_fd: int, grace_s: float) -> bool:
    """Stop the orphaned job: SIGTERM its process group, copy its output to stdout until it ends, SIGKILL it when
    ``grace_s`` runs out.

    Returns:
        Whether the job ended within the grace period.
    """
    ended = threading.Event()

    def drain() -> None:
        with os.fdopen(output_fd, "r", errors="replace") as lines:
            for line in lines:
                sys.stdout.write(line)
                sys.stdout.flush()
        ended.set()  # every process of the job has closed its output: the job is over

    threading.Thread(target=drain, name="ortflow-guard-output", daemon=True).start()
    if pgid is None:
        _say("no job was started")
        return True
    _say(f"asking the ranks (process group {pgid}) to stop after the current update ({grace_s:.0f} s grace)")
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if ended.wait(0.2) or not group_alive(pgid):
            ended.wait(2.0)  # the last lines
            return True
    _say(f"the job did not stop within {grace_s:.0f} s: ending it")
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortflow.launch.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--follow", type=int, required=True, help="pid of the launching process")
    parser.add_argument("--run-dir", type=Path, required=True, help="the run folder")
    parser.add_argument("--output-fd", type=int, required=True, help="read end of the job's output pipe")
    parser.add_argument("--grace", type=float, required=True, help="seconds the ranks get to stop")
    parser.add_argument("--then", help="module:function called with the run folder after an orphaned job stopped")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launching process, not the guard
    job: dict[str, int] = {}
    released, finished = threading.Event(), threading.Event()

    def control() -> None:
        for line in sys.stdin:
            word, _, value = line.strip().partition(" ")
            if word == "job" and value.isdigit():
                job["pgid"] = int(value)
            elif word == "done":
                released.set()
                break
        finished.set()  # released, or the launching process closed its end (it exited)

    def follow() -> None:
        wait_for_exit(args.follow)
        finished.set()

    reader = threading.Thread(target=control, name="ortflow-guard-control", daemon=True)
    reader.start()
    threading.Thread(target=follow, name="ortflow-guard-follow", daemon=True).start()
    finished.wait()
    reader.join(5.0)  # a "done" written just before the launching process exited is still in the pipe
    if released.is_set():
        return 0  # the usual end: nothing to report, so ``then`` (Prefect's client, a second of CPU) is never imported
    then: list[Callable[[Path], object]] = []
    # Imported while the ranks stop (they finish their update and write a stop checkpoint), so that the report
    # seldom waits for it.
    loader = threading.Thread(target=lambda: then.append(_resolve(args.then)) if args.then else None,
                              name="ortflow-guard-import", daemon=True)
    loader.start()
    wait_for_exit(args.follow)
    _say(f"the launching process {args.follow} {_TAKE_OVER}")
    take_over(job.get("pgid"), args.output_fd, args.grace)
    if loader.is_alive():
        _say(f"waiting for {args.then} to import")
    loader.join()
    if then:
        _say(f"reporting the stop ({args.then})")
    for report in then:
        report(args.run_dir)
    return 0 if then or not args.then else 1


if __name__ == "__main__":
    sys.exit(main())
