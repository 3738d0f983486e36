"""A run folder on object storage, seen from the launching process: which stage needs what from the store, and what
goes back after it (:class:`ortflow.checkpoints.object_store.RunStore` moves the files).

The flow works in the local copy (``output_dir`` of a config whose ``storage.remote_dir`` is set). It brings the copy up
to the store when it takes the run folder's lock, downloads the checkpoints a stage reads before it runs (the newest
for training to resume from, all of them for retention and export), and uploads what each stage wrote once it ends.
The ranks upload their checkpoints themselves as each one completes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ortflow.checkpoints.object_store import RunStore
from ortflow.config import RunConfig

log = logging.getLogger("ortflow.storage")

#: Checkpoints a stage reads, so they are downloaded before it runs.
STAGE_CHECKPOINTS = {"train": "newest", "retain_checkpoints": "all", "export": "all"}


def is_remote_run(cfg: RunConfig) -> bool:
    return cfg.storage.remote_dir is not None


def pull(cfg: RunConfig, checkpoints: str = "none") -> None:
    """Bring the local copy of a remote run folder up to the store (no-op for a local run folder)."""
    if is_remote_run(cfg):
        RunStore(cfg).pull(checkpoints)


def push(cfg: RunConfig) -> None:
    """Upload what changed in the local copy (no-op for a local run folder)."""
    if is_remote_run(cfg):
        RunStore(cfg).push()


def remove_versions(cfg: RunConfig, names: list[str]) -> None:
    """Delete pruned versions' folders on the store."""
    if is_remote_run(cfg):
        store = RunStore(cfg)
        for name in names:
            store.remove_tree(f"versions/{name}")


def around_stage(stage: str, cfg: RunConfig, call: Any) -> Any:
    """``call`` (a stage task) wrapped so that the store is read before it and written after it."""
    if not is_remote_run(cfg):
        return call

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        store = RunStore(cfg)
        store.pull(STAGE_CHECKPOINTS.get(stage, "none"))
        result = call(*args, **kwargs)
        store.push()
        if stage == "retain_checkpoints":
            deleted = store.push_deletions()  # the stage ran on a copy holding every checkpoint
            if deleted:
                log.info("retention: deleted checkpoint steps %s on %s", deleted, cfg.storage.remote_dir)
        return result

    return run
