"""The events ortflow's flows emit when a run starts and when it ends, which ortflow's automations react to
(``ortflow automations``, ``ortflow/deployments/automations.yaml``).

Prefect's server evaluates automations with two consumers that take events off one queue concurrently. When a run's
start and end events wait in that queue together (a busy server lags behind a short run: a skipped or an export-only
run ends seconds after it starts), the end event can be evaluated before the start event's window is stored, and the
window it should close stays open until the "late" alert fires for a run that ended long ago. An end event therefore
names the start event it follows (Prefect's causal ordering: the server holds a follower until its leader has been
evaluated). Each event's id derives from the flow-run state it announces, so announcing a state twice sends the
same event, which the server takes once.
"""

from __future__ import annotations

import contextvars
import threading
from datetime import timedelta
from typing import Any
from uuid import NAMESPACE_URL, UUID, uuid4, uuid5

from ortflow.protocol import LATE_AFTER_VARIABLE

#: State names that keep their own event name; every other state is announced by its type (``Cached`` is a
#: ``Completed``).
_NAMED_STATES = ("Skipped", "TimedOut")
#: An end event follows its start event only when the two are this close: the server remembers the events it has
#: evaluated for 30 minutes and holds a follower whose leader it does not know for 15 (Prefect's own events follow
#: their predecessor within 5 minutes).
FOLLOW_WITHIN = timedelta(minutes=5)
_NAMESPACE = uuid5(NAMESPACE_URL, "https://ortflow/events")
#: The start event of each flow run this process runs (the end hooks run in the same process).
_STARTED: dict[str, Any] = {}
LATE_EVENT = "ortflow.flow-run.late"
#: The late timer of each flow run this process runs, cancelled when the run ends.
_LATE_TIMERS: dict[str, threading.Timer] = {}


def state_event(state: Any) -> str:
    """The event ortflow emits for a flow run entering ``state``: ``ortflow.flow-run.<Running|Completed|Skipped|
    Failed|TimedOut|Crashed|Cancelled>``."""
    name = state.name if state.name in _NAMED_STATES else state.type.value.title()
    return f"ortflow.flow-run.{name}"


def event_id(state: Any) -> UUID:
    """The id of the event announcing ``state``: the same for the same state (a state without an id gets a new
    one)."""
    return uuid5(_NAMESPACE, f"flow-run-state/{state.id}") if getattr(state, "id", None) else uuid4()


def _related(flow_run: Any) -> list[dict[str, str]]:
    related = [{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}
               for tag in sorted(flow_run.tags or ())]
    if flow_run.deployment_id:
        related.append({"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                        "prefect.resource.role": "deployment"})
    return related


def late_event(flow_run: Any, late_after_s: float) -> Any:
    """The event a run still running ``late_after_s`` after it started emits (one id per run: sent twice, taken
    once)."""
    from prefect.events import Event

    return Event(id=uuid5(_NAMESPACE, f"flow-run-late/{flow_run.id}"), event=LATE_EVENT,
                 resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                           "prefect.resource.name": flow_run.name, "ortflow.late-after-s": str(late_after_s)},
                 related=_related(flow_run))


def run_event(flow_run: Any, state: Any, started: Any = None) -> Any:
    """The event announcing that ``flow_run`` entered ``state``; an end event follows ``started`` (the run's start
    event) when that is less than :data:`FOLLOW_WITHIN` older."""
    from prefect.events import Event

    related = _related(flow_run)
    event = Event(
        id=event_id(state),
        event=state_event(state),
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name,
                  "ortflow.state-message": str(state.message or "")[:1000]},
        related=related,
    )
    if started is not None and timedelta(0) <= event.occurred - started.occurred < FOLLOW_WITHIN:
        event.follows = started.id
    return event


def announce_state(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow-run hook: emit :func:`run_event` when a run starts (Running) and when it ends (Completed, Skipped,
    Failed, TimedOut, Crashed, Cancelled), the events ortflow's automations (``ortflow automations``) react to.

    Prefect's own state events of a run created by the server's scheduler follow a state that had no event, and its
    automations hold such followers for many minutes before evaluating them; these events follow nothing but the
    run's own start event, so alerts and the zombie-run automation see them at once (:func:`post_event`). A started
    run also starts its late timer (:func:`start_late_timer`), which its end stops.
    """
    started = None if state.is_running() else _STARTED.pop(str(flow_run.id), None)
    event = run_event(flow_run, state, started)
    if state.is_running():
        _STARTED[str(flow_run.id)] = event
    else:
        stop_late_timer(flow_run)
    post_event(event, started if event.follows else None)
    if state.is_running():
        start_late_timer(flow_run, read_late_after())


def post_event(event: Any, follows: Any = None) -> None:
    """Post ``event`` to the server's events endpoint (sent once: Prefect's events client sends every event it has
    not had confirmed again each time its connection is renewed); a server without the endpoint (Prefect Cloud) gets
    it through the events client."""
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event

    try:
        with get_client(sync_client=True) as client:
            client.request("POST", "/events", json=[event.model_dump(mode="json")]).raise_for_status()
    except Exception:  # noqa: BLE001 - the events client instead
        emit_event(event=event.event, resource=dict(event.resource), related=[dict(r) for r in event.related],
                   id=event.id, occurred=event.occurred, follows=follows)


def read_late_after() -> float | None:
    """The late bound the installed automations use (seconds), or None (none installed, or no server)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            variable = client.read_variable_by_name(LATE_AFTER_VARIABLE)
    except Exception:  # noqa: BLE001 - a run without a reachable server is not watched for lateness
        return None
    return float(variable.value) if variable is not None and variable.value is not None else None


def start_late_timer(flow_run: Any, late_after_s: float | None, post=None) -> None:
    """Emit :func:`late_event` if ``flow_run`` is still running ``late_after_s`` from now (``post`` sends it:
    :func:`post_event` by default); nothing when ``late_after_s`` is None or the run's timer already runs (a retry
    keeps the clock of the run's first start)."""
    key = str(flow_run.id)
    if late_after_s is None or key in _LATE_TIMERS:
        return
    send = post or post_event

    def fire() -> None:
        if _LATE_TIMERS.get(key) is not timer:  # the run ended meanwhile
            return
        del _LATE_TIMERS[key]
        try:
            send(late_event(flow_run, late_after_s))
        except Exception as exc:  # noqa: BLE001 - a timer thread has nobody to raise to
            print(f"ortflow: could not announce flow run {flow_run.name} late: {exc}", flush=True)

    # The timer thread runs ``fire`` in a copy of this context: it posts to the server this run talks to (settings
    # given per context would otherwise be missing there).
    timer = threading.Timer(late_after_s, contextvars.copy_context().run, args=(fire,))
    timer.daemon = True
    _LATE_TIMERS[key] = timer
    timer.start()


def stop_late_timer(flow_run: Any) -> None:
    """The run ended: it will not announce itself late."""
    timer = _LATE_TIMERS.pop(str(flow_run.id), None)
    if timer is not None:
        timer.cancel()
