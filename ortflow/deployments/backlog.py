"""The scheduled runs a deployment owes while nobody serves it, and dropping them.

Pausing a deployment deletes its future scheduled runs, except those already waiting for its concurrency slot
(``AwaitingConcurrencySlot``); a serving process killed without a word (``kill -9``, a lost host) pauses nothing,
and the server's scheduler keeps adding runs whose start time passes. ``ortflow serve`` drops both kinds: the
waiting ones when it stops (and the next runs a scheduler pass that began before the pause still adds), the overdue
ones when it starts (unless ``--catch-up``), so a restart does not replay them. Runs somebody created by hand
(``prefect deployment run``, the UI) are never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from uuid import UUID

log = logging.getLogger(__name__)


async def scheduled_runs(client, deployment_ids: Iterable[UUID], before: datetime | None = None) -> list:
    """The deployments' runs the scheduler created that have not started (Scheduled, Late, AwaitingConcurrencySlot),
    those expected to start before ``before`` only when given."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    ids = list(deployment_ids)
    if not ids:
        return []
    runs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
            expected_start_time=FlowRunFilterExpectedStartTime(before_=before) if before else None),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)),
    )
    return [run for run in runs if run.auto_scheduled and not run.run_count]


async def drop_scheduled_runs(client, deployment_ids: Iterable[UUID], before: datetime | None = None) -> list[str]:
    """Delete what :func:`scheduled_runs` finds; returns the names of the runs deleted."""
    from prefect.exceptions import ObjectNotFound

    dropped = []
    for run in await scheduled_runs(client, deployment_ids, before):
        try:
            await client.delete_flow_run(run.id)
        except ObjectNotFound:  # it started, or the server deleted it, meanwhile
            continue
        dropped.append(run.name)
    return dropped


async def drop_late_inserts(client, deployment_ids: Iterable[UUID], quiet_s: float = 2.0, limit_s: float = 15.0,
                            poll_s: float = 0.5) -> list[str]:
    """After paused deployments' scheduled runs were dropped: drop the runs the server's scheduler still inserts.

    Prefect's scheduler services read which deployments are active in one transaction and insert those deployments'
    next runs in another, without reading them again: a cycle that read a deployment before it was paused inserts its
    runs after the pause (and after any drop), once per cycle under way. Polls until no scheduled run has appeared
    for ``quiet_s`` seconds (or ``limit_s`` have passed); returns the names of the runs deleted.
    """
    ids = list(deployment_ids)
    dropped: list[str] = []
    start = quiet_since = time.monotonic()
    while ids and time.monotonic() - quiet_since < quiet_s and time.monotonic() - start < limit_s:
        await asyncio.sleep(poll_s)
        found = await drop_scheduled_runs(client, ids)
        if found:
            dropped += found
            quiet_since = time.monotonic()
    return dropped


async def drop_backlog(deployment_ids: Iterable[UUID], now: datetime | None = None) -> list[str]:
    """Delete the scheduled runs whose start time has passed (the backlog of a time nobody served them)."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        dropped = await drop_scheduled_runs(client, deployment_ids, now or datetime.now(UTC))
    if dropped:
        log.warning("dropped %d scheduled run(s) missed while nothing served them (%s); `ortflow serve --catch-up` "
                    "runs them instead", len(dropped), ", ".join(dropped[:5]) + (", ..." if len(dropped) > 5 else ""))
    return dropped
