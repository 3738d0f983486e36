"""Prefect tasks: thin wrappers that call one plain function each (configure, prepare_data, train, retention,
export) with retries, persisted results and on-disk-aware cache keys (:mod:`ortflow.tasks.caching`)."""

from ortflow.tasks.caching import STAGES, StageCache, invalidate, stage_key
from ortflow.tasks.events import announce_state
from ortflow.tasks.liveness import crash_vanished_runs, quiet_console, record_process
from ortflow.tasks.runs import (
    finish_version,
    plan_version,
    prune_versions,
    publish_skipped,
    record_version_end,
    resolve_config,
    run_folder_lock,
    stage_options,
    staged,
)
from ortflow.tasks.stages import (
    check_launcher,
    configure,
    export,
    export_checkpoint,
    prepare_data,
    publish_summary,
    retain_checkpoints,
)
from ortflow.tasks.training import TrainingFailed, train

__all__ = [
    "STAGES",
    "announce_state",
    "StageCache",
    "TrainingFailed",
    "check_launcher",
    "configure",
    "crash_vanished_runs",
    "export",
    "export_checkpoint",
    "finish_version",
    "plan_version",
    "publish_skipped",
    "record_version_end",
    "quiet_console",
    "resolve_config",
    "run_folder_lock",
    "stage_options",
    "staged",
    "invalidate",
    "prepare_data",
    "prune_versions",
    "publish_summary",
    "record_process",
    "retain_checkpoints",
    "stage_key",
    "train",
]
