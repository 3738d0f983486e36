"""Serve ``train-pipeline/<name>`` and ``export-only/<name>`` for one run config, on the config's schedule.

Deployments point at the flows by module path (``ortflow.flows.pipeline:train_pipeline``). Prefect imports a module
entrypoint with the working folder first on ``sys.path``, so ``serve_config`` moves to a folder of its own before
serving: the runner's flow-run processes then import the installed ortflow, whatever the folder ``ortflow serve``
was started from holds (a checkout, a folder named ``ortflow``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner
from prefect.schedules import Cron, Interval, Schedule

from ortflow.config import RunConfig
from ortflow.deployments.alerts import HEARTBEAT_S
from ortflow.deployments.backlog import drop_backlog, drop_late_inserts, drop_scheduled_runs
from ortflow.deployments.run_console import write_logging_config
from ortflow.flows import export_only, train_pipeline
from ortflow.processes import process_alive


def config_schedules(cfg: RunConfig) -> list[Schedule]:
    """The pipeline's schedules from ``cfg.schedule``: one cron or one interval schedule, or none (run on demand)."""
    sched = cfg.schedule
    if sched.cron:
        return [Cron(sched.cron, timezone=sched.timezone)]
    if sched.interval_s:
        return [Interval(sched.interval_s, timezone=sched.timezone)]
    return []


def build_deployments(cfg: RunConfig) -> list[RunnerDeployment]:
    """The two deployments of a run config, both named ``cfg.name``.

    ``train-pipeline/<name>`` runs the whole pipeline with the config as its only parameter (JSON, validated against
    RunConfig when a run starts; ``prefect deployment run ... --param`` may replace it). ``export-only/<name>``
    exports the run folder's best checkpoint to ``export.path`` unless told another checkpoint and output.

    Args:
        cfg: The run config (its paths are absolute after loading).

    Returns:
        The deployments, ready for :func:`prefect.serve`.
    """
    tags = ["ortflow", cfg.name]
    pipeline = train_pipeline.to_deployment(
        cfg.name,
        schedules=config_schedules(cfg),
        # Each run (scheduled or not) trains a new model version under output_dir/versions/.
        parameters={"config": cfg.model_dump(mode="json"), "new_version": True},
        description=f"Train {cfg.model.path.name} into a new version under {cfg.output_dir} and export it.",
        tags=tags,
        entrypoint_type=EntrypointType.MODULE_PATH,
        concurrency_limit=1,  # one pipeline run at a time; a schedule overlapping a run waits for it
    )
    export = export_only.to_deployment(
        cfg.name,
        parameters={
            "checkpoint": str(cfg.output_dir / "latest"),
            "output": str(cfg.export_path),
            "outputs": list(cfg.export.outputs),
            "optimize": cfg.export.optimize,
            "quantize": cfg.export.quantize,
            "tolerance": cfg.export.tolerance,
        },
        description=f"Export a checkpoint of {cfg.output_dir} (default: the latest version's best) to a model.",
        tags=tags,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    return [pipeline, export]


def describe_schedule(cfg: RunConfig) -> str:
    """When the pipeline deployment runs, in words: ``every 60 s``, ``on cron '0 3 * * *' (UTC)`` or ``on demand``."""
    if cfg.schedule.cron:
        return f"on cron '{cfg.schedule.cron}' ({cfg.schedule.timezone})"
    if cfg.schedule.interval_s:
        return f"every {cfg.schedule.interval_s:g} s"
    return "on demand"


def serve_config(cfg: RunConfig, limit: int | None = None, catch_up: bool = False,
                 say: Callable[[str], None] | None = None) -> int | None:
    """Register both deployments and run their flow runs from this process until SIGTERM or SIGINT.

    The deployments' schedules are active while this runs. On a stop signal the flow runs stop (a stop checkpoint
    each), the schedules are paused and the runs they queued are dropped; a restart resumes the schedules, and drops
    the runs whose time passed while nothing served them unless ``catch_up``.

    Args:
        cfg: The run config.
        limit: Most flow runs at once (default: Prefect's, unlimited).
        catch_up: Run the scheduled runs missed while nothing served the deployments instead of dropping them.
        say: Gets one line once both deployments are registered: what is served, when, and on which server.

    Returns:
        The stop signal's number (None when the runner ended without one).
    """
    deployments = build_deployments(cfg)
    workdir = cfg.output_dir / ".ortflow" / "serve"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # flow runs start here (config paths are absolute): nothing here shadows the installed ortflow
    os.environ["PYTHONSAFEPATH"] = "1"  # and no script folder goes first on their sys.path either
    # Flow runs send a heartbeat this often: the zombie-run automation (`ortflow automations`) marks a run Crashed
    # when they stop.
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
    # Flow runs print to this terminal without tracebacks, a failed run as one line (their logs on the server keep
    # the tracebacks): Prefect's logging config with ortflow's console formatter and filter (run_console.py).
    os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(write_logging_config(workdir / "logging.yml"))
    started = datetime.now(UTC)  # runs the scheduler adds once the deployments are active start after this
    runner = StoppingRunner(limit=limit)
    # SIGTERM and Ctrl-C stop serve the same way from here on, while it registers the deployments and drops the
    # backlog too (the runner installs the same handler again when it starts; Python's default would end the
    # process at once, leaving the schedules active).
    signal.signal(signal.SIGTERM, runner.handle_sigterm)
    signal.signal(signal.SIGINT, runner.handle_sigterm)
    ids: list[UUID] = []
    try:
        # A stop signal while the deployments register waits until all are registered (a deployment interrupted
        # half-way could be created on the server after its id was lost, its schedule left active): then all of
        # them are paused below.
        runner.registering = True
        for deployment in deployments:
            ids.append(runner.add_deployment(deployment))  # registers it, its schedules active
        runner.registering = False
        if say is not None and runner.stop_signal is None:
            from prefect.settings import PREFECT_API_URL

            say(f"serving train-pipeline/{cfg.name} ({describe_schedule(cfg)}) and export-only/{cfg.name} on "
                f"{PREFECT_API_URL.value()}; Ctrl-C or SIGTERM stops")
        if runner.stop_signal is None:
            asyncio.run(_serve(runner, ids, None if catch_up else started))
    except (KeyboardInterrupt, TerminationSignal, SystemExit):
        pass
    if runner.stop_signal is not None and not runner.paused:  # stopped before the runner was up
        _pause(ids)
    log.info("ortflow serve stopped")
    return runner.stop_signal


def _pause(deployment_ids: list[UUID]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for deployment_id in deployment_ids:
            client.pause_deployment(deployment_id)


async def _serve(runner: StoppingRunner, deployment_ids: list[UUID], drop_before: datetime | None) -> None:
    if drop_before is not None:
        await drop_backlog(deployment_ids, drop_before)
    if runner.stop_signal is None:  # a stop signal meanwhile: nothing to start (serve_config pauses the schedules)
        await runner.start()


log = logging.getLogger(__name__)

#: Seconds a flow run gets to stop after SIGTERM: the ranks' stop grace plus the flow run's final state report.
FLOW_RUN_STOP_S = 60.0


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found





def _is_flow_run_process(pid: int) -> bool:
    try:
        return b"prefect.engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def stop_flow_runs(timeout_s: float = FLOW_RUN_STOP_S) -> list[int]:
    """SIGTERM every flow-run process this process started and wait (up to ``timeout_s``) until they have exited.

    A flow run's process turns SIGTERM into a stop: the train task's launcher asks the ranks to stop after the
    current update with a stop checkpoint, the version is recorded as stopped, and the flow run reports its final
    state (Crashed) itself, which frees its deployment's concurrency slot at once.

    Returns:
        The pids that were signalled.
    """
    pids = [pid for pid in _children(os.getpid()) if _is_flow_run_process(pid) and process_alive(pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    if pids:
        log.warning("stopping %d flow run(s): the ranks write a stop checkpoint first", len(pids))
    deadline = time.monotonic() + timeout_s
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


class StoppingRunner(Runner):
    """Prefect's runner, except that SIGTERM (and Ctrl-C) stop its flow runs cleanly, pause its deployments' schedules
    and drop the runs they queued before it exits.

    Prefect's runner ends on SIGTERM by tearing down its flow-run processes: their ranks die without a checkpoint and
    the flow runs stay ``Running`` on the server, holding the deployment's concurrency slot. Its own handler calls
    the coroutine of ``stop`` without awaiting it and exits at once, so the schedules it should pause stay active.
    """

    stop_signal: int | None = None
    paused = False
    #: True while ``serve_config`` registers the deployments: a stop signal then only records itself.
    registering = False
    _stopping_task: asyncio.Task | None = None

    def handle_sigterm(self, signum: int = signal.SIGTERM, *args: Any) -> None:
        if self.stop_signal is not None:
            if self.registering:  # a repeat while a deployment registers (a server not answering): give up now
                raise KeyboardInterrupt
            return  # a repeated signal must not cut the flow runs' stop short
        self.stop_signal = int(signum)
        if self.registering:
            return
        try:
            loop = asyncio.get_running_loop()  # the handler runs in the main thread, between the loop's steps
        except RuntimeError:  # the runner has not started yet: nothing to stop
            raise KeyboardInterrupt from None
        self._stopping_task = loop.create_task(self._stop())

    async def _stop(self) -> None:
        while not self.started:  # the signal came while the runner starts: stop it once it is up
            await asyncio.sleep(0.1)
        # No new flow run from here on: the slot a stopped run frees would otherwise go to a queued scheduled run,
        # whose process starts while the pause below deletes it on the server (its task runs then refer to a flow
        # run that no longer exists).
        self._stop_polling()
        await asyncio.to_thread(stop_flow_runs)
        # The runner's shutdown cancels its event loop's pending callbacks; asyncio would log each as an error.
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        ids = self._deployment_registry.get_deployment_ids()
        try:
            await self._pause_schedules()
            self.paused = True
            dropped = await drop_scheduled_runs(self._client, ids)  # the ones waiting for the concurrency slot
            if dropped:  # shown in serve's terminal: runs the schedule owed are gone
                log.warning("dropped %d queued scheduled run(s): %s", len(dropped), ", ".join(dropped))
            # Next runs the server's scheduler inserts after the pause (it read the deployments as active before):
            # the schedule makes them again when serving resumes it, so they are dropped without a warning.
            late = await drop_late_inserts(self._client, ids)
            if late:
                log.info("dropped %d scheduled run(s) the server's scheduler added after the pause", len(late))
        except Exception as err:  # noqa: BLE001 - the server may be gone; the runner must still stop
            log.warning("could not pause the schedules of %d deployment(s): %s", len(ids), err)
        # A submission already under way when polling stopped may have started its process since: stop it too.
        await asyncio.to_thread(stop_flow_runs)
        self.pause_on_shutdown = False  # done above
        await self.astop()

    def _stop_polling(self) -> None:
        """Submit no further flow run (Prefect's runner sets the same flags only in ``astop``)."""
        self.stopping = True
        poller = getattr(self, "_scheduled_run_poller", None)
        if poller is not None:
            poller.stopping = True
