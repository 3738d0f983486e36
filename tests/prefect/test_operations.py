"""Operations against a real local Prefect server: the shipped automations call a webhook when a scheduled run of an
ortflow deployment fails, when a run runs late and when the zombie-run automation marks a run Crashed whose process
vanished (its heartbeats stopped), and for nothing else."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prefect import flow

from tests.faults.procs import ortflow_here
from tests.prefect.serving import flow_runs_of, read_flow_run, start_serve, stop_serve, wait_served
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


def _post_hand_made_events(late_after: int) -> dict:
    """A busy server takes a short run's start and end events off its queue together; a run is late only when its
    own process says so (``ortflow.flow-run.late``), so ended runs get no alert however their events are evaluated.
    A late event and a Failed event, each posted twice (a retried request), must alert once each. Posts the events
    of such runs (announced by hand: they never execute); returns their ids by what they are."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    from ortflow.tasks.events import late_event, run_event

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
    return {"ended": [str(r.id) for r in ended], "failed": str(failed.id), "late": str(marker.id)}


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


def _late_alerts_match(alerts: list[str], seconds: float, stored: float, late: str) -> bool:
    """A run's late alerts agree with how long it ran: none when it ended well before the late bound, one when it ran
    well past it, either in between. ``seconds`` is its recorded length (its end state's time less its start);
    ``stored`` how long after its start the server stored its end: its process stops its late timer only once the
    end state is accepted, which a loaded server can do long after the state's time."""
    got = alerts.count(late)
    if stored < LATE_AFTER_S - LATE_MARGIN_S:
        return got == 0
    if seconds > LATE_AFTER_S + LATE_MARGIN_S:
        return got == 1
    return got in (0, 1)


#: The zombie-run bound of the trial (the shortest taken: two heartbeats of 30 s).
ZOMBIE_AFTER_S = 60
#: How long after a zombie-run window ends its alert surely came: the server evaluates proactive automations every
#: 5 s, then calls the webhook.
ZOMBIE_ALERT_LAG_S = 15


def _alerting_config(tmp_path: Path, mlp_sources) -> Path:
    """A served deployment whose scheduled runs fail at the export stage (an output the model does not have). Its
    interval schedule counts from serve's start: the first scheduled run comes a minute later, while the trial waits
    for the lost run's zombie-run window, and no second one before the trial ends."""
    cfg = mlp_config(tmp_path, mlp_sources, "alerting", export={"outputs": ["no_such_output"]},
                     distributed={"num_ranks": 1, "threads_per_rank": 1}, checkpoint={"period": 4},
                     train={"num_train_steps": 4, "display_loss_steps": 2, "evaluation_period": 0},
                     schedule={"interval_s": 60})
    return write_config(cfg, tmp_path / "alerting.yaml")


def _small_config(tmp_path: Path, mlp_sources, name: str, **sections):
    return mlp_config(tmp_path, mlp_sources, name, distributed={"num_ranks": 1, "threads_per_rank": 1},
                      train={"num_train_steps": 4, "display_loss_steps": 2, "evaluation_period": 0},
                      checkpoint={"period": 4, "max_num_checkpoints": 1}, **sections)


@contextlib.contextmanager
def _three_serves(env, tmp_path: Path, mlp_sources) -> Iterator[tuple[dict, object]]:
    """``ortflow serve`` of three configs, started together: ``trial`` (the runs that end), ``alerting`` (failing
    scheduled runs; --limit 1: a runner without a limit asks the server to start every queued run at every poll,
    docs/operations.md) and ``lost`` (its run waits for its run folder, which the block holds: it runs without using
    the CPU until its host is killed). Yields the serving processes and the trial's config."""
    from ortflow import runlock

    trial = _small_config(tmp_path, mlp_sources, "trial", versions={"skip_unchanged": True})
    lost = _small_config(tmp_path, mlp_sources, "lost")
    files = {"trial": (write_config(trial, tmp_path / "trial.yaml"), []),
             "alerting": (_alerting_config(tmp_path, mlp_sources), ["--limit", "1"]),
             "lost": (write_config(lost, tmp_path / "lost.yaml"), [])}
    with contextlib.ExitStack() as stack:
        stack.enter_context(runlock.hold(lost.output_dir))
        procs = {}
        for name, (config_file, extra) in files.items():
            procs[name] = start_serve(config_file, env, tmp_path, tmp_path / f"serve-{name}.log", extra)
            stack.callback(stop_serve, procs[name])
        for name, proc in procs.items():
            wait_served(proc, name, tmp_path / f"serve-{name}.log")
        yield procs, trial


def _deployment_ids() -> dict[str, object]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {f"{flow}/{name}": client.read_deployment_by_name(f"{flow}/{name}").id
                for flow in ("train-pipeline", "export-only") for name in ("trial", "alerting", "lost")}


def _start_runs(deployments: dict, procs: dict, calls: list) -> dict:
    """The trial's runs: a completed one, then (nothing changed) a skipped one and an export-only one, a failed one
    (an override the config refuses) and the lost one, which gets its late alert and then loses its host (kill -9 of
    its ``ortflow serve`` and flow-run process, no word to the server) before its second heartbeat."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = {"completed": client.create_flow_run_from_deployment(deployments["train-pipeline/trial"]),
                "failed": client.create_flow_run_from_deployment(
                    deployments["train-pipeline/alerting"], parameters={"overrides": ["train.num_train_steps=-3"]}),
                "lost": client.create_flow_run_from_deployment(deployments["train-pipeline/lost"],
                                                               parameters={"wait_for_lock": True})}
    killed = []

    def step() -> bool:
        if "skipped" not in runs and _final_state(runs["completed"].id):
            with get_client(sync_client=True) as client:
                runs["skipped"] = client.create_flow_run_from_deployment(deployments["train-pipeline/trial"])
                runs["export-only"] = client.create_flow_run_from_deployment(deployments["export-only/trial"])
        if not killed and (call := next((c for c in calls if c.get("flow_run_id") == str(runs["lost"].id)), None)):
            assert call["alert"] == f"ortflow run still running after {LATE_AFTER_S} s", call
            _kill_worker_host(procs["lost"])
            assert read_flow_run(runs["lost"].id).state.name == "Running"
            killed.append(call)
        return "skipped" in runs and bool(killed)

    wait_for(step, 400, "the first run to end and the late alert of the lost run", 0.5)
    return runs


def _scheduled_failure(calls: list) -> None:
    """A scheduled run of the alerting deployment (created by the server's scheduler) fails and calls the webhook
    with the stage's error."""
    def failed_scheduled_run():
        return next((r for r in flow_runs_of("train-pipeline/alerting")
                     if r.auto_scheduled and r.state and r.state.is_failed()), None)

    scheduled = wait_for(failed_scheduled_run, 300, "a scheduled run to fail", 1)
    call = wait_for(lambda: next((c for c in calls if c.get("flow_run_id") == str(scheduled.id)
                                  and c["alert"] == "ortflow run Failed"), None), 120,
                    "the webhook call for the failed scheduled run", 0.5)
    assert call["deployment"] == "alerting" and call["flow_run"] == scheduled.name
    assert "no_such_output" in call["message"]


def _windows_passed(runs: dict) -> None:
    """Wait until the zombie-run windows of the runs that ended (opened by their last heartbeat, at the latest their
    end) have passed and been evaluated: an alert they raised wrongly would have come by then."""
    ends = [read_flow_run(run.id).end_time for what, run in runs.items() if what != "lost"]
    closes = max(ends).timestamp() + ZOMBIE_AFTER_S + ZOMBIE_ALERT_LAG_S
    wait_for(lambda: time.time() >= closes, ZOMBIE_AFTER_S + ZOMBIE_ALERT_LAG_S + 5,
             "the ended runs' zombie-run windows to pass", 1)


@pytest.mark.timeout(900)  # the runs, the lost run's late window and zombie window (60 s after its heartbeat)
def test_alerts_come_once_and_only_for_failed_crashed_and_late_runs_and_a_failing_scheduled_run_calls_the_webhook(
    prefect_server, mlp_sources, tmp_path, webhook
):
    """The false-alert trial: ended runs get no late alert, even where their start and end events come together;
    a late event and a Failed event posted twice alert once each (runs announced by hand). Completed, skipped and
    export-only runs get no webhook call (neither from the late nor from the zombie-run automation: the trial ends
    after their windows); a failed run gets one, a run still running past --late-after gets one, and the same run
    killed with its host gets one more when the zombie-run automation marks it Crashed. Meanwhile a second served
    deployment's scheduled run (created by the server's scheduler) fails and calls the webhook with the stage's
    error. ``ortflow automations`` leaves the late bound where the flow runs read it."""
    from ortflow.tasks.events import read_late_after

    url, calls = webhook
    late = f"ortflow run still running after {LATE_AFTER_S} s"
    out = _install("--webhook", url, "--late-after", str(LATE_AFTER_S), "--zombie-after", str(ZOMBIE_AFTER_S))
    assert "ortflow-run-failed" in out and "ortflow-zombie-runs" in out
    assert read_late_after() == LATE_AFTER_S
    by_hand = _post_hand_made_events(LATE_AFTER_S)
    with _three_serves(prefect_server, tmp_path, mlp_sources) as (procs, _):
        runs = _start_runs(_deployment_ids(), procs, calls)
        states = {what: wait_for(lambda r=run: _final_state(r.id), 300, f"the {what} run to end")
                  for what, run in runs.items() if what != "lost"}
        assert [states[w].name for w in ("completed", "skipped", "export-only", "failed")] == [
            "Completed", "Skipped", "Completed", "Failed"], states
        stop_serve(procs["trial"])  # nothing more to run: its runner's polls would only load the server
        _scheduled_failure(calls)
        stop_serve(procs["alerting"])  # before its schedule's next run
        state = wait_for(lambda: _final_state(runs["lost"].id), 240, "the zombie-run automation to mark the run "
                         "Crashed", 1)
        assert state.name == "Crashed" and "heartbeat" in (state.message or ""), state
        wait_for(lambda: len([c for c in calls if c.get("flow_run_id") == str(runs["lost"].id)]) == 2, 120,
                 "the alert for the run the zombie-run automation ended", 0.5)
        _windows_passed(runs)
    hand_alerts = sorted((c["flow_run_id"], c["alert"]) for c in calls if c["flow_run_id"] in {
        by_hand["failed"], by_hand["late"], *by_hand["ended"]})
    assert hand_alerts == sorted([(by_hand["failed"], "ortflow run Failed"), (by_hand["late"], late)]), calls
    by_run = {what: [c["alert"] for c in calls if c.get("flow_run_id") == str(run.id)] for what, run in runs.items()}
    durations = {what: (round((r.end_time - r.start_time).total_seconds(), 1),
                        round((r.updated - r.start_time).total_seconds(), 1)) for what, run in runs.items()
                 if what != "lost" and (r := read_flow_run(run.id))}
    print(f"false-alert trial: {len(runs)} runs, {len(calls)} webhook call(s): {by_run}; run seconds (recorded, "
          f"stored) {durations}")
    for what, (seconds, stored) in durations.items():
        assert _late_alerts_match(by_run[what], seconds, stored, late), (what, seconds, stored, by_run)
    assert by_run["lost"] == [late, f"ortflow run Crashed (no heartbeat for {ZOMBIE_AFTER_S} s)"], by_run
    assert {what: [a for a in alerts if a != late] for what, alerts in by_run.items() if what != "lost"} == {
        **{what: [] for what in ("completed", "skipped", "export-only")},
        "failed": ["ortflow run Failed"],
    }, by_run
    # The other calls are the alerting deployment's scheduled runs' (the one that failed, and any that serve's stop
    # ended or that ran past the late bound).
    scheduled = {str(r.id) for r in flow_runs_of("train-pipeline/alerting")} - {str(runs["failed"].id)}
    assert len(calls) == len(hand_alerts) + sum(len(alerts) for alerts in by_run.values()) + len(
        [c for c in calls if c.get("flow_run_id") in scheduled]), calls
