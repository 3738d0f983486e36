"""The job guard without MPI or Prefect: a launching process starts a shell "job" under a guard; killed with SIGKILL,
the guard stops the job with SIGTERM (the job's stop line lands in the guard's log) and calls its ``then``
function; released, the guard exits at once, leaves the job alone and never imports ``then``'s module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ortflow.launch.guard import GUARD_LOG, taken_over_lines
from tests.support.prefect_runs import processes_mentioning, wait_for

ROOT = Path(__file__).resolve().parents[2]

# A "job" that prints ticks until SIGTERM, then its stop line; it would tick on for minutes otherwise.
JOB = "trap 'echo stop line of the job; exit 143' TERM; for i in $(seq 3000); do echo tick; sleep 0.1; done"

LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ortflow.launch.guard import JobGuard
    from ortflow.launch.local import LAUNCHER_PID_ENV, LocalJob

    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    guard = JobGuard(run_dir, grace_s=20, then="guard_then:record_report")
    job = LocalJob(["bash", "-c", sys.argv[3]], {**os.environ, LAUNCHER_PID_ENV: str(guard.pid)},
                   output=(guard.read_fd, guard.write_fd), transcript=guard.transcript)
    guard.job_started(job.proc.pid)
    (run_dir / "job.pid").write_text(str(job.proc.pid))
    while not any("tick" in line for line in job.read_output()):
        job.wait(0.5)
    if mode == "release":
        guard.release()
        (run_dir / "released").write_text(str(guard.proc.returncode))
    if mode == "cancel":  # this process stops the job itself (a cancelled flow run) and reads its last line
        job.cancel()
        while not any("stop line" in line for line in job.read_output()):
            job.wait(0.5)
    print("ready", flush=True)
    time.sleep(600)
""")


# The guard's ``then`` in these tests (module guard_then in the test's folder): leaves a file when its module is
# imported and one when it is called.
THEN = textwrap.dedent("""
    from pathlib import Path

    (Path(__file__).parent / "imported").write_text("the guard imported its then\\n")


    def record_report(run_dir):
        (Path(run_dir) / "reported").write_text("called after the job ended\\n")
""")


# What a released guard has imported by its end (module sitecustomize in the test's folder, which every interpreter
# started there imports at start-up; it acts in the guard only). Once the guard's main function has returned, it waits
# until every other thread of the guard has ended or waits for a process to exit (the launching process, alive until
# the test ends): a thread that a guard would have started to import its then at start has done so by then, however
# slowly it ran. Then it records whether the guard imported that module, and the threads it waited for.
GUARD_EXIT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time


    def _waits_for_a_process(frame):
        while frame is not None:
            if frame.f_code.co_name == "wait_for_exit":
                return True
            frame = frame.f_back
        return False


    def _record():
        if getattr(sys.modules["__main__"].__spec__, "name", None) != "ortflow.launch.guard":
            return
        waited = set()
        while True:
            frames = sys._current_frames()
            running = [t.name for t in threading.enumerate() if t is not threading.main_thread()
                       and t.ident in frames and not _waits_for_a_process(frames[t.ident])]
            if not running:
                break
            waited.update(running)
            time.sleep(0.01)
        record = {"imported_then": "guard_then" in sys.modules, "waited_for": sorted(waited)}
        with open(os.path.join(os.path.dirname(__file__), "guard-exit.json"), "w") as f:
            json.dump(record, f)


    atexit.register(_record)
""")


def _start(tmp_path: Path, mode: str) -> subprocess.Popen:
    (tmp_path / "guard_then.py").write_text(THEN)
    if mode == "release":
        (tmp_path / "sitecustomize.py").write_text(GUARD_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(tmp_path),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), mode, JOB], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == "ready", proc.stdout.read()
    return proc


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_guard_stops_the_job_of_a_killed_launching_process_and_reports(tmp_path):
    proc = _start(tmp_path, "keep")
    job = int((tmp_path / "job.pid").read_text())
    try:
        proc.kill()  # no warning: what a stopped Prefect process worker does to its flow-run process
        proc.wait()
        wait_for(lambda: (tmp_path / "reported").exists(), 120, "the guard's report")
        assert (tmp_path / "imported").exists()
    finally:
        for pid in processes_mentioning("ortflow.launch.guard"):
            if str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                wait_for(lambda pid=pid: not _alive(pid), 30, "the guard to exit")
    assert not _alive(job)
    log = (tmp_path / GUARD_LOG).read_text()
    assert "is gone before its job ended" in log and "stop line of the job" in log, log


def test_lines_a_killed_launching_process_read_while_it_stopped_the_job_itself_reach_the_guards_report(tmp_path):
    """The launching process asks the job to stop (a flow run cancelled, Prefect's SIGTERM), reads the job's stop
    line and is killed before it forwards it: the line is in the guard's log all the same, and among the lines the
    report sends, once."""
    proc = _start(tmp_path, "cancel")
    try:
        proc.kill()
        proc.wait()
        wait_for(lambda: (tmp_path / "reported").exists(), 120, "the guard's report")
    finally:
        for pid in processes_mentioning("ortflow.launch.guard"):
            if str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                wait_for(lambda pid=pid: not _alive(pid), 30, "the guard to exit")
    log = (tmp_path / GUARD_LOG).read_text()
    assert f"the launching process {proc.pid} asked the ranks to stop" in log, log
    lines = taken_over_lines(tmp_path / GUARD_LOG)
    assert lines.count("stop line of the job") == 1, log
    assert not [line for line in lines if "the launching process" in line], lines


def test_the_report_takes_the_stop_lines_of_the_killed_process_of_the_last_take_over_only(tmp_path):
    """A guard's log spans attempts: the lines of the last take-over are the guard's copies and, before them, those
    the killed process read while it stopped the job itself; an earlier attempt's, or another process's, are not."""
    log = tmp_path / GUARD_LOG
    log.write_text("\n".join([
        "10:00:00 the launching process 11 asked the ranks to stop; the lines it read follow",
        "[0] 10:00:01 WARNING stop requested: ranks stopped together after step 3 (checkpoint saved)",
        "10:00:05 the launching process 11 is gone before its job ended",
        "10:00:05 asking the ranks (process group 12) to stop after the current update (30 s grace)",
        "[1] 10:00:06 INFO first attempt's copy",
        "11:00:00 the launching process 40 asked the ranks to stop; the lines it read follow",  # released: no take-over
        "[0] 11:00:01 INFO second attempt, stopped by its own process",
        "12:00:00 the launching process 77 asked the ranks to stop; the lines it read follow",
        "[1] 12:00:01 WARNING SIGTERM received: stopping after the current weight update",
        "12:00:02 the launching process 77 is gone before its job ended",
        "12:00:02 asking the ranks (process group 78) to stop after the current update (30 s grace)",
        "[0] 12:00:03 WARNING stop requested: ranks stopped together after step 9 (checkpoint saved)",
        "12:00:04 reporting the stop (ortflow.tasks.training:report_orphaned_stop)",
    ]) + "\n")
    assert taken_over_lines(log) == [
        "[1] 12:00:01 WARNING SIGTERM received: stopping after the current weight update",
        "[0] 12:00:03 WARNING stop requested: ranks stopped together after step 9 (checkpoint saved)",
    ]
    # A take-over whose process never stopped the job itself: only the guard's copies.
    log.write_text(log.read_text().replace("launching process 77 asked", "launching process 76 asked"))
    assert taken_over_lines(log) == [
        "[0] 12:00:03 WARNING stop requested: ranks stopped together after step 9 (checkpoint saved)"]


def test_a_released_guard_exits_and_leaves_the_job_alone(tmp_path):
    proc = _start(tmp_path, "release")
    job = int((tmp_path / "job.pid").read_text())
    try:
        assert (tmp_path / "released").read_text() == "0"  # the guard exited by itself, status 0
        assert _alive(job)  # and did not stop the job
        assert (tmp_path / GUARD_LOG).read_text() == ""
        assert not (tmp_path / "reported").exists()
        # A released guard has nothing to report: no import either, not even by a thread of its still at work.
        record = json.loads((tmp_path / "guard-exit.json").read_text())
        assert record["imported_then"] is False, record
        assert not (tmp_path / "imported").exists()
    finally:
        proc.kill()
        proc.wait()
        os.killpg(job, signal.SIGKILL)


def test_a_process_group_counts_as_alive_until_its_last_process_is_gone_or_a_zombie():
    import time

    from ortflow.processes import group_alive, process_alive

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its pid is its group's id
    try:
        assert group_alive(proc.pid) and process_alive(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # not reaped yet (no wait): it stays a zombie
        deadline = time.monotonic() + 30
        while process_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"/proc/{proc.pid}").exists(), "the zombie was reaped early: the check below would be void"
        assert not group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not group_alive(proc.pid) and not process_alive(proc.pid)
