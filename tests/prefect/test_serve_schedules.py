"""``ortflow serve`` and its deployments' schedules against a real local Prefect server: a stop signal (even one
while serve registers its deployments) pauses the schedules and drops the runs they queued before serve exits 143;
serving again resumes the schedules, and drops the scheduled runs whose time passed while nothing served them unless
``--catch-up``; a serving process killed with SIGKILL pauses nothing."""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.prefect.serving import flow_runs_of, serving
from tests.support.prefect_runs import mlp_config, wait_for, write_config

pytestmark = pytest.mark.prefect


def _deployment(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def _backfill(deployment, hours: int) -> list:
    """What the server's scheduler leaves when nobody serves an active deployment: auto-scheduled runs whose start
    time has passed (the server's own backfill endpoint makes them). Sent through Prefect's client, which retries
    what a busy server answers (503, 429) as it does for every other call."""
    from prefect.client.orchestration import get_client

    now = datetime.now(UTC)
    with get_client(sync_client=True) as client:
        client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment.id}, json={
            "start_time": (now - timedelta(hours=hours, minutes=30)).isoformat(),
            "end_time": (now - timedelta(minutes=1)).isoformat(), "max_runs": hours})
    return _waiting(f"train-pipeline/{deployment.name}")


def _waiting(deployment_name: str, overdue_only: bool = True) -> list:
    """The deployment's auto-scheduled runs waiting to start (a run read while serve deletes it has no state)."""
    now = datetime.now(UTC)
    return [r for r in flow_runs_of(deployment_name) if r.auto_scheduled and r.state and r.state.is_scheduled()
            and (not overdue_only or r.expected_start_time < now)]


def test_serve_pauses_its_schedules_on_sigterm_and_drops_the_backlog_on_restart(prefect_server, mlp_sources, tmp_path):
    cfg = mlp_config(tmp_path, mlp_sources, "schedules", schedule={"interval_s": 3600},
                     distributed={"num_ranks": 1, "threads_per_rank": 1},
                     train={"num_train_steps": 4, "display_loss_steps": 2, "evaluation_period": 0},
                     checkpoint={"period": 4, "max_num_checkpoints": 1})
    config_file = write_config(cfg, tmp_path / "schedules.yaml")
    # A stop signal the moment the first deployment exists (serve still registers the second, drops the backlog or
    # starts its runner): both end registered and paused.
    log = tmp_path / "serve0.log"
    with serving(config_file, prefect_server, "schedules", tmp_path, log, flows=("train-pipeline",)) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    assert _deployment("train-pipeline/schedules").paused and _deployment("export-only/schedules").paused

    # Runs whose time passed while nothing served the deployment: serving again resumes the schedules and drops them.
    missed = _backfill(_deployment("train-pipeline/schedules"), 3)
    assert len(missed) == 3, missed
    log = tmp_path / "serve1.log"
    with serving(config_file, prefect_server, "schedules", tmp_path, log) as proc:
        wait_for(lambda: not _deployment("train-pipeline/schedules").paused, 90, "serve to resume the schedule")
        wait_for(lambda: not _waiting("train-pipeline/schedules"), 60, "the missed runs to be dropped")
        wait_for(lambda: _waiting("train-pipeline/schedules", overdue_only=False), 60,
                 "the scheduler to schedule the next run")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "never awaited" not in text and "Traceback" not in text, text[-3000:]
    assert any(line.startswith("serving train-pipeline/schedules (every 3600 s) and export-only/schedules on http")
               for line in text.splitlines()), text[-3000:]
    assert "schedules paused" in text and "dropped 3 scheduled run(s) missed while nothing served them" in text
    assert _deployment("train-pipeline/schedules").paused and _deployment("export-only/schedules").paused
    assert _waiting("train-pipeline/schedules", overdue_only=False) == []
    assert not [r for r in flow_runs_of("train-pipeline/schedules") if r.id in {m.id for m in missed}]

    # With --catch-up the missed run runs (and completes) under the restarted serve; a serving process that vanished
    # (SIGKILL) pauses nothing.
    missed = _backfill(_deployment("train-pipeline/schedules"), 1)
    assert len(missed) == 1, missed
    with serving(config_file, prefect_server, "schedules", tmp_path, tmp_path / "serve2.log",
                 extra=["--catch-up"]) as proc:
        wait_for(lambda: [r for r in flow_runs_of("train-pipeline/schedules") if r.id == missed[0].id
                          and r.state.is_completed()], 300, "the missed run to complete")
        assert not _deployment("train-pipeline/schedules").paused
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not _deployment("train-pipeline/schedules").paused
    assert Path(cfg.output_dir / "registry.json").exists()


def test_runs_the_scheduler_inserts_after_the_pause_are_dropped_too(prefect_server):
    """The server's scheduler reads the active deployments and inserts their next runs in separate transactions: a
    pass that read a deployment before serve paused it inserts runs after serve dropped the queued ones. Serve's stop
    keeps looking until none has appeared for a while; here the late insert (the server's own schedule endpoint) lands
    between the drop's first and second look, whatever the machine's load."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    from ortflow.deployments.backlog import drop_late_inserts, scheduled_runs

    class LatePass:
        """The server's client, except that a scheduler pass inserts the deployment's next 3 runs just before the
        drop's second look at them."""

        def __init__(self, client, deployment_id):
            self.client, self.deployment_id, self.looks = client, deployment_id, 0

        def __getattr__(self, name):
            return getattr(self.client, name)

        async def read_flow_runs(self, **kwargs):
            self.looks += 1
            if self.looks == 2:
                now = datetime.now(UTC)
                await self.client.request("POST", "/deployments/{id}/schedule", path_params={"id": self.deployment_id},
                                          json={"start_time": now.isoformat(),
                                                "end_time": (now + timedelta(hours=3)).isoformat(), "max_runs": 3})
            return await self.client.read_flow_runs(**kwargs)

    async def scenario():
        async with get_client() as client:
            flow_id = await client.create_flow_from_name("late-inserts")
            # Created paused: the scheduler itself adds nothing; the insert is the one late pass's.
            deployment_id = await client.create_deployment(flow_id, "late-inserts", paused=True, schedules=[
                DeploymentScheduleCreate(schedule=IntervalSchedule(interval=timedelta(hours=1)), active=True)])
            late = LatePass(client, deployment_id)
            dropped = await drop_late_inserts(late, [deployment_id], quiet_s=1.0, poll_s=0.2)
            return late.looks, dropped, await scheduled_runs(client, [deployment_id])

    looks, dropped, left = asyncio.run(scenario())
    assert looks >= 3 and len(set(dropped)) == 3  # the three runs the late pass made, each dropped once, then quiet
    assert left == []
