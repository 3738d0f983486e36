"""``ortflow serve`` and ``ortflow automations``: the Prefect deployments on a schedule, and their alerts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from ortflow.cli.shared import ConfigArg, SetOpt, console, fail, load, say


def serve(
    config: ConfigArg,
    overrides: SetOpt = None,
    limit: Annotated[int | None, typer.Option(help="Most flow runs at once (default: no limit).")] = None,
    catch_up: Annotated[bool, typer.Option(
        "--catch-up", help="Run the scheduled runs missed while nothing served the deployments (default: drop them)."
    )] = False,
) -> None:
    """Serve train-pipeline/<name> and export-only/<name> on the config's schedule until Ctrl-C or SIGTERM.

    A stop signal stops the running flow runs with a stop checkpoint, pauses both deployments' schedules and drops
    the scheduled runs they queued, then exits 130 (SIGINT) or 143 (SIGTERM). Serving again resumes the schedules;
    scheduled runs whose time passed while nothing served them are dropped unless --catch-up is given.
    """
    from prefect.settings import PREFECT_API_URL

    from ortflow.deployments import serve_config
    from ortflow.tasks import crash_vanished_runs

    cfg = load(config, overrides)
    if not PREFECT_API_URL.value():
        # Prefect would start a temporary server inside this process's group: the first Ctrl-C stops it before the
        # schedules are paused, and no other terminal can reach it to start a run.
        fail("ortflow serve registers its deployments on a Prefect server: start one (prefect server start), set "
             "PREFECT_API_URL (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api) and run again")
    for name in crash_vanished_runs():  # runs of this host whose process is gone (an earlier serve killed -9)
        say(f"flow run {name} was still Running, but its process is gone: marked Crashed")
    stopped_by = serve_config(cfg, limit=limit, catch_up=catch_up, say=say)
    if stopped_by:
        console.print(f"ortflow serve stopped by a signal: schedules paused; `ortflow serve {escape(str(config))}` "
                      "resumes them", highlight=False)
        raise typer.Exit(128 + stopped_by)


def automations(
    webhook: Annotated[str | None, typer.Option(
        help="URL that gets a JSON POST when an ortflow deployment run fails, crashes, times out or is late.")] = None,
    late_after: Annotated[int, typer.Option(
        help="Seconds after its start at which a still running run is late (at least 10).")] = 6 * 3600,
    zombie_after: Annotated[int, typer.Option(
        help="Seconds without a heartbeat after which a run is marked Crashed (at least 60).")] = 90,
) -> None:
    """Install ortflow's Prefect automations on the server PREFECT_API_URL names (replacing earlier ones).

    Always the zombie-run automation (no heartbeat for --zombie-after seconds: the run is marked Crashed); with
    --webhook also the alerts (a Webhook block named ortflow-alerts). They match flow runs tagged ortflow.
    """
    from prefect.settings import PREFECT_API_URL

    from ortflow.deployments.alerts import install

    if not PREFECT_API_URL.value():
        fail("automations live on a Prefect server: set PREFECT_API_URL (e.g. prefect config set "
             "PREFECT_API_URL=http://127.0.0.1:4200/api) and run again")
    try:
        names = install(webhook, late_after, zombie_after)
    except ValueError as err:
        fail(str(err))
    console.print(f"[green]installed[/] {', '.join(names)} on {escape(str(PREFECT_API_URL.value()))}",
                  highlight=False)
