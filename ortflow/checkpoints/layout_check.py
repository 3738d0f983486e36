"""Which pipeline layout a checkpoint was written with, checked before any rank loads it."""

from __future__ import annotations

from pathlib import Path

from ortflow.checkpoints.folder import CheckpointError


def check_checkpoint_layout(meta: dict, path: Path, num_stages: int) -> None:
    """Refuse a checkpoint written with another ``pipeline_parallel_size`` (its state files are split differently).

    Raises:
        CheckpointError: naming both sizes and what to do (the rank stops with that line, not a traceback).
    """
    written = int(meta.get("pipeline_parallel_size", 1))
    if written != num_stages:
        raise CheckpointError(
            f"checkpoint {path} was written with distributed.pipeline_parallel_size {written} but this run has "
            f"{num_stages}: resume with {written}, or export it (`ortflow export`, which stitches the stages) and "
            "start a new run from the exported model"
        )
