"""``ortflow serve``'s stop: its runner's poller (Prefect's ``ScheduledRunPoller``, which submits nothing while its
``stopping`` flag is set) is told to stop before the flow runs stop, so the slot a stopped run frees does not start a
queued run that the pause then deletes on the server; after the pause it drops the queued runs, then the runs the
server's scheduler still inserts; a run whose start was under way is stopped after that; the queued runs it drops are
named in a warning (shown in serve's terminal)."""

from __future__ import annotations

import asyncio
import logging
import types

from ortflow.deployments import serving


def test_a_stopping_serve_stops_polling_before_its_runs_stop_and_stops_a_run_started_meanwhile(monkeypatch):
    runner = serving.StoppingRunner()
    runner.started = True
    runner._scheduled_run_poller = types.SimpleNamespace(stopping=False)  # created when the runner starts
    runner._client = None  # the fakes below need no server
    steps = []

    def stop_flow_runs():
        steps.append(("flow runs", runner.stopping, runner._scheduled_run_poller.stopping))
        return []

    async def pause():
        steps.append("pause")

    async def astop():
        steps.append("astop")

    async def no_runs(client, ids):
        steps.append("drop")
        return []

    async def no_late_runs(client, ids):
        steps.append("drop late inserts")
        return []

    monkeypatch.setattr(serving, "stop_flow_runs", stop_flow_runs)
    monkeypatch.setattr(serving, "drop_scheduled_runs", no_runs)
    monkeypatch.setattr(serving, "drop_late_inserts", no_late_runs)
    monkeypatch.setattr(runner, "_pause_schedules", pause)
    monkeypatch.setattr(runner, "astop", astop)
    asyncio.run(runner._stop())
    assert steps == [("flow runs", True, True), "pause", "drop", "drop late inserts", ("flow runs", True, True),
                     "astop"]


def test_a_stopping_serve_names_the_queued_scheduled_runs_it_drops_in_a_warning(monkeypatch, caplog):
    runner = serving.StoppingRunner()
    runner.started = True
    runner._client = None  # the fake below needs no server

    async def nothing():
        pass

    async def queued(client, ids):
        return ["cerise-nyala", "fabulous-worm"]

    async def no_late_runs(client, ids):
        return []

    monkeypatch.setattr(serving, "stop_flow_runs", lambda: [])
    monkeypatch.setattr(serving, "drop_scheduled_runs", queued)
    monkeypatch.setattr(serving, "drop_late_inserts", no_late_runs)
    monkeypatch.setattr(runner, "_pause_schedules", nothing)
    monkeypatch.setattr(runner, "astop", nothing)
    with caplog.at_level(logging.INFO, logger="ortflow"):
        asyncio.run(runner._stop())
    dropped = [r for r in caplog.records if r.getMessage().startswith("dropped 2 queued scheduled run(s)")]
    assert [(r.levelno, r.getMessage()) for r in dropped] == [
        (logging.WARNING, "dropped 2 queued scheduled run(s): cerise-nyala, fabulous-worm")]
