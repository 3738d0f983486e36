"""Which split (pipeline stages, tensor-parallel size) and optimizer state a checkpoint was written with, checked
before any rank loads it (and before a command records a config whose ranks would refuse it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ortflow.checkpoints.folder import CheckpointError, CheckpointInfo, list_complete, verify

if TYPE_CHECKING:
    from ortflow.config import RunConfig


def check_checkpoint_layout(meta: dict, path: Path, num_stages: int, tp_size: int, named: bool) -> None:
    """Refuse a checkpoint written with another ``pipeline_parallel_size``, or with another
    ``horizontal_parallel_size`` when this run is tensor parallel (its state files are split differently; an unsplit
    run resumes a tensor-parallel checkpoint with its slices merged).

    Args:
        meta: The checkpoint's ``meta.json``.
        path: Its folder.
        num_stages: This run's pipeline stages.
        tp_size: This run's tensor-parallel size.
        named: The checkpoint was named by ``checkpoint.checkpoint_to_load_path`` (not the newest of the run's own).

    Raises:
        CheckpointError: naming both sizes and the ways out (the rank stops with that line, not a traceback).
    """
    written_pp, written_tp = int(meta.get("pipeline_parallel_size", 1)), int(meta.get("horizontal_parallel_size", 1))
    if written_pp != num_stages:
        field, written, this = "pipeline_parallel_size", written_pp, num_stages
    elif tp_size > 1 and written_tp != tp_size:
        field, written, this = "horizontal_parallel_size", written_tp, tp_size
    else:
        return
    # A folder that holds checkpoints resumes its newest one and never reads init_from: the warm start needs a run
    # whose checkpoint folder is empty, or the config that named this checkpoint with init_from in its place.
    where = ("in place of checkpoint.checkpoint_to_load_path" if named else
             "in a new run (another output_dir, or a checkpoint.dir without checkpoints: a run that holds "
             "checkpoints resumes its newest and ignores checkpoint.init_from)")
    raise CheckpointError(
        f"checkpoint {path} was written with distributed.{field} {written} but this run has {this}: resume with "
        f"{written}, or start from its weights (merged and split for this layout; the optimizer state starts fresh "
        f"at step 0) with checkpoint.init_from: {path} {where}"
    )


def _optimizer_refusal(info: CheckpointInfo, cfg: RunConfig) -> str | None:
    """The ranks' refusal of a checkpoint whose optimizer state this config's optimizer cannot continue."""
    from ortflow.checkpoints.h5state import saved_state, state_refusal

    saved = saved_state(info.path)
    if saved is None:
        return None
    written_by, names = saved
    return state_refusal(info.path, names, written_by, cfg.optimizer.label, cfg.optimizer.state_names)


def resume_layout_refusal(cfg: RunConfig) -> str | None:
    """Before any rank starts, and before a command records a config in the run folder: the refusal the ranks would
    meet for the checkpoint they would resume (another split, or an optimizer state this config's optimizer cannot
    continue), else None. ``ortflow configure``, the train stage and ``ortflow train --accept-changed-config`` check
    it before they record or build anything, so that a refused layout or optimizer is not left in the run folder for a
    later command to read; ``ortflow validate`` and ``ortflow train`` report it.

    Reads the newest complete checkpoint's ``meta.json`` (or ``checkpoint_to_load_path``'s) and its first optimizer
    file's attributes; only one that conflicts has its files hashed, and a damaged one is passed over, as the ranks
    pass over it. A run folder on object storage is left to the ranks (the local folder may not hold what the store
    holds).
    """
    named = cfg.checkpoint.checkpoint_to_load_path is not None
    dist = cfg.distributed

    def refusal(info: CheckpointInfo) -> str | None:
        check_checkpoint_layout(info.meta, info.path, dist.pipeline_parallel_size, dist.horizontal_parallel_size,
                                named=named)
        return _optimizer_refusal(info, cfg)

    return _first_refusal(cfg, refusal)


def _first_refusal(cfg: RunConfig, check: Callable[[CheckpointInfo], str | None]) -> str | None:
    """``check``'s refusal of the checkpoint the ranks would resume (a damaged one is passed over, as they do)."""
    if cfg.storage.remote_dir is not None:
        return None
    named = cfg.checkpoint.checkpoint_to_load_path
    found = list_complete(Path(named).parent if named is not None else Path(cfg.checkpoints_dir))
    if named is not None:
        found = [c for c in found if c.path.name == Path(named).name]
    for info in reversed(found):
        try:
            refusal = check(info)
        except CheckpointError as err:
            refusal = str(err)
        except OSError:  # an optimizer file that does not open: the ranks say what is wrong with it
            return None
        if refusal is None:
            return None
        try:
            verify(info.path)
        except CheckpointError:
            continue  # damaged: the ranks pass over it (or, named, stop on it with their own message)
        return refusal
    return None
