"""A rank whose run folder is on object storage: its own local copy, and the store as its checkpoints' home.

``python -m ortflow.trainer s3://bucket/run`` starts a rank that shares no filesystem with the others or with the
launching process: before MPI starts it downloads the resolved config, the artifacts and the data shards into its own
local copy (``$ORTFLOW_CACHE_DIR/ranks/rank-N/...``) and the newest complete checkpoint to resume from; then it trains
like any rank. A rank started on a local run folder whose config names a remote one (``ortflow train`` on the
launching host) uses the launching process's copy. Either way the writer rank uploads every checkpoint as it completes
(:class:`ortflow.checkpoints.object_store.RemoteCheckpoints`), so the store holds the truth.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import yaml

from ortflow.checkpoints.object_store import RemoteCheckpoints
from ortflow.checkpoints.run_store import OPTIONS_ENV, RunStore
from ortflow.config import RESOLVED_CONFIG_NAME, RunConfig
from ortflow.config.storage import cache_folder, default_cache_root
from ortflow.storage import RemoteDir

log = logging.getLogger("ortflow.trainer")

#: Where each launcher puts the process's rank before MPI starts.
RANK_ENVS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def env_rank(environ: dict | None = None) -> int:
    """This process's rank as its launcher announced it (0 outside a launcher)."""
    environ = os.environ if environ is None else environ
    return next((int(environ[key]) for key in RANK_ENVS if environ.get(key, "").isdigit()), 0)


def materialize(url: str, rank: int | None = None) -> Path:
    """Download what a rank needs from the remote run folder ``url`` into this rank's local copy; returns it.

    Raises:
        ConfigError: the folder holds no resolved config (configure has not run).
        StorageError: the store cannot be reached after retries.
    """
    from ortflow.config import ConfigError, config_from_dict, write_resolved_config

    rank = env_rank() if rank is None else rank
    local = cache_folder(url, default_cache_root() / "ranks" / f"rank-{rank:05d}")
    remote = RemoteDir(url, json.loads(os.environ.get(OPTIONS_ENV) or "{}"))
    try:
        raw = yaml.safe_load(remote.read_bytes(RESOLVED_CONFIG_NAME))
    except FileNotFoundError:
        raise ConfigError([f"{url}/{RESOLVED_CONFIG_NAME} does not exist: configure the run first (`ortflow "
                           "configure CONFIG` with output_dir set to the URL)"]) from None
    raw["output_dir"] = str(local)  # this rank's own copy; storage.remote_dir still names the store
    raw["storage"] = {**raw.get("storage", {}), "remote_dir": remote.url}
    cfg = config_from_dict(raw, base_dir=local, source=f"{url}/{RESOLVED_CONFIG_NAME}")  # its paths: in the copy
    store = RunStore(cfg)
    store.pull("newest")
    write_resolved_config(cfg, local)  # with its record, which the rank verifies the config against
    log.info("rank %d: local copy of %s in %s", rank, url, local)
    return local


def checkpoint_mirror(cfg: RunConfig, token: int) -> RemoteCheckpoints | None:
    """The store's checkpoint directory of a remote run folder (None for a local one)."""
    if cfg.storage.remote_dir is None:
        return None
    return RemoteCheckpoints(RemoteDir.from_config(cfg.storage).child("checkpoints"), cfg.checkpoints_dir, token)
