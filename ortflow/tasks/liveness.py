"""Flow runs whose process vanished: each flow run records the process that runs it (host, pid and the pid's start
time, as flow-run labels), and whoever talks to the server next (``ortflow run``, ``ortflow serve``) marks the runs
of this host whose process is gone ``Crashed``.

A ``kill -9`` of ``ortflow run`` (or of a serving process and its flow runs) leaves no process to report the flow
run's end; without this, its temporary server's database would show it ``Running`` forever.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PID_LABEL, HOST_LABEL, START_LABEL = "ortflow.pid", "ortflow.host", "ortflow.pid-start"
#: The boot and pid namespace the pid belongs to: containers may share a host name, never both of these.
PIDS_LABEL = "ortflow.pid-namespace"
#: States of a flow run whose process should be alive.
_LIVE_TYPES = ("PENDING", "RUNNING", "CANCELLING")


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), None when it is
    gone: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def pid_namespace() -> str:
    """This process's boot id and pid namespace (``<boot id>:<namespace inode>``; empty parts where unknown)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return f"{boot}:{namespace}"


#: Seconds the Running hook waits for the server to take the labels before the run goes on without waiting.
LABEL_WAIT_S = 10.0


def quiet_console(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow-run hook (Running): in a process Prefect started for the run (a worker's), its terminal shows a failed
    stage as one line and no traceback, as ``ortflow serve``'s does; the run's log on the server keeps the traceback
    (:func:`ortflow.deployments.run_console.quiet_console`)."""
    from ortflow.deployments.run_console import quiet_console as install

    install()


def record_process(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow-run hook (Running): label the flow run with the host, pid and pid start time of this process.

    The labels are sent from a thread the hook waits for at most :data:`LABEL_WAIT_S`: a busy server (SQLite under
    load answers "database is locked" and the client retries with back-off for a minute and more) must not hold up
    the run; the labels follow when the server takes them. The thread runs in a copy of this context, so it talks
    to the server this run talks to (settings given per context, like ``ortflow run``'s temporary server's URL,
    would otherwise be missing there, and Prefect would start a server of its own for the thread)."""
    pid = os.getpid()
    labels = {HOST_LABEL: socket.gethostname(), PIDS_LABEL: pid_namespace(), PID_LABEL: str(pid),
              START_LABEL: process_start(pid) or ""}
    sender = threading.Thread(target=contextvars.copy_context().run, args=(_send_labels, flow_run, labels),
                              name="ortflow-labels", daemon=True)
    sender.start()
    sender.join(LABEL_WAIT_S)
    if sender.is_alive():
        log.warning("the Prefect server has not taken flow run %s's process labels within %.0f s (it is busy): the "
                    "run goes on, the labels follow", flow_run.name, LABEL_WAIT_S)


def _send_labels(flow_run: Any, labels: dict[str, str]) -> None:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(flow_run.id, labels)
    except Exception as err:  # noqa: BLE001 - a label is a convenience; the run goes on without it
        log.warning("could not label flow run %s with its process: %s", flow_run.name, err)


def vanished(labels: dict, host: str, pids: str | None = None) -> bool:
    """Whether the labels name a process of ``host`` (and of the pid namespace ``pids``, default this process's)
    that no longer runs (False for other hosts or namespaces, or no labels)."""
    if labels.get(HOST_LABEL) != host or not str(labels.get(PID_LABEL, "")).isdigit():
        return False
    if labels.get(PIDS_LABEL) != (pids or pid_namespace()):
        return False
    start = process_start(int(labels[PID_LABEL]))
    return start is None or start != labels.get(START_LABEL)


def crash_vanished_runs() -> list[str]:
    """Mark ``Crashed`` every flow run of the configured server that should be running on this host but whose
    process is gone; returns their names. Best effort: a server that cannot be read is left alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    host, crashed = socket.gethostname(), []
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType(t) for t in _LIVE_TYPES]))), limit=200)
            for run in runs:
                if not vanished(dict(run.labels or {}), host):
                    continue
                message = (f"The process running this flow run (pid {run.labels[PID_LABEL]} on {host}) is gone: it "
                           "was killed without a chance to report (kill -9, an OOM kill)")
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                crashed.append(run.name)
    except Exception as err:  # noqa: BLE001 - never fail the command that happened to talk to the server
        log.debug("could not look for flow runs whose process vanished: %s", err)
        return crashed
    for name in crashed:
        log.warning("flow run %s was still Running, but its process is gone: marked Crashed", name)
    return crashed
