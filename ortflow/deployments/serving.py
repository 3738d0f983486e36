"""Serve ``train-pipeline/<name>`` and ``export-only/<name>`` for one run config, on the config's schedule.

Deployments point at the flows by module path (``ortflow.flows.pipeline:train_pipeline``). Prefect imports a module
entrypoint with the working folder first on ``sys.path``, so ``serve_config`` moves to a folder of its own before
serving: the runner's flow-run processes then import the installed ortflow, whatever the folder ``ortflow serve``
was started from holds (a checkout, a folder named ``ortflow``).
"""

from __future__ import annotations

import os

from prefect import serve
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.schedules import Cron, Interval, Schedule

from ortflow.config import RunConfig
from ortflow.flows import export_only, train_pipeline


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


def serve_config(cfg: RunConfig, limit: int | None = None) -> None:
    """Register both deployments and run their flow runs from this process until interrupted.

    Args:
        cfg: The run config.
        limit: Most flow runs at once (default: Prefect's, unlimited).
    """
    deployments = build_deployments(cfg)
    workdir = cfg.output_dir / ".ortflow" / "serve"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # flow runs start here (config paths are absolute): nothing here shadows the installed ortflow
    os.environ["PYTHONSAFEPATH"] = "1"  # and no script folder goes first on their sys.path either
    serve(*deployments, limit=limit)
