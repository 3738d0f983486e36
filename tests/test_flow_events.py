"""The events ortflow's flows emit for its automations (no server): names, ids, and the start event an end event
follows; the alert automations' bounds."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from uuid import uuid4

import pytest
from prefect.states import Completed, Crashed, Failed, Running

from ortflow.deployments import alerts
from ortflow.tasks.events import FOLLOW_WITHIN, event_id, run_event, state_event


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


def test_alert_windows_close_on_ortflow_end_events_and_a_failed_run_alerts_once_per_window():
    from uuid import uuid4 as new_id

    specs = {s["name"]: s["trigger"] for s in alerts.render(new_id(), 3600, 90, new_id())}
    late, failed = specs["ortflow-run-late"], specs["ortflow-run-failed"]
    # Prefect's own end events (other than the zombie-run automation's Crashed) arrive together with ortflow's and
    # would evaluate the same window at once.
    assert set(late["expect"]) == {f"ortflow.flow-run.{s}" for s in (
        "Completed", "Skipped", "Failed", "TimedOut", "Crashed", "Cancelled")} | {"prefect.flow-run.Crashed"}
    assert late["after"] == ["ortflow.flow-run.Running"] and late["within"] == 3600
    assert failed["for_each"] == ["prefect.resource.id"] and failed["within"] > 0 and failed["posture"] == "Reactive"
