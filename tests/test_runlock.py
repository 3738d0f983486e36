"""The run-folder lock: a second writer is refused with the holder named or waits; a dead holder never blocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ortflow import runlock

HOLD = textwrap.dedent(
    """
    import sys, time
    from ortflow import runlock
    with runlock.hold(sys.argv[1], flow_run_id="fr-123", purpose="train"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
        open(sys.argv[1] + "/releasing", "w").close()  # the last thing before the lock is released
    """
)


def _holder_process(folder, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_is_refused_at_once_with_the_holder_named(tmp_path):
    proc = _holder_process(tmp_path, 60)
    try:
        started = time.monotonic()
        with pytest.raises(runlock.RunFolderLocked) as err, runlock.hold(tmp_path):
            pass
        assert time.monotonic() - started < 5
        message = str(err.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in message
        assert "flow run fr-123" in message and "train" in message
        assert runlock.holder(tmp_path).pid == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_never_blocks(tmp_path):
    proc = _holder_process(tmp_path, 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert runlock.lock_path(tmp_path).exists()  # the file is left behind; only the kernel's lock matters
    assert runlock.holder(tmp_path) is None
    with runlock.hold(tmp_path, purpose="next") as path:
        assert runlock.holder(tmp_path).pid == os.getpid()
        assert path == runlock.lock_path(tmp_path)
    assert runlock.holder(tmp_path) is None


def test_waiting_writer_gets_the_lock_when_the_holder_finishes(tmp_path):
    proc = _holder_process(tmp_path, 1.5)
    try:
        started = time.monotonic()
        with runlock.hold(tmp_path, wait=True, timeout_s=60, poll_s=0.1):
            waited = time.monotonic() - started
            assert (tmp_path / "releasing").exists(), "got the lock while the holder still held it"
        assert waited > 0.5
    finally:
        proc.wait()


def test_waiting_writer_gives_up_after_its_timeout(tmp_path):
    proc = _holder_process(tmp_path, 60)
    try:
        with pytest.raises(runlock.RunFolderLocked, match="after waiting"), runlock.hold(
            tmp_path, wait=True, timeout_s=0.5, poll_s=0.1
        ):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_lock_is_reentrant_in_one_process_and_released_at_the_outer_exit(tmp_path):
    with runlock.hold(tmp_path, purpose="pipeline"):
        inner_done = threading.Event()

        def nested() -> None:  # the train task may run in another thread of the flow's process
            with runlock.hold(tmp_path, purpose="train"):
                inner_done.set()

        thread = threading.Thread(target=nested)
        thread.start()
        thread.join(timeout=10)
        assert inner_done.is_set()
        assert runlock.holder(tmp_path).purpose == "pipeline"  # the outer holder's record stays
        out = subprocess.run([sys.executable, "-c", "import sys; from ortflow import runlock; "
                              "print(runlock.holder(sys.argv[1]).pid)", str(tmp_path)],
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(os.getpid())
    assert runlock.holder(tmp_path) is None


def test_runlock_imports_nothing_from_ortflow():
    code = "import sys, ortflow.runlock; print(sorted(m for m in sys.modules if m.startswith('ortflow')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ortflow', 'ortflow.runlock']"
