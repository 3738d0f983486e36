"""Operations against a real local Prefect server: the shipped automations call a webhook when a scheduled run of an
ortflow deployment fails, and mark a run Crashed when its process vanished (its heartbeats stopped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.prefect.serving import flow_runs_of, read_flow_run, serving
from tests.support.prefect_runs import mlp_config, processes_mentioning, rank_pids, wait_for, write_config

pytestmark = pytest.mark.prefect

ORTFLOW = str(Path(sys.executable).parent / "ortflow")


@pytest.fixture
def webhook():
    """A local HTTP server that records every POST body; yields (url, calls)."""
    calls: list[dict] = []

    class Record(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                calls.append(json.loads(body))
            except ValueError:
                calls.append({"raw": body.decode(errors="replace")})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Record)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", calls
    finally:
        server.shutdown()


def _install(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([ORTFLOW, "automations", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stderr


def test_a_failing_scheduled_run_calls_the_alert_webhook(prefect_server, mlp_sources, tmp_path, webhook):
    url, calls = webhook
    out = _install(prefect_server, "--webhook", url, "--late-after", "3600")
    assert "ortflow-run-failed" in out and "ortflow-zombie-runs" in out
    cfg = mlp_config(tmp_path, mlp_sources, "alerting", export={"outputs": ["no_such_output"]},
                     train={"num_train_steps": 10, "evaluation_period": 0}, schedule={"interval_s": 20})
    config_file = write_config(cfg, tmp_path / "alerting.yaml")
    with serving(config_file, prefect_server, "alerting", tmp_path, tmp_path / "serve.log"):
        def failed_scheduled_run():
            return next((r for r in flow_runs_of("train-pipeline/alerting")
                         if r.auto_scheduled and r.state and r.state.is_failed()), None)
        run = wait_for(failed_scheduled_run, 300, "a scheduled run to fail", 1)
        call = wait_for(lambda: next((c for c in calls if c.get("flow_run_id") == str(run.id)), None), 120,
                        "the webhook call for the failed run", 0.5)
    assert call["alert"] == "ortflow run Failed", call
    assert call["deployment"] == "alerting" and call["flow_run"] == run.name
    assert "no_such_output" in call["message"]


def test_a_run_whose_process_vanished_is_marked_crashed_by_the_zombie_automation(
    prefect_server, mlp_sources, tmp_path
):
    _install(prefect_server, "--zombie-after", "60")
    cfg = mlp_config(tmp_path, mlp_sources, "zombie",
                     train={"num_train_steps": 4000000, "display_loss_steps": 1000, "evaluation_period": 0},
                     checkpoint={"period": 1000000})
    config_file = write_config(cfg, tmp_path / "zombie.yaml")
    with serving(config_file, prefect_server, "zombie", tmp_path, tmp_path / "serve.log") as proc:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-pipeline/zombie")
            run = client.create_flow_run_from_deployment(deployment.id)
        wait_for(lambda: any(len(rank_pids(f)) == 2 for f in cfg.output_dir.glob("versions/*")), 300,
                 "two ranks training")
        # The worker's host vanishes: kill -9 of the serving process, of the flow run's process and of its job's
        # guard, no word to the server (the ranks follow the guard within a second).
        engine = [pid for pid in processes_mentioning("prefect.engine")
                  if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)]
        assert engine, "the flow run's process was not found"
        guard = [pid for pid in processes_mentioning("ortflow.launch.guard") if str(cfg.output_dir) in
                 Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert guard, "the job's guard was not found"
        for pid in guard:
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        for pid in engine:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        assert read_flow_run(run.id).state.name == "Running"
        state = wait_for(lambda: (s := read_flow_run(run.id).state) and s.is_final() and s, 240,
                         "the automation to mark the run Crashed", 2)
    assert state.name == "Crashed" and "heartbeat" in (state.message or ""), state
    wait_for(lambda: not processes_mentioning(str(cfg.output_dir / "versions")), 60, "the ranks to exit")
