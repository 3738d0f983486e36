"""The pipeline's run-level tasks: resolve the flow's parameters into a config, pick the folder (a new model version,
a retried one, or the run folder itself), record the version's end; and the per-stage options from the config."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ortflow import runlock, versions
from ortflow.checkpoints import run_store
from ortflow.config import RunConfig, apply_overrides, config_from_dict, load_config
from ortflow.processes import despite_repeated_stops
from ortflow.tasks.policy import artifact_key, forward_logs, retry_transient


def flow_run_id() -> str | None:
    """The current Prefect flow run's id (None outside a flow run)."""
    from prefect.runtime import flow_run

    value = flow_run.get_id()
    return str(value) if value else None


@task(name="resolve_config", cache_policy=NO_CACHE)
def resolve_config(
    config: RunConfig | str,
    overrides: list[str] | None = None,
    policy: str | None = None,
    skip_unchanged: bool | None = None,
    wait_for_lock: bool | None = None,
) -> RunConfig:
    """The run's config: ``config`` (a RunConfig, or a YAML path relative to the flow run's folder) with the flow
    run's ``overrides`` (``--set`` syntax) and run-policy parameters applied, validated like ``ortflow validate``."""
    cfg = load_config(config) if isinstance(config, str | Path) else config
    cfg = apply_overrides(cfg, list(overrides or ()))
    updates: dict[str, dict[str, Any]] = {}
    if policy is not None:
        updates.setdefault("versions", {})["policy"] = policy
    if skip_unchanged is not None:
        updates.setdefault("versions", {})["skip_unchanged"] = skip_unchanged
    if wait_for_lock is not None:
        updates.setdefault("pipeline", {})["wait_for_lock"] = wait_for_lock
    if updates:
        raw = cfg.model_dump(mode="json")
        for section, values in updates.items():
            raw[section].update(values)
        cfg = config_from_dict(raw, source="flow run parameters")
    return cfg


@contextlib.contextmanager
def run_folder_lock(cfg: RunConfig, purpose: str) -> Iterator[Path]:
    """Hold ``cfg.output_dir``'s lock (see :mod:`ortflow.runlock`) for this flow run, waiting if the config says so."""
    pipe = cfg.pipeline
    with runlock.hold(cfg.output_dir, wait=pipe.wait_for_lock, timeout_s=pipe.lock_timeout_s,
                      flow_run_id=flow_run_id(), purpose=purpose) as path:
        run_store.pull(cfg)  # a run folder on object storage: the local copy starts from the store
        yield path


@task(name="plan_version", cache_policy=NO_CACHE)
def plan_version(
    config: RunConfig, new_version: bool, from_stage: str | None = None, version: str | None = None,
    overrides: list[str] | None = None,
) -> versions.Plan:
    """Pick the folder this run trains in (a new version, this flow run's own version on a retry, or the run
    folder); ``from_stage`` makes that stage and every later one run again, in a versioned run inside an existing
    version (``version``, else the newest) instead of a new one. A retry or rerun of a version uses the config it
    recorded and is refused when it would change its config (``overrides``), model or data."""
    from ortflow.tasks.caching import invalidate

    with forward_logs() as logger:
        if new_version and from_stage is not None:
            plan = versions.plan_rerun(config, flow_run_id(), version, tuple(overrides or ()))
        else:
            plan = versions.plan_run(config, flow_run_id(), new_version)
        if plan.skipped_because:
            logger.info("skipped: %s", plan.skipped_because)
        elif plan.version:
            how = f"warm start from {plan.parent}" if plan.parent else "from the configured weights"
            logger.info("version %s in %s (%s)%s", plan.version, plan.config.output_dir, how,
                        ", resumed" if plan.resumed else "")
        if plan.version is not None:
            run_store.push(config)  # the registry, on the store before the version trains
            run_store.pull(plan.config)  # a retried or rerun version's own folder
        if from_stage is not None and not plan.skipped_because:
            logger.info("rerunning %s", ", ".join(invalidate(plan.config, from_stage)))
    return plan


@task(name="finish_version", cache_policy=NO_CACHE)
def finish_version(config: RunConfig, plan: versions.Plan, status: str, summary: dict | None = None) -> dict | None:
    """Record the version's end in the registry (``latest`` follows completed versions); no-op when unversioned."""
    if plan.version is None:
        return None
    entry = versions.finish_version(config.output_dir, plan.version, status, summary)
    run_store.push(config)
    return entry


def record_version_end(config: RunConfig, plan: versions.Plan, status: str) -> None:
    """Record a version that failed or stopped, even while a stop signal repeats: during a flow run Prefect raises
    each SIGTERM where the flow is (a process manager repeating its signal, a second Ctrl-C sent as SIGTERM), which
    would leave the version recorded as running. (Writing the record again is harmless.)"""
    despite_repeated_stops(lambda: finish_version(config, plan, status))


@task(name="prune_versions", cache_policy=NO_CACHE)
def prune_versions(config: RunConfig) -> dict | None:
    """Apply ``versions.keep`` after a version completed: delete the folders of versions beyond it."""
    keep = config.versions.keep
    if keep is None:
        return None
    with forward_logs() as logger:
        result = versions.prune_versions(config.output_dir, keep, config.versions.pinned)
        run_store.remove_versions(config, list(result.deleted))
        run_store.push(config)
        if result.deleted:
            logger.info("versions.keep %d: pruned %s (%.1f MB freed); %d version folder(s) use %.1f MB", keep,
                        ", ".join(result.deleted), result.freed_bytes / 1e6, len(result.kept),
                        result.remaining_bytes / 1e6)
    return {"deleted": list(result.deleted), "freed_bytes": result.freed_bytes,
            "remaining_bytes": result.remaining_bytes}


@task(name="publish_skipped", cache_policy=NO_CACHE)
def publish_skipped(config: RunConfig, plan: versions.Plan) -> dict:
    """Say, as the run's summary artifact, that nothing was trained and why."""
    create_markdown_artifact(
        f"# ortflow run `{config.name}`: skipped\n\n{plan.skipped_because}; nothing was trained. The newest version "
        f"stays `{plan.parent}` (`{config.output_dir / versions.LATEST}`).",
        key=artifact_key(config, "summary"), description=f"Result of {config.name}",
    )
    return {"skipped": plan.skipped_because, "version": plan.parent}


def _delays(values: tuple[float, ...], retries: int) -> list[float]:
    return [values[min(i, len(values) - 1)] for i in range(retries)] if values and retries else [0.0] * retries


def stage_options(cfg: RunConfig, stage: str) -> dict[str, Any]:
    """``with_options`` keywords of a stage from ``cfg.pipeline``: retries, their delays and the time limit."""
    pipe = cfg.pipeline
    if stage == "train":
        retries, delays, timeout = pipe.train_retries, pipe.train_retry_delays_s, pipe.train_timeout_s
    else:
        retries, delays, timeout = pipe.retries, pipe.retry_delays_s, pipe.stage_timeout_s
    return {"retries": retries, "retry_delay_seconds": _delays(delays, retries), "timeout_seconds": timeout,
            "retry_condition_fn": retry_transient}


#: Where a stage's start is logged (``extra["ortflow_stage"]``: the task's name); ``ortflow run`` shows it as a line.
STAGE_LOG = logging.getLogger("ortflow.stages")


def staged(stage_task: Any, cfg: RunConfig) -> Any:
    """The task with its retries and timeout from the config (today's defaults: 2 retries, no time limit); with a run
    folder on object storage, it reads what it needs from the store first and uploads what it wrote after. Calling it
    logs the stage's start to :data:`STAGE_LOG` first (a cached stage too: Prefect then returns its result)."""
    configured = run_store.around_stage(stage_task.name, cfg,
                                        stage_task.with_options(**stage_options(cfg, stage_task.name)))

    def start(*args: Any, **kwargs: Any) -> Any:
        STAGE_LOG.info("stage %s starts", stage_task.name, extra={"ortflow_stage": stage_task.name})
        return configured(*args, **kwargs)

    return start
