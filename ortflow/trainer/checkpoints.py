"""Checkpoints: complete-or-absent folders, their verification, retention and the resume choice.

A checkpoint is a folder ``step-%08d`` under the checkpoint directory holding the engine's ``CheckpointState``
file (``checkpoint``, with optimizer state) and ``meta.json``, which is written last (docs/design.md,
docs/checkpoints.md).
Folders without ``meta.json`` are incomplete and every reader here ignores them.

The writer (rank 0) builds the folder under a hidden temporary name, fsyncs every file, writes ``meta.json`` with the
size and sha256 of each file, renames the folder into place and fsyncs the parent; only then does retention delete
old checkpoints (levanter ``checkpoint.py``; torchtitan ``components/checkpoint.py``). The loop only calls
:meth:`CheckpointManager.maybe_save`: the manager decides when to save and what to delete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ortflow import __version__

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint"
META_FILE = "meta.json"
FORMAT = 1
"""Version of the folder layout and meta.json fields; bump when either changes incompatibly."""

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_REQUIRED_META = ("format", "step", "files")

StateWriter = Callable[[Any, Path], None]
"""Writes a training state into a file path (default: the engine's ``save_checkpoint`` with optimizer state)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written; the message names the file, the problem and what to do."""


def step_dirname(step: int) -> str:
    """Folder name of the checkpoint at weight update ``step``: zero-padded so names sort by step."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint folder and its parsed ``meta.json``."""

    path: Path
    step: int
    meta: dict = field(repr=False, compare=False)

    @property
    def checkpoint_path(self) -> Path:
        """The engine's state file, for ``api.CheckpointState.load_checkpoint``."""
        return self.path / CHECKPOINT_FILE

    @property
    def global_cursor(self) -> int | None:
        """Samples consumed by all ranks together when this checkpoint was written (the loader's cursor)."""
        return self.meta.get("global_cursor")

    @property
    def eval_loss(self) -> float | None:
        """Eval loss recorded with the checkpoint, if an evaluation ran at or before it."""
        value = self.meta.get("eval_loss")
        return None if value is None else float(value)

    @property
    def train_loss(self) -> float | None:
        """Train loss recorded with the checkpoint."""
        value = self.meta.get("train_loss")
        return None if value is None else float(value)


# ---------------------------------------------------------------------------------------------------------------------
# Reading


def _read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{meta_path} is missing: the checkpoint is incomplete (its writer stopped before finishing); "
            "use another checkpoint or delete this folder"
        ) from None
    except (OSError, ValueError) as err:  # ValueError: bad JSON, and bytes that are not UTF-8
        raise CheckpointError(f"{meta_path} cannot be read as JSON ({err}); use another checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path} is not a JSON object; use another checkpoint")
    return meta


def list_complete(directory: Path) -> list[CheckpointInfo]:
    """Complete checkpoints in ``directory`` (folders ``step-*`` holding ``meta.json``), sorted by step.

    Cheap: files are not hashed (use :func:`verify`). Temporary folders, folders without ``meta.json`` and folders
    whose ``meta.json`` does not parse are skipped (the last with a warning).

    Args:
        directory: The checkpoint directory; a missing one holds no checkpoints.

    Returns:
        One :class:`CheckpointInfo` per complete checkpoint, oldest first.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_RE.match(child.name)
        if not match or not child.is_dir() or not (child / META_FILE).exists():
            continue
        try:
            meta = _read_meta(child)
        except CheckpointError as err:
            log.warning("ignoring checkpoint: %s", err)
            continue
        found.append(CheckpointInfo(child, int(match.group(1)), meta))
    return sorted(found, key=lambda info: info.step)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(path: Path) -> CheckpointInfo:
    """Check a checkpoint folder: ``meta.json`` parses and has its fields, every file has its recorded size and sha256.

    Args:
        path: A checkpoint folder (``step-*`` in a checkpoint directory, or a copy of one anywhere).

    Returns:
        The verified checkpoint.

    Raises:
        CheckpointError: naming the file and the problem (missing, truncated, checksum mismatch) and what to do.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder (it does not exist or is a file); check the path")
    meta = _read_meta(path)
    missing = [key for key in _REQUIRED_META if key not in meta]
    if missing:
        raise CheckpointError(f"{path / META_FILE} lacks {', '.join(missing)}; it was not written by ortflow's writer")
    if meta["format"] != FORMAT:
        raise CheckpointError(
            f"{path / META_FILE}: format {meta['format']} is not supported by this ortflow (reads format {FORMAT}); "
            "use the ortflow version that wrote it"
        )
    step = meta["step"]
    match = _STEP_RE.match(path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(f"{path / META_FILE} records step {step} but the folder is {path.name}; it was moved")
    files = meta["files"]
    if not isinstance(files, dict) or CHECKPOINT_FILE not in files:
        raise CheckpointError(f"{path / META_FILE}: 'files' does not list '{CHECKPOINT_FILE}'; the meta is damaged")
    advice = "the checkpoint is damaged: use an earlier one (or delete this folder to resume from the previous one)"
    for name, record in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; {advice}")
        size = file.stat().st_size
        if size != record["bytes"]:
            kind = "truncated" if size < record["bytes"] else "wrong size"
            raise CheckpointError(f"{file} is {kind}: {size} of {record['bytes']} bytes; {advice}")
        if _sha256(file) != record["sha256"]:
            raise CheckpointError(f"{file}: checksum mismatch (sha256 differs from meta.json); {advice}")
    return CheckpointInfo(path, int(step), meta)


def latest_verified(directory: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``directory`` that verifies; damaged newer ones are skipped with a warning."""
    for info in reversed(list_complete(directory)):
        try:
            return verify(info.path)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", info.path.name, err)
    return None


def resolve_resume(directory: Path, checkpoint_to_load: Path | None) -> CheckpointInfo | None:
    """The checkpoint a run resumes from.

    Args:
        directory: The run's checkpoint directory.
        checkpoint_to_load: A checkpoint the user named (config ``checkpoint.checkpoint_to_load_path``), or None.

    Returns:
        The named checkpoint (verified), else the newest complete one that verifies, else None (fresh start).

    Raises:
        CheckpointError: the named checkpoint is damaged; there is no silent fall back when the user chose one.
    """
    if checkpoint_to_load is not None:
        return verify(Path(checkpoint_to_load))
    return latest_verified(directory)


# ---------------------------------------------------------------------------------------------------------------------
# Retention


def retention_to_delete(steps: Sequence[int], keep_newest: int, protect: Collection[int] = ()) -> list[int]:
    """The retention policy: which checkpoints to delete.

    Shared by the trainer (keep the newest) and the retention stage (which also protects the best and final steps).

    Args:
        steps: Steps of the complete checkpoints that exist.
        keep_newest: How many of the largest steps to keep (>= 0).
        protect: Steps kept whatever their age.

    Returns:
        The steps to delete, sorted ascending.
    """
    if keep_newest < 0:
        raise ValueError(f"keep_newest must be >= 0, got {keep_newest}")
    unique = sorted(set(steps))
    newest = set(unique[max(0, len(unique) - keep_newest) :]) if keep_newest else set()
    keep = newest | set(protect)
    return [step for step in unique if step not in keep]


def delete_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder; ``meta.json`` goes first so a half-deleted folder is never taken as complete."""
    (Path(path) / META_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def _engine_writer(state: Any, path: Path) -> None:
    from ortflow.engine import api  # here, so reading and retention never load the engine

    api.CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes the names in a folder (created, renamed) durable; some filesystems refuse fsync on folders.
    try:
        _fsync_file(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointManager:
    """Decides when to save, writes checkpoints atomically (writer rank only) and applies retention.

    Args:
        directory: The checkpoint directory (created on the writer).
        period: Save every this many weight updates; 0 saves only the final checkpoint.
        max_num_checkpoints: Complete checkpoints kept; older ones are deleted after a new one is complete.
        is_writer: True on the rank that writes (rank 0); other ranks' saves are no-ops.
        clock: Seconds since the epoch, for ``created`` in meta.json (passed in so tests control time).
        writer: Writes the state into a file path; default: the engine's ``save_checkpoint`` with optimizer state.
    """

    def __init__(
        self,
        directory: Path,
        period: int,
        max_num_checkpoints: int,
        is_writer: bool,
        clock: Callable[[], float] = time.time,
        writer: StateWriter = _engine_writer,
    ):
        if period < 0:
            raise ValueError(f"checkpoint.period must be >= 0 (0: only the final checkpoint), got {period}")
        if max_num_checkpoints < 1:
            raise ValueError(f"checkpoint.max_num_checkpoints must be >= 1, got {max_num_checkpoints}")
        self.directory = Path(directory)
        self.period = period
        self.max_num_checkpoints = max_num_checkpoints
        self.is_writer = is_writer
        self._clock = clock
        self._writer = writer
        self._saved_steps: set[int] = set()
        if is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean_stale_tmp()

    # -- policy ------------------------------------------------------------------------------------------------------

    def should_save(self, step: int, final: bool = False) -> bool:
        """True at every ``period``-th weight update and at the final one, never twice for one step."""
        if step in self._saved_steps:
            return False
        return final or (self.period > 0 and step > 0 and step % self.period == 0)

    def maybe_save(self, step: int, state: Any, meta: dict, final: bool = False) -> Path | None:
        """Save if :meth:`should_save` says so; the loop calls this after every weight update.

        Returns:
            The new checkpoint folder, or None when nothing was written (not due, or not the writer rank).
        """
        if not self.should_save(step, final):
            return None
        return self.save(step, state, meta)

    # -- reading -----------------------------------------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint that verifies (damaged newer ones are skipped with a warning)."""
        return latest_verified(self.directory)

    # -- writing -----------------------------------------------------------------------------------------------------

    def clean_stale_tmp(self) -> list[Path]:
        """Delete temporary folders left by writer processes that are no longer alive; returns what was deleted."""
        removed = []
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            if not child.name.startswith(_TMP_PREFIX):
                continue
            pid_text = child.name.rsplit("-", 1)[-1]
            pid = int(pid_text) if pid_text.isdigit() else None
            # Our own pid cannot belong to a live writer: this manager has not written yet.
            if pid is None or pid == os.getpid() or not _pid_alive(pid):
                if self._restore_replaced(child):
                    continue
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        if removed:
            log.info("removed %d stale temporary checkpoint folder(s): %s", len(removed), [p.name for p in removed])
        return removed

    def _restore_replaced(self, aside: Path) -> bool:
        """Put back a complete checkpoint set aside for replacement when its writer died before the new one landed."""
        match = re.match(rf"^{re.escape(_TMP_PREFIX)}replaced-(step-\d+)-\d+$", aside.name)
        if not match or not (aside / META_FILE).exists() or (self.directory / match.group(1)).exists():
            return False
        os.rename(aside, self.directory / match.group(1))
        _fsync_dir(self.directory)
        log.warning("restored %s, set aside by a writer that stopped while replacing it", match.group(1))
        return True

    def save(self, step: int, state: Any, meta: dict) -> Path | None:
        """Write the checkpoint of ``step`` atomically, then delete checkpoints beyond ``max_num_checkpoints``.

        Args:
            step: Weight updates done.
            state: The engine's ``api.CheckpointState`` (parameters and optimizer state).
            meta: JSON-serializable fields recorded in meta.json (global_cursor, losses, rng, config_fingerprint, ...);
                step, files, format, created and ortflow_version are added here.

        Returns:
            The checkpoint folder, or None on a rank that is not the writer.

        Raises:
            CheckpointError: writing failed (e.g. the disk is full); existing checkpoints are untouched and no
                temporary folder remains.
        """
        self._saved_steps.add(step)
        if not self.is_writer:
            return None
        name = step_dirname(step)
        tmp = self.directory / f"{_TMP_PREFIX}{name}-{os.getpid()}"
        final = self.directory / name
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._writer(state, tmp / CHECKPOINT_FILE)
            files = {}
            for file in sorted(tmp.iterdir()):
                _fsync_file(file)
                files[file.name] = {"sha256": _sha256(file), "bytes": file.stat().st_size}
            if CHECKPOINT_FILE not in files:
                raise CheckpointError(f"the state writer did not create {tmp / CHECKPOINT_FILE}")
            full_meta = {
                **meta,
                "format": FORMAT,
                "step": step,
                "files": files,
                "ortflow_version": __version__,
                "created": datetime.fromtimestamp(self._clock(), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            meta_path = tmp / META_FILE
            with open(meta_path, "w") as f:
                json.dump(full_meta, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            self._move_into_place(tmp, final)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            self._saved_steps.discard(step)
            if isinstance(err, (OSError, RuntimeError)):  # the engine's writer raises RuntimeError (disk full)
                raise CheckpointError(
                    f"could not write checkpoint {name} in {self.directory}: {err}; the earlier checkpoints are "
                    "intact and no partial folder was left. Free disk space or point checkpoint.dir elsewhere"
                ) from err
            raise
        log.info("saved checkpoint %s", final)
        self._apply_retention(protect={step})
        return final

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        aside = None
        if final.exists():
            if (final / META_FILE).exists():
                # A complete checkpoint of this step exists: keep it until the new one is in place.
                aside = self.directory / f"{_TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(final, aside)
            else:
                shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def _apply_retention(self, protect: Collection[int]) -> list[int]:
        complete = list_complete(self.directory)
        doomed = retention_to_delete([c.step for c in complete], self.max_num_checkpoints, protect)
        for info in complete:
            if info.step in doomed:
                delete_checkpoint(info.path)
                log.info("retention: deleted checkpoint %s", info.path.name)
        return doomed
