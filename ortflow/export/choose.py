"""Which checkpoint of a run ``export`` and ``evaluate`` read: ``--checkpoint best|latest|initial|step-N``.

``initial`` is the configured weights: the engine's initial checkpoint in ``<run>/artifacts/checkpoint``, written by
configure before any training; it is step 0 and has no recorded losses.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ortflow.checkpoints import CheckpointError, CheckpointInfo, list_complete, step_dirname, verify
from ortflow.checkpoints.retention import best_by_eval_loss, export_choice
from ortflow.config import RunConfig
from ortflow.export.verify import ExportError

log = logging.getLogger(__name__)

#: Names ``--checkpoint`` accepts besides ``step-N`` and ``N``.
CHOICES = ("best", "latest", "initial")
INITIAL = "initial"


def initial_checkpoint(artifacts_dir: Path) -> CheckpointInfo:
    """The configured weights as a checkpoint (its ``checkpoint_path`` is ``<artifacts>/checkpoint``).

    Raises:
        ExportError: the run is not configured.
    """
    if not (Path(artifacts_dir) / "checkpoint").is_file():
        raise ExportError(f"{artifacts_dir}/checkpoint does not exist: configure the run first (`ortflow configure`)")
    return CheckpointInfo(Path(artifacts_dir), 0, {"step": 0, "eval_loss": None, "train_loss": None,
                                                   "checkpoint": INITIAL})  # fmt: skip


def pick_checkpoint(run_dir: Path, config: RunConfig | None, which: str | None) -> CheckpointInfo:
    """The checkpoint ``which`` names in a run folder (default: the best by eval loss, else the newest).

    Args:
        run_dir: The run folder.
        config: Its config, when found (for the checkpoint and artifacts folders).
        which: None, ``best``, ``latest``, ``initial``, ``step-N`` or ``N``.

    Raises:
        ExportError: no such checkpoint, or none at all.
        CheckpointError: the checkpoint named is damaged.
    """
    artifacts = config.artifacts_dir if config else run_dir / "artifacts"
    if which == INITIAL:
        return initial_checkpoint(artifacts)
    directory = config.checkpoints_dir if config else run_dir / "checkpoints"
    if which not in (None, "best", "latest"):
        match = re.fullmatch(r"(?:step-)?(\d+)", which)
        if match is None:
            raise ExportError(f"--checkpoint {which}: use one of {', '.join(CHOICES)}, step-N or N")
        name = step_dirname(int(match.group(1)))
        if not (directory / name).is_dir():
            have = [c.path.name for c in list_complete(directory)] + [INITIAL]
            raise ExportError(f"--checkpoint {which}: no {directory / name}; this run has {have}")
        return verify(directory / name)  # named explicitly: a damaged one is refused, never swapped for another
    good = []
    for info in list_complete(directory):
        try:
            good.append(verify(info.path))
        except CheckpointError as err:
            log.warning("skipping damaged checkpoint %s: %s", info.path.name, err)
    chosen = best_by_eval_loss(good) if which == "best" else max(good, key=lambda c: c.step, default=None)
    chosen = export_choice(good) if which is None else chosen
    if chosen is None:
        raise ExportError(
            f"no complete, undamaged checkpoint{' with an eval loss' if which == 'best' else ''} in {directory}: "
            "train first (`ortflow train`), name a checkpoint folder (one holding meta.json), or use "
            "--checkpoint initial for the configured weights"
        )
    return chosen
