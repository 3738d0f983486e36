"""Ranks follow their launching process, run the installed ortflow whatever the working folder holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ortflow.launch.local import build_command
from ortflow.trainer import lifeline
from tests.faults import procs
from tests.support.runs import make_run


def test_the_watch_fires_within_a_second_of_the_launcher_exiting_even_as_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    died = threading.Event()
    env = {lifeline.LAUNCHER_PID_ENV: str(child.pid), lifeline.LAUNCHER_HOST_ENV: socket.gethostname()}
    assert lifeline.follow_launcher(env, on_death=lambda pid: died.set()) == child.pid
    start = time.monotonic()
    assert died.wait(5.0)  # the child is a zombie now (not reaped yet): that counts as dead
    assert time.monotonic() - start < 1.5
    child.wait()


def test_no_watch_for_a_launcher_on_another_host_or_none():
    env = {lifeline.LAUNCHER_PID_ENV: "1", lifeline.LAUNCHER_HOST_ENV: "some-other-host"}
    assert lifeline.follow_launcher(env, on_death=lambda pid: None) is None
    assert lifeline.follow_launcher({}, on_death=lambda pid: None) is None


def test_ranks_are_started_without_the_working_folder_on_the_import_path(tmp_path):
    cmd = build_command(tmp_path, 2, tmp_path / "mpiexec", "mpich")
    assert cmd[-6:] == [sys.executable, "-u", "-P", "-m", "ortflow.trainer", str(tmp_path)]


@pytest.mark.mpi
def test_a_folder_named_ortflow_in_the_working_folder_does_not_break_the_ranks(tmp_path):
    cfg = make_run(tmp_path, "shadow", distributed={"num_ranks": 2}, train={"num_train_steps": 4})
    decoy = tmp_path / "cwd" / "ortflow"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ortflow package was imported')\n")
    out = subprocess.run([procs.ORTFLOW, "train", str(cfg.output_dir)], cwd=decoy.parent, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]
    assert "decoy" not in out.stdout + out.stderr
