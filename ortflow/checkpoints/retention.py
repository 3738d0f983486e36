"""The retention stage: after training, keep the newest, the best and the final checkpoints, verify them, index them.

It shares the trainer's pure policy (:func:`ortflow.checkpoints.retention_to_delete`): the trainer keeps the
``max_num_checkpoints`` newest, this stage keeps the same newest plus the best (lowest eval loss) and the final
(highest step) checkpoints, which it passes as ``protect``. The checkpoint export reads by default
(:func:`export_choice`: the best, else the newest) is always among the protected ones.

Note that the trainer's own retention runs during training with newest-only, so "best" here is the best of the
checkpoints the trainer kept; raise ``checkpoint.max_num_checkpoints`` to keep more candidates.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ortflow.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    delete_checkpoint,
    list_complete,
    retention_to_delete,
    verify,
)
from ortflow.config import RunConfig

log = logging.getLogger(__name__)

INDEX_NAME = "checkpoints.json"
"""The index the retention stage writes into the run folder."""


def best_by_eval_loss(checkpoints: Sequence[CheckpointInfo]) -> CheckpointInfo | None:
    """The checkpoint with the lowest recorded eval loss (the later one on ties), or None if none has one."""
    scored = [c for c in checkpoints if c.eval_loss is not None]
    return min(scored, key=lambda c: (c.eval_loss, -c.step)) if scored else None


def export_choice(checkpoints: Sequence[CheckpointInfo]) -> CheckpointInfo | None:
    """The checkpoint export reads by default: the best by eval loss, else the newest, else None."""
    return best_by_eval_loss(checkpoints) or (max(checkpoints, key=lambda c: c.step) if checkpoints else None)


def reason_label(reason: str, keep_newest: int | None) -> str:
    """A retention reason as people read it: "newest" marks every checkpoint among the ``keep_newest`` newest, so it
    reads "one of the N newest" (a run keeping 3 printed "(newest)" after all three)."""
    if reason == "newest":
        return f"one of the {keep_newest} newest" if keep_newest else "among the newest"
    return {"best_eval_loss": "best eval loss", "export_source": "export source"}.get(reason, reason)


def plan_retention(checkpoints: Sequence[CheckpointInfo], keep_newest: int) -> tuple[dict[int, list[str]], list[int]]:
    """The retention stage's policy: which steps to keep (with the reasons) and which to delete.

    Args:
        checkpoints: Complete, verified checkpoints.
        keep_newest: How many of the newest to keep.

    Returns:
        ``(kept, deleted)``: step -> reasons ("newest", "best_eval_loss", "final", "export_source"), and the deleted
        steps, ascending.
    """
    steps = [c.step for c in checkpoints]
    best = best_by_eval_loss(checkpoints)
    final = max(steps) if steps else None
    source = export_choice(checkpoints)
    protect = {s for s in (best.step if best else None, final, source.step if source else None) if s is not None}
    deleted = retention_to_delete(steps, keep_newest, protect)
    newest = set(steps) - set(retention_to_delete(steps, keep_newest))
    kept: dict[int, list[str]] = {}
    for step in sorted(set(steps) - set(deleted)):
        reasons = [
            reason
            for reason, applies in (
                ("newest", step in newest),
                ("best_eval_loss", best is not None and step == best.step),
                ("final", step == final),
                ("export_source", source is not None and step == source.step),
            )
            if applies
        ]
        kept[step] = reasons
    return kept, deleted


@dataclass(frozen=True)
class CheckpointIndex:
    """What the retention stage kept, deleted and found damaged (the contents of ``checkpoints.json``)."""

    path: Path
    checkpoints_dir: Path
    keep_newest: int
    kept: list[dict] = field(default_factory=list)
    deleted: list[dict] = field(default_factory=list)
    damaged: list[dict] = field(default_factory=list)
    best_step: int | None = None
    final_step: int | None = None
    export_step: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready form, as written to ``checkpoints.json``."""
        return {
            "format": 1,
            "checkpoints_dir": str(self.checkpoints_dir),
            "keep_newest": self.keep_newest,
            "best_step": self.best_step,
            "final_step": self.final_step,
            "export_step": self.export_step,
            "kept": self.kept,
            "deleted": self.deleted,
            "damaged": self.damaged,
        }


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def retain_checkpoints(cfg: RunConfig, clock=time.time) -> CheckpointIndex:
    """Keep the newest ``checkpoint.max_num_checkpoints``, the best by eval loss and the final checkpoint.

    Every complete checkpoint is verified first (sizes and sha256). Damaged ones take no part in the choice, are not
    deleted (a person should look at them) and are listed in the index. Deletion happens only after the index's
    choices are made, and never touches the checkpoint export reads by default.

    Args:
        cfg: The run config (reads ``checkpoint`` and the run folder's paths).
        clock: Seconds since the epoch, for ``created`` in the index.

    Returns:
        The index, also written atomically to ``<output_dir>/checkpoints.json``.
    """
    directory = cfg.checkpoints_dir
    keep_newest = cfg.checkpoint.max_num_checkpoints
    good: list[CheckpointInfo] = []
    damaged: list[dict] = []
    for info in list_complete(directory):
        try:
            good.append(verify(info.path))
        except CheckpointError as err:
            log.warning("retention: %s is damaged and left in place: %s", info.path.name, err)
            damaged.append({"step": info.step, "path": str(info.path), "error": str(err)})

    kept_reasons, doomed = plan_retention(good, keep_newest)
    by_step = {c.step: c for c in good}
    deleted = []
    for step in doomed:
        delete_checkpoint(by_step[step].path)
        deleted.append({"step": step, "path": str(by_step[step].path)})
        log.info("retention: deleted %s", by_step[step].path.name)
    kept = [
        {
            "step": step,
            "path": str(by_step[step].path),
            "reasons": reasons,
            "eval_loss": by_step[step].eval_loss,
            "train_loss": by_step[step].train_loss,
            "sha256": {name: rec["sha256"] for name, rec in by_step[step].meta["files"].items()},
            "verified": True,
        }
        for step, reasons in kept_reasons.items()
    ]
    best = best_by_eval_loss(good)
    source = export_choice(good)
    index = CheckpointIndex(
        path=cfg.output_dir / INDEX_NAME,
        checkpoints_dir=directory,
        keep_newest=keep_newest,
        kept=kept,
        deleted=deleted,
        damaged=damaged,
        best_step=best.step if best else None,
        final_step=max(by_step) if by_step else None,
        export_step=source.step if source else None,
    )
    created = datetime.fromtimestamp(clock(), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _write_json_atomic(index.path, {**index.to_dict(), "created": created})
    log.info("retention: kept %s, deleted %s, damaged %s", sorted(by_step.keys() - set(doomed)), doomed,
             [d["step"] for d in damaged])
    return index
