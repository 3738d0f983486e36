"""The checkpoint format: the folder protocol (:mod:`.folder`), writing and the trainer's retention
(:mod:`.manager`), the HDF5 files (:mod:`.h5state`), tensor-parallel slices (:mod:`.tp`), format 1 engine files
(:mod:`.legacy`), the parallel layout a checkpoint was written with (:mod:`.layout_check`), the retention stage after
training (:mod:`.retention`) and the ``ortflow checkpoint`` tools (:mod:`.tools`). Used by the trainer, export and
the version records; it imports nothing from ortflow but the config and, for run folders on object storage
(:mod:`.object_store`: the protocol on the store, :mod:`.run_store`: a run folder's local copy), the storage
package.

See docs/reliability.md for the layout.
"""

from ortflow.checkpoints.folder import (
    CHECKPOINT_FILE,
    FORMAT,
    META_FILE,
    META_SHA_KEY,
    PARAMS_FILE,
    CheckpointError,
    CheckpointInfo,
    check_owner,
    final_checkpoint,
    latest_verified,
    list_complete,
    meta_digest,
    resolve_resume,
    step_dirname,
    verify,
)
from ortflow.checkpoints.manager import (
    CheckpointManager,
    StateWriter,
    delete_checkpoint,
    retention_to_delete,
)
from ortflow.checkpoints.owner import completed_run, run_owner

__all__ = [
    "CHECKPOINT_FILE", "FORMAT", "META_FILE", "META_SHA_KEY", "PARAMS_FILE", "CheckpointError", "CheckpointInfo",
    "CheckpointManager", "StateWriter", "check_owner", "final_checkpoint",
    "completed_run", "run_owner", "delete_checkpoint", "latest_verified", "list_complete", "meta_digest",
    "resolve_resume", "retention_to_delete", "step_dirname", "verify",
]
