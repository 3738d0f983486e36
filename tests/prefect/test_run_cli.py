"""``ortflow run`` in a terminal: a failed stage is reported as its own message and the command to rerun or fix (the
traceback only in the log file) and is not retried when it would fail again; SIGTERM stops the ranks and Prefect's
temporary server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.prefect_runs import mlp_config, rank_pids, wait_for, write_config

pytestmark = pytest.mark.prefect

ORTFLOW = str(Path(sys.executable).parent / "ortflow")


def test_failed_stage_prints_its_message_and_the_fix_and_a_bad_export_path_is_not_retried(
    prefect_server, mlp_sources, tmp_path
):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the export folder should be")
    cfg = mlp_config(tmp_path, mlp_sources, "bad-export", export={"path": str(blocker / "model.onnx")})
    config_file = write_config(cfg, tmp_path / "bad-export.yaml")
    done = subprocess.run([ORTFLOW, "run", str(config_file)], env=prefect_server, capture_output=True, text=True,
                          timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    assert re.search(r"error: pipeline failed: .*not-a-folder", out), out[-3000:]
    assert f"fix the problem above, then: ortflow run {config_file}" in out
    log_file = Path(re.search(r"full log with tracebacks: (\S+)", out)[1])
    assert log_file.parent == cfg.output_dir / "logs"
    log = log_file.read_text()
    assert "Traceback (most recent call last)" in log  # kept for whoever needs it
    # An error that would repeat is not retried: the export task fails once and the flow fails right after.
    assert "Retry 1/" not in log
    export_failures = [line for line in log.splitlines() if "prefect.task_runs 'export-" in line and "Failed(" in line]
    assert len(export_failures) == 1 and "FileExistsError" in export_failures[0], export_failures
    assert cfg.checkpoints_dir.is_dir()  # training itself finished


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_stops_ortflow_run_its_ranks_and_its_temporary_server(mlp_sources, tmp_path):
    cfg = mlp_config(tmp_path, mlp_sources, "sigterm",
                     train={"num_train_steps": 400000, "display_loss_steps": 1000, "evaluation_period": 0},
                     checkpoint={"period": 100000})
    config_file = write_config(cfg, tmp_path / "sigterm.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_ENABLED="false", OMP_NUM_THREADS="1",  # no API URL: a temporary server
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")  # (slow to start on a loaded machine)
    proc = subprocess.Popen([ORTFLOW, "run", str(config_file)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or len(rank_pids(cfg.output_dir)) == 2, 240, "two ranks training")
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        family = _descendants(proc.pid)
        assert any("prefect" in _cmdline(p) and "server" in _cmdline(p) for p in family), [_cmdline(p) for p in family]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=90)[0].decode()
        assert proc.returncode == 143, out[-3000:]
        assert "stopped by SIGTERM" in out
        wait_for(lambda: not any(_alive(p) for p in family), 20, "ortflow run's server and ranks to exit")
        assert time.monotonic() - started < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
