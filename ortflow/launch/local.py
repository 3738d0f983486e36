"""The local launcher: build the ``mpiexec`` command, stream every rank's output with its rank, return the exit status.

The bundled MPICH (``mpiexec`` next to this Python, from the ``mpich`` wheel) is the default; a system Open MPI
works too (``--mpiexec /usr/bin/mpirun``). Multi-node runs pass the launcher's host file; every host needs the same
Python environment at the same path and the run folder on a shared filesystem.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ortflow.launch.guard import JobGuard, StopTranscript
from ortflow.launch.job import (
    STOP_GRACE_S,
    JobState,
    LaunchError,
    LaunchResult,
    Phase,
    is_error_line,
    watch,
    write_record,
)
from ortflow.processes import SHM_DIR, kill_tree, launcher_tree, remove_orphan_segments
from ortflow.protocol import (
    EXIT_STALLED,
    HEARTBEAT_DIR,
    LAUNCHER_HOST_ENV,
    LAUNCHER_PID_ENV,
    NUM_RANKS_ENV,
    THREADS_ENV,
)

__all__ = ["STOP_GRACE_S", "LaunchError", "LaunchResult", "LocalJob", "build_command", "find_mpiexec", "launch",
           "launcher_environment", "launcher_flavor", "is_error_line", "rank_environment"]

log = logging.getLogger(__name__)


def find_mpiexec(explicit: str | Path | None = None) -> Path:
    """The launcher: ``explicit``, else the one installed beside this Python, else ``mpiexec`` on PATH."""
    candidates = [Path(explicit)] if explicit else [Path(sys.executable).parent / "mpiexec"]
    if not explicit and (found := shutil.which("mpiexec")):
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.exists() and os.access(candidate, os.X_OK):
            return candidate
    raise LaunchError(
        f"no MPI launcher found (looked for {', '.join(map(str, candidates))}): install ortflow with its pinned "
        "dependencies (the mpich wheel brings mpiexec) or pass --mpiexec /path/to/mpirun"
    )


def launcher_flavor(mpiexec: Path) -> str:
    """``mpich`` or ``openmpi``, from the launcher's ``--version``."""
    try:
        out = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LaunchError(f"{mpiexec} --version failed: {err}") from None
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def build_command(
    run_dir: Path, num_ranks: int, mpiexec: Path, flavor: str, hostfile: Path | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The full launcher command line for ``num_ranks`` ranks of ``python -m ortflow.trainer RUN_DIR``."""
    cmd = [str(mpiexec), "-n", str(num_ranks)]
    if flavor == "openmpi":
        cmd += ["--tag-output"]
        if os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        if hostfile:
            cmd += ["--hostfile", str(hostfile)]
    else:
        cmd += ["-prepend-rank"]
        if hostfile:
            cmd += ["-f", str(hostfile)]
    # -P: the working folder is not put first on the import path, so a folder named `ortflow` there cannot shadow the
    # installed package in the ranks.
    return cmd + [python, "-u", "-P", "-m", "ortflow.trainer", str(run_dir)]


def rank_environment(num_ranks: int, num_hosts: int, threads: int | None, cores: int) -> dict[str, str]:
    """Environment for the ranks: math libraries get the rank's share of cores, so ranks do not oversubscribe."""
    per_rank = threads or max(1, cores // max(1, -(-num_ranks // num_hosts)))
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(per_rank)
    if threads:
        env[THREADS_ENV] = str(threads)  # the engine's intra-op pool (trainer.runtime.threads_per_rank)
    env[NUM_RANKS_ENV] = str(num_ranks)  # the world the launcher chose (--np, auto): ranks accept it
    env["PYTHONUNBUFFERED"] = "1"
    env.update(launcher_environment())  # ranks on this host exit within a second if this process dies
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the hosts we run on
    return env


def launcher_environment() -> dict[str, str]:
    """What the launching process exports so that its ranks can follow it."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), LAUNCHER_HOST_ENV: socket.gethostname()}


class LocalJob:
    """The ``mpiexec`` job on this host: its own process group, its merged output read by a thread.

    Args:
        cmd: The launcher command line.
        env: The ranks' environment.
        output: A pipe made beforehand (read end, write end) whose read end a guard holds too.
        transcript: Where the lines read after :meth:`cancel` also go, as they are read (the guard's log).
    """

    launcher = "local"
    job_id = None

    def __init__(self, cmd: list[str], env: dict[str, str], output: tuple[int, int] | None = None,
                 transcript: StopTranscript | None = None):
        self._transcript = transcript
        if output is None:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                start_new_session=True,
            )
            self._stream = self.proc.stdout
        else:  # a pipe made beforehand, whose read end a guard holds too
            read_fd, write_fd = output
            try:
                self.proc = subprocess.Popen(cmd, stdout=write_fd, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
            finally:
                os.close(write_fd)  # only the job writes: its end of output is the end of the job
            self._stream = os.fdopen(read_fd, "r", errors="replace")
        try:  # the job runs: an interruption from here on stops it (launch's watch does not own it yet)
            self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
            self._news = threading.Event()
            self._eof = threading.Event()
            threading.Thread(target=self._read, name="ortflow-launcher-output", daemon=True).start()
        except BaseException:
            _stop_unwatched(self.proc)
            raise

    def _read(self) -> None:
        for line in self._stream or ():
            line = line.rstrip("\n")
            if self._transcript is not None:
                self._transcript.write(line)  # on disk before it is forwarded: this process may be killed first
            self._lines.put(line)
            self._news.set()
        self._eof.set()
        self._news.set()
        if self._stream is not self.proc.stdout:
            self._stream.close()

    def wait(self, seconds: float) -> None:
        """Sleep until the job prints or ends, at most ``seconds`` (the pause between polls)."""
        self._news.wait(seconds)
        self._news.clear()

    def read_output(self) -> list[str]:
        lines = []
        while not self._lines.empty():
            lines.append(self._lines.get())
        return lines

    def poll(self) -> JobState:
        # Ended only once its output has been read to the end, so that no line is lost.
        if self.proc.poll() is None or not self._eof.is_set():
            return JobState(Phase.RUNNING, "running")
        return JobState(Phase.ENDED, f"exit status {self.proc.returncode}", self.proc.returncode)

    def cancel(self) -> None:
        """SIGTERM to the job's process group: every rank stops after the same update with a stop checkpoint.

        A SIGINT to ``ortflow train`` arrives here as well and is passed on as SIGTERM, because MPICH's mpiexec treats
        a second SIGINT as "kill now", and a process manager that signals every process at once has already sent it
        one.
        """
        if self._transcript is not None:
            self._transcript.start()
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        kill_tree(self.proc.pid)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def _stop_unwatched(proc: subprocess.Popen) -> None:
    """Stop a job whose launch was interrupted before it was watched, as the watch stops one: SIGTERM to its process
    group (the ranks stop after their current update), SIGKILL to its process tree after ``STOP_GRACE_S``."""
    grace_s = STOP_GRACE_S
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()


def launch(
    run_dir: Path,
    num_ranks: int,
    hostfile: Path | None = None,
    num_hosts: int = 1,
    threads: int | None = None,
    mpiexec: str | Path | None = None,
    on_line: Callable[[str], None] = print,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    forward_signals: bool = False,
    guard: JobGuard | None = None,
    deadline: float | None = None,
    received: list[int] | None = None,
) -> LaunchResult:
    """Run the training job and stream its output.

    Args:
        run_dir: Configured run folder (``ortflow configure`` and ``prepare-data`` done).
        num_ranks: Processes to start (the config's distributed.num_ranks).
        hostfile: Launcher host file for multi-node runs.
        num_hosts: Hosts in the host file (to share cores among local ranks).
        threads: Threads per rank (default: cores / local ranks).
        mpiexec: Launcher to use (default: the bundled MPICH).
        on_line: Receives every output line, already prefixed with its rank by the launcher.
        on_start: Receives the launcher process (to watch or stop it).
        forward_signals: Own SIGTERM/SIGINT while the job runs (``ortflow train``): they stop the ranks cleanly and
            the result carries the signal. Leave False where another framework owns the signals (Prefect).
        guard: A guard started for this job (:class:`ortflow.launch.guard.JobGuard`): the ranks follow it instead of
            this process, it holds the job's output pipe too, and it stops the job cleanly if this process is killed.
            Released here once the job ended or was stopped.
        deadline: ``time.monotonic()`` value at which the job is stopped (stop checkpoint) and
            :class:`ortflow.launch.job.TimeLimitReached` raised: a task's time limit.
        received: With ``forward_signals``, stop signals the command received before the job started (the job is
            stopped as soon as it starts); later ones are added.

    Returns:
        The exit status, the last error lines and the stop signal received. Otherwise (a KeyboardInterrupt, a task
        timeout, a cancelled flow) the job's process group gets SIGTERM (ranks stop after the current update) and,
        after STOP_GRACE_S, SIGKILL.
    """
    exe = find_mpiexec(mpiexec)
    flavor = launcher_flavor(exe)
    cmd = build_command(Path(run_dir).resolve(), num_ranks, exe, flavor, hostfile)
    env = rank_environment(num_ranks, num_hosts, threads, len(os.sched_getaffinity(0)))
    log.info("launching: %s", " ".join(cmd))
    started = time.time()
    if flavor == "mpich":  # what ranks of earlier jobs left when they were killed with their launcher
        reclaimed = remove_orphan_segments(0.0)
        if reclaimed:
            log.info("removed %d shared-memory segment(s) that ranks of earlier jobs left in %s", len(reclaimed),
                     SHM_DIR)
    if guard is not None:
        env[LAUNCHER_PID_ENV] = str(guard.pid)  # the ranks outlive this process as long as the guard does
    restore_pause = _keep_running_on_terminal_stop() if forward_signals else (lambda: None)  # before any rank runs
    try:
        job = LocalJob(cmd, env, output=(guard.read_fd, guard.write_fd) if guard is not None else None,
                       transcript=guard.transcript if guard is not None else None)
    except BaseException:
        restore_pause()
        if guard is not None:
            os.close(guard.read_fd)
            guard.release()
        raise
    # A task timeout arrives as an exception at any line: one that lands before the watch owns the job (which stops
    # the jobs it watches) stops the job here, so none is left running unwatched.
    stuck: list[str] = []  # a launcher process stopped longer than the collective timeout
    watcher = None
    try:
        if guard is not None:
            guard.job_started(job.proc.pid)
        write_record(run_dir, job.launcher, job.job_id)
        if on_start is not None:
            on_start(job.proc)
        watcher = _watch_stopped_launchers(job.proc, _collective_timeout(Path(run_dir)), stuck)
        result = watch(job, on_line, poll_s=1.0, grace_s=STOP_GRACE_S, forward_signals=forward_signals,
                       sleep=job.wait, deadline=deadline, received=received)
    except BaseException:
        if job.proc.poll() is None:
            _stop_unwatched(job.proc)
        raise
    finally:
        if watcher is not None:
            watcher.set()
        restore_pause()
        if guard is not None:
            guard.release()
    if stuck:  # the job was ended for a stopped launcher: the watchdog's status, whatever mpiexec's was
        result = dataclasses.replace(result, returncode=EXIT_STALLED)
    if not result.returncode:
        return result
    if flavor == "mpich":  # ranks that died before MPI_Finalize leave their shared memory behind
        removed = remove_orphan_segments(started)
        if removed:
            log.info("removed %d shared-memory segment(s) the job's ranks left in %s", len(removed), SHM_DIR)
    errors = deque(result.error_lines, maxlen=20)
    for line in [*stuck, *_stall_messages(Path(run_dir), started, seen=errors)]:
        errors.append(line)
        on_line(line)
    return dataclasses.replace(result, error_lines=tuple(errors))


def _stall_messages(run_dir: Path, since: float, seen: deque[str]) -> list[str]:
    """The watchdog's messages of this job that the abort kept out of the stream (each rank also left a file)."""
    lines = []
    for path in sorted((run_dir / HEARTBEAT_DIR).glob("stall-rank-*.txt")):
        try:
            if path.stat().st_mtime < since:
                continue
            text = path.read_text().strip()
        except OSError:
            continue
        if text and not any(text in line for line in seen):
            lines.append(f"[watchdog {path.stem.removeprefix('stall-')}] {text}")
    return lines


def _keep_running_on_terminal_stop() -> Callable[[], None]:
    """Ctrl-Z (SIGTSTP) does not pause a training job: ``ortflow train`` ignores it, says so, and the job runs on.

    A paused job cannot be kept whole: the ranks, their proxies and ``mpiexec`` each run in a session of their own
    (the terminal's SIGTSTP reaches none of them), a rank paused longer than ``distributed.collective_timeout_s``
    aborts its peers, and a paused ``ortflow train`` that is then killed cannot end the processes it stopped. To halt
    training, Ctrl-C stops every rank after the same update with a stop checkpoint; ``ortflow train RUN_DIR`` resumes
    it. Main thread only (signal handlers).

    Returns:
        A function that restores the previous handler.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def refuse(_signum: int, _frame: object) -> None:
        log.warning("Ctrl-Z does not pause training (the ranks would time out): the job runs on; Ctrl-C stops it "
                    "with a checkpoint and `ortflow train RUN_DIR` resumes it")

    previous = signal.signal(signal.SIGTSTP, refuse)
    return lambda: signal.signal(signal.SIGTSTP, previous) and None


def _collective_timeout(run_dir: Path) -> float | None:
    """The run's ``distributed.collective_timeout_s`` (None when the run folder holds no readable config)."""
    from ortflow.config import ConfigError, load_run_config

    try:
        return load_run_config(run_dir).distributed.collective_timeout_s
    except (ConfigError, OSError):
        return None


def _watch_stopped_launchers(proc: subprocess.Popen, timeout_s: float | None, stuck: list[str],
                             poll_s: float = 0.5) -> threading.Event:
    """Watch ``mpiexec`` and its proxies: one stopped longer than ``timeout_s`` (+1 s) gets the job killed, named.

    The ranks cannot finish, or even abort, through a stopped launcher. Time this process itself was stopped (SIGSTOP
    from outside, then SIGCONT) is not counted.

    Returns:
        An event that ends the watch when set.
    """
    done = threading.Event()
    if timeout_s is None or not os.path.isdir("/proc"):
        return done

    def watch() -> None:
        since: dict[int, float] = {}
        last = time.monotonic()
        while not done.wait(poll_s):
            now = time.monotonic()
            if now - last > poll_s + 2.0:  # this process was stopped: start counting again
                since.clear()
            last = now
            for pid, name, state in launcher_tree(proc.pid):
                if state not in ("T", "t"):
                    since.pop(pid, None)
                    continue
                if now - since.setdefault(pid, now) > timeout_s + 1.0:
                    stuck.append(
                        f"ERROR: the launcher process '{name}' (pid {pid}) was stopped for {now - since[pid]:.0f} s "
                        f"(longer than distributed.collective_timeout_s {timeout_s:g} s): the job was aborted; the "
                        f"last complete checkpoint is kept. Resume a stopped launcher with SIGCONT within the timeout"
                    )
                    kill_tree(proc.pid)  # SIGKILL ends stopped processes too, each proxy in its own session
                    return

    threading.Thread(target=watch, name="ortflow-launcher-watch", daemon=True).start()
    return done
