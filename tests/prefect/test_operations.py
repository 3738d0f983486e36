"""Operations against a real local Prefect server: the shipped automations call a webhook when a scheduled run of an
ortflow deployment fails, when a run runs late and when the zombie-run automation marks a run Crashed whose process
vanished (its heartbeats stopped), and for nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prefect import flow

from tests.faults.procs import ortflow_here
from tests.prefect.serving import flow_runs_of, read_flow_run, serving
from tests.support.prefect_runs import mlp_config, processes_mentioning, wait_for, write_config

pytestmark = pytest.mark.prefect


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


def _install(*args: str) -> str:
    """``ortflow automations ARGS`` against the test server, in this process (no CLI start-up); its output."""
    done = ortflow_here("automations", *args)
    assert done.returncode == 0, done.stdout
    return done.stdout


@flow(name="alerted")
def _alerted() -> None:
    """A flow whose runs the race test announces by hand (they never execute)."""


def _post(events) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.request("POST", "/events", json=[e.model_dump(mode="json") for e in events]).raise_for_status()


def test_ended_runs_get_no_late_alert_and_an_event_posted_twice_alerts_once(prefect_server, webhook):
    """A busy server takes a short run's start and end events off its queue together; a run is late only when its
    own process says so (``ortflow.flow-run.late``), so ended runs get no alert however their events are evaluated.
    A late event and a Failed event, each posted twice (a retried request), alert once each; ``ortflow automations``
    leaves the late bound where the flow runs read it."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    from ortflow.tasks.events import late_event, read_late_after, run_event

    url, calls = webhook
    late_after = 20
    _install("--webhook", url, "--late-after", str(late_after), "--zombie-after", "60")
    assert read_late_after() == late_after
    with get_client(sync_client=True) as client:
        ended = [client.create_flow_run(_alerted, tags=["ortflow"]) for _ in range(12)]
        failed = client.create_flow_run(_alerted, tags=["ortflow"], state=Failed(message="boom"))
        marker = client.create_flow_run(_alerted, tags=["ortflow"])
    for i, run in enumerate(ended):
        start = run_event(run, Running())
        _post([start, run_event(run, Completed(name="Skipped") if i % 2 else Completed(), start)])
    start, end = run_event(failed, Running()), failed.state  # the alert names the run's state on the server
    _post([start, run_event(failed, end, start), run_event(failed, end, start)])
    _post([run_event(failed, end, start)])
    _post([run_event(marker, Running()), late_event(marker, late_after), late_event(marker, late_after)])
    _post([late_event(marker, late_after)])
    wait_for(lambda: {c["flow_run_id"] for c in calls} >= {str(failed.id), str(marker.id)}, 120,
             "the failed run's and the late run's alerts")
    time.sleep(5)  # a second call for a repeated event would come within the same evaluation round
    alerts = sorted((c["flow_run_id"], c["alert"]) for c in calls)
    assert alerts == sorted([(str(failed.id), "ortflow run Failed"),
                             (str(marker.id), f"ortflow run still running after {late_after} s")]), calls


def _final_state(flow_run_id):
    return (s := read_flow_run(flow_run_id).state) and s.is_final() and s


def _kill_worker_host(proc: subprocess.Popen) -> None:
    """The worker's host vanishes: kill -9 of the serving process and of its flow-run processes, no word to the
    server."""
    engine = [pid for pid in processes_mentioning("prefect.engine")
              if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)]
    assert engine, "the flow run's process was not found"
    for pid in [proc.pid, *engine]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


#: The late bound of the false-alert trial: the lost run's late alert comes this long after it started, before its
#: first heartbeat window (2 x 30 s) ends.
LATE_AFTER_S = 20
#: Runs that end within this many seconds of the late bound may or may not have announced themselves late (their
#: timer and their end race); shorter runs must not, longer runs must.
LATE_MARGIN_S = 10
#: Seconds between the trial's flow-run heartbeats (serve's default is 30, Prefect's minimum): the lost run is killed
#: once its late alert came, after LATE_AFTER_S, and before its second heartbeat, so the zombie-run automation marks
#: it Crashed 60 s after its first one, not after a second one that a 30 s period would often send first. A live run
#: still beats well within the 60 s window.
TRIAL_HEARTBEAT_S = 45


def _late_alerts_match(alerts: list[str], seconds: float, stored: float, late: str) -> bool:
    """A run's late alerts agree with how long it ran: none when it ended well before the late bound, one when it ran
    well past it, either in between. ``seconds`` is its recorded length (its end state's time less its start);
    ``stored`` how long after its start the server last wrote the run (at or after it stored the end): its process
    stops its late timer only once the end state is accepted, which a loaded server can do long after the state's
    own time."""
    got = alerts.count(late)
    if stored < LATE_AFTER_S - LATE_MARGIN_S:
        return got == 0
    if seconds > LATE_AFTER_S + LATE_MARGIN_S:
        return got == 1
    return got in (0, 1)


def _alerting_config(tmp_path: Path, mlp_sources) -> Path:
    """A served deployment whose scheduled runs fail at the export stage (an output the model does not have)."""
    cfg = mlp_config(tmp_path, mlp_sources, "alerting", export={"outputs": ["no_such_output"]},
                     distributed={"num_ranks": 1, "threads_per_rank": 1}, checkpoint={"period": 4},
                     train={"num_train_steps": 4, "display_loss_steps": 2, "evaluation_period": 0},
                     schedule={"interval_s": 10})
    return write_config(cfg, tmp_path / "alerting.yaml")


@pytest.mark.timeout(600)  # the runs, then the lost run's late window and zombie window (60 s after a heartbeat)
def test_alerts_come_only_for_failed_crashed_and_late_runs_and_a_failing_scheduled_run_calls_the_webhook(
    prefect_server, mlp_sources, tmp_path, webhook
):
    """The false-alert trial: completed, skipped and export-only runs get no webhook call (neither from the late nor
    from the zombie-run automation, whose windows outlast them); a failed run gets one, a run still running past
    --late-after gets one, and the same run killed with its host gets one more when the zombie-run automation marks
    it Crashed. The lost run waits for its run folder, which the test holds: it runs without using the CPU. While it
    waits to be marked Crashed, a second served deployment's scheduled run (created by the server's scheduler) fails
    and calls the webhook with the stage's error."""
    from prefect.client.orchestration import get_client

    from ortflow import runlock

    url, calls = webhook
    late_after = LATE_AFTER_S
    late = f"ortflow run still running after {late_after} s"
    out = _install("--webhook", url, "--late-after", str(late_after), "--zombie-after", "60")
    assert "ortflow-run-failed" in out and "ortflow-zombie-runs" in out
    cfg = mlp_config(tmp_path, mlp_sources, "trial", versions={"skip_unchanged": True},
                     distributed={"num_ranks": 1, "threads_per_rank": 1},
                     train={"num_train_steps": 4, "display_loss_steps": 2, "evaluation_period": 0},
                     checkpoint={"period": 4, "max_num_checkpoints": 1})
    config_file = write_config(cfg, tmp_path / "trial.yaml")
    trial_env = {**prefect_server, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(TRIAL_HEARTBEAT_S)}
    with serving(config_file, trial_env, "trial", tmp_path, tmp_path / "serve.log") as proc:
        with get_client(sync_client=True) as client:
            pipeline = client.read_deployment_by_name("train-pipeline/trial").id
            export = client.read_deployment_by_name("export-only/trial").id
            runs = {"completed": client.create_flow_run_from_deployment(pipeline)}
        wait_for(lambda: _final_state(runs["completed"].id), 300, "the first run to end")
        with get_client(sync_client=True) as client:
            runs["skipped"] = client.create_flow_run_from_deployment(pipeline)  # nothing changed
            runs["export-only"] = client.create_flow_run_from_deployment(export)
        wait_for(lambda: _final_state(runs["skipped"].id), 300, "the skipped run to end")  # before a change
        with get_client(sync_client=True) as client:
            runs["failed"] = client.create_flow_run_from_deployment(
                pipeline, parameters={"overrides": ["train.num_train_steps=-3"]})
        states = {what: wait_for(lambda r=run: _final_state(r.id), 300, f"the {what} run to end")
                  for what, run in runs.items()}
        assert [states[w].name for w in ("completed", "skipped", "export-only", "failed")] == [
            "Completed", "Skipped", "Completed", "Failed"], states
        with runlock.hold(cfg.output_dir), get_client(sync_client=True) as client:
            runs["lost"] = client.create_flow_run_from_deployment(pipeline, parameters={"wait_for_lock": True})
            # --limit 1: its 10 s schedule is shorter than a run, and a runner without a limit asks the server to
            # start every queued run at every poll (docs/operations.md), which slows a loaded test server down.
            alerting = serving(_alerting_config(tmp_path, mlp_sources), prefect_server, "alerting", tmp_path,
                               tmp_path / "serve-alerting.log", extra=["--limit", "1"])
            with alerting:
                late_call = wait_for(lambda: next((c for c in calls if c.get("flow_run_id") == str(runs["lost"].id)),
                                                  None), late_after + 240, "the late alert of the lost run", 0.5)
                assert late_call["alert"] == late, late_call
                _kill_worker_host(proc)
                killed = time.time()
                assert read_flow_run(runs["lost"].id).state.name == "Running"

                def failed_scheduled_run():
                    return next((r for r in flow_runs_of("train-pipeline/alerting")
                                 if r.auto_scheduled and r.state and r.state.is_failed()), None)
                scheduled = wait_for(failed_scheduled_run, 300, "a scheduled run to fail", 1)
                call = wait_for(lambda: next((c for c in calls if c.get("flow_run_id") == str(scheduled.id)
                                              and c["alert"] == "ortflow run Failed"), None), 120,
                                "the webhook call for the failed scheduled run", 0.5)
            assert call["deployment"] == "alerting" and call["flow_run"] == scheduled.name
            assert "no_such_output" in call["message"]
        state = wait_for(lambda: _final_state(runs["lost"].id), 240, "the zombie-run automation to mark the run "
                         "Crashed", 1)
        assert state.name == "Crashed" and "heartbeat" in (state.message or ""), state
        started = read_flow_run(runs["lost"].id).start_time.timestamp()
        print(f"the lost run: killed {killed - started:.0f} s after its start, marked Crashed "
              f"{state.timestamp.timestamp() - started:.0f} s after it")
        wait_for(lambda: len([c for c in calls if c.get("flow_run_id") == str(runs["lost"].id)]) == 2, 120,
                 "the alert for the run the zombie-run automation ended", 0.5)
    # Every window of the earlier runs (60 s after their last heartbeat, late_after s after their start) ended before
    # the lost run's: the automations have evaluated them all.
    by_run = {what: [c["alert"] for c in calls if c.get("flow_run_id") == str(run.id)] for what, run in runs.items()}
    durations = {what: (round((r.end_time - r.start_time).total_seconds(), 1),
                        round((r.updated - r.start_time).total_seconds(), 1)) for what, run in runs.items()
                 if what != "lost" and (r := read_flow_run(run.id))}
    print(f"false-alert trial: {len(runs)} runs, {len(calls)} webhook call(s): {by_run}; run seconds (recorded, "
          f"stored) {durations}")
    for what, (seconds, stored) in durations.items():
        assert _late_alerts_match(by_run[what], seconds, stored, late), (what, seconds, stored, by_run)
    assert by_run["lost"] == [late, "ortflow run Crashed (no heartbeat for 60 s)"], by_run
    assert {what: [a for a in alerts if a != late] for what, alerts in by_run.items() if what != "lost"} == {
        **{what: [] for what in ("completed", "skipped", "export-only")},
        "failed": ["ortflow run Failed"],
    }, by_run
    # The other calls are the served deployment's scheduled runs' (the one that failed, and any that serve's stop
    # ended or that ran past the late bound).
    alerting_ids = {str(r.id) for r in flow_runs_of("train-pipeline/alerting")}
    assert len(calls) == sum(len(alerts) for alerts in by_run.values()) + len(
        [c for c in calls if c.get("flow_run_id") in alerting_ids]), calls
