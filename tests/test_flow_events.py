"""The events ortflow's flows emit for its automations (no server): names, ids, the start event an end event
follows, the late event a running run emits; the alert automations' triggers and bounds."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from uuid import uuid4

import pytest
from prefect.states import Completed, Crashed, Failed, Running

from ortflow.deployments import alerts
from ortflow.tasks.events import (
    FOLLOW_WITHIN,
    LATE_EVENT,
    event_id,
    late_event,
    run_event,
    start_late_timer,
    state_event,
    stop_late_timer,
)


def _flow_run():
    return SimpleNamespace(id=uuid4(), name="brave-otter", tags=["ortflow", "nightly"], deployment_id=uuid4())


def test_state_events_are_named_after_the_state_a_skipped_run_by_its_name():
    assert [state_event(s) for s in (Running(), Completed(), Completed(name="Skipped"), Failed(), Crashed())] == [
        "ortflow.flow-run.Running", "ortflow.flow-run.Completed", "ortflow.flow-run.Skipped",
        "ortflow.flow-run.Failed", "ortflow.flow-run.Crashed"]


def test_announcing_the_same_state_twice_gives_the_same_event_id_and_another_state_another():
    run, failed = _flow_run(), Failed(message="boom")
    first, again = run_event(run, failed), run_event(run, failed)
    assert first.id == again.id == event_id(failed)
    assert run_event(run, Failed(message="boom")).id != first.id


def test_an_end_event_follows_its_start_event_only_while_the_server_remembers_it():
    run = _flow_run()
    start = run_event(run, Running())
    end = run_event(run, Completed(name="Skipped"), start)
    assert end.follows == start.id and start.follows is None
    assert end.resource["prefect.resource.id"] == f"prefect.flow-run.{run.id}"
    assert {r["prefect.resource.id"] for r in end.related} >= {"prefect.tag.ortflow", "prefect.tag.nightly"}
    start.occurred -= FOLLOW_WITHIN + timedelta(seconds=1)  # a run that ran longer than that
    assert run_event(run, Completed(), start).follows is None


def test_a_late_window_shorter_than_prefect_takes_is_refused_before_anything_is_installed():
    with pytest.raises(ValueError, match=r"--late-after 9: give at least 10 s"):
        alerts.install("http://127.0.0.1:9/hook", late_after_s=9)
    with pytest.raises(ValueError, match=r"--zombie-after 59: give at least 60 s"):
        alerts.install(None, zombie_after_s=59)


def test_a_webhook_that_is_not_an_http_url_is_refused_before_anything_is_installed():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing answers there
        for url in ("hooks.example.com/ortflow", "ftp://hooks.example.com/x", "https://"):
            with pytest.raises(ValueError, match=rf"--webhook {url}: give an http:// or https:// URL"):
                alerts.install(url)


def test_the_late_and_failed_alerts_react_to_one_event_and_alert_once_per_run():
    from uuid import uuid4 as new_id

    specs = {s["name"]: s for s in alerts.render(new_id(), 3600, 90, new_id())}
    late, failed = specs["ortflow-run-late"]["trigger"], specs["ortflow-run-failed"]["trigger"]
    assert late["posture"] == "Reactive" and late["expect"] == [LATE_EVENT]
    assert "after 3600 s" in specs["ortflow-run-late"]["actions"][0]["payload"]
    for trigger in (late, failed):
        assert trigger["for_each"] == ["prefect.resource.id"] and trigger["within"] > 0
    assert failed["posture"] == "Reactive"
    zombie = specs["ortflow-zombie-runs"]["trigger"]  # every end closes the zombie window
    assert {f"ortflow.flow-run.{s}" for s in ("Completed", "Skipped", "Failed", "TimedOut", "Crashed",
                                             "Cancelled")} <= set(zombie["expect"])


def _posted():
    sent, done = [], threading.Event()

    def post(event):
        sent.append(event)
        done.set()
    return sent, done, post


def test_a_run_still_running_at_the_late_bound_announces_itself_late_once_to_the_server_it_runs_on():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    run = _flow_run()
    sent, done, post = _posted()
    servers = []
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # the run's server, per context
        start_late_timer(run, 0.05, lambda event: (servers.append(PREFECT_API_URL.value()), post(event)))
        start_late_timer(run, 0.05, post)  # a retry's Running keeps the first start's clock
    assert done.wait(10), "no late event"
    time.sleep(0.2)
    assert [e.event for e in sent] == [LATE_EVENT]
    assert servers == ["http://127.0.0.1:9/api"]  # the timer's thread talks to it, not to a server of its own
    assert sent[0].resource["prefect.resource.id"] == f"prefect.flow-run.{run.id}"
    assert sent[0].id == late_event(run, 0.05).id  # sent twice, taken once


def test_a_run_that_ends_before_the_late_bound_never_announces_itself_late():
    run = _flow_run()
    sent, done, post = _posted()
    start_late_timer(run, 0.3, post)
    stop_late_timer(run)
    assert not done.wait(0.6) and sent == []
    start_late_timer(run, None, post)  # no late bound installed: no timer
    assert not done.wait(0.1) and sent == []
