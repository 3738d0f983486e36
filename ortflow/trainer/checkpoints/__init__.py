"""Checkpoints: the folder protocol (:mod:`.folder`), writing and retention (:mod:`.manager`), the HDF5 files
(:mod:`.h5state`), format 1 engine files (:mod:`.legacy`) and the ``ortflow checkpoint`` tools (:mod:`.tools`).

See docs/checkpoints.md for the layout.
"""

from ortflow.trainer.checkpoints.folder import (
    CHECKPOINT_FILE,
    FORMAT,
    META_FILE,
    META_SHA_KEY,
    PARAMS_FILE,
    CheckpointError,
    CheckpointInfo,
    latest_verified,
    list_complete,
    meta_digest,
    resolve_resume,
    step_dirname,
    verify,
)
from ortflow.trainer.checkpoints.manager import (
    CheckpointManager,
    StateWriter,
    delete_checkpoint,
    retention_to_delete,
)
from ortflow.trainer.checkpoints.owner import check_owner, run_owner

__all__ = [
    "CHECKPOINT_FILE", "FORMAT", "META_FILE", "META_SHA_KEY", "PARAMS_FILE", "CheckpointError", "CheckpointInfo",
    "CheckpointManager", "StateWriter", "check_owner",
    "run_owner", "delete_checkpoint", "latest_verified", "list_complete", "meta_digest",
    "resolve_resume", "retention_to_delete", "step_dirname", "verify",
]
