"""Writing checkpoints atomically, retention, and the cleanup of what a killed writer left.

The writer rank builds the folder under a hidden temporary name, every file is fsynced, ``meta.json`` is written last
with the size and sha256 of each file and its own digest, the folder is renamed into place and the parent fsynced; only
then does retention delete old checkpoints (levanter ``checkpoint.py``; torchtitan ``components/checkpoint.py``). Under
ZeRO-1 every rank writes its own optimizer shard into the same temporary folder (named after rank 0's pid), between two
barriers; rank 0 alone checksums, writes meta.json and renames. The loop only calls :meth:`CheckpointManager.save`
when :meth:`CheckpointManager.should_save` says so: the manager decides when to save and what to delete.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ortflow import __version__
from ortflow.checkpoints.folder import (
    FORMAT,
    META_FILE,
    META_SHA_KEY,
    RUN_META_KEY,
    STEP_RE,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    file_sha256,
    latest_verified,
    list_complete,
    meta_digest,
    step_dirname,
)
from ortflow.processes import process_alive

log = logging.getLogger("ortflow.checkpoints")

StateWriter = Callable[[Any, Path], None]
"""Writes this rank's part of a training state into a checkpoint folder (see :mod:`.h5state`)."""

# ---------------------------------------------------------------------------------------------------------------------
# Retention


_DISK_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EROFS: "it is read-only", errno.EACCES: "permission is denied"}


def _write_meta(path: Path, meta: dict) -> None:
    """``meta`` with its own checksum (:data:`META_SHA_KEY`, recomputed) written to ``path`` and fsynced."""
    meta = {**meta, META_SHA_KEY: meta_digest(meta)}  # meta_digest leaves out an earlier checksum
    with open(path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def write_failure(err: BaseException) -> str:
    """Why a write failed, in words: h5py reports a full disk as ``... errno = 28, error message = ...`` in a long
    HDF5 message with no ``errno`` attribute, so the number is read from the text too."""
    code = getattr(err, "errno", None)
    if code is None:
        found = re.search(r"errno = (\d+)", str(err))
        code = int(found.group(1)) if found else None
    return _DISK_REASONS.get(code, str(err).splitlines()[0] if str(err) else type(err).__name__)


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


class CheckpointManager:
    """Decides when to save, writes checkpoints atomically and applies retention.

    Args:
        directory: The checkpoint directory (created on the writer).
        period: Save every this many weight updates; 0 saves only the final checkpoint.
        max_num_checkpoints: Complete checkpoints kept; older ones are deleted after a new one is complete.
        is_writer: True on the rank that finishes checkpoints (rank 0).
        writer: ``writer(state, folder)`` writes this rank's files into the temporary folder.
        clock: Seconds since the epoch, for ``created`` in meta.json (passed in so tests control time).
        shared: Under ZeRO-1 every rank writes a file: ``(barrier, token)`` with a barrier over all ranks and a token
            that is the same on every rank (rank 0's pid) naming the temporary folder. None: only the writer writes.
        owner: The run's identity (:func:`.owner.run_owner`), recorded in every meta.json so that another run
            sharing the directory is refused on resume.
        mirror: With a remote run folder, the store's checkpoint directory
            (:class:`.object_store.RemoteCheckpoints`): the writer uploads every complete checkpoint there and applies
            retention there too.
        own_copies: Each rank works in its own copy of the run folder (no shared filesystem): under ``shared``, the
            other ranks' files reach the writer through the store's temporary prefix (``mirror`` on every rank).
    """

    def __init__(
        self,
        directory: Path,
        period: int,
        max_num_checkpoints: int,
        is_writer: bool,
        writer: StateWriter,
        clock: Callable[[], float] = time.time,
        shared: tuple[Callable[[str], None], int] | None = None,
        owner: dict | None = None,
        mirror: Any = None,
        own_copies: bool = False,
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
        self._shared = shared
        self._token = shared[1] if shared else os.getpid()
        self._saved_steps: set[int] = set()
        self._owner = owner
        self._relay = own_copies and shared is not None  # per-rank files travel through the store
        self._mirror = mirror if is_writer or self._relay else None
        if is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean_stale_tmp()
            if self._mirror is not None:
                self._mirror.clean_stale()

    # -- policy ------------------------------------------------------------------------------------------------------

    def should_save(self, step: int, final: bool = False) -> bool:
        """True at every ``period``-th weight update and at the final one, never twice for one step."""
        if step in self._saved_steps:
            return False
        return final or (self.period > 0 and step > 0 and step % self.period == 0)

    def maybe_save(self, step: int, state: Any, meta: dict, final: bool = False) -> Path | None:
        """Save if :meth:`should_save` says so.

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

    # -- cleanup -----------------------------------------------------------------------------------------------------

    def clean_stale_tmp(self) -> list[Path]:
        """Remove what killed writers left: temporary folders of dead writers, ``step-*`` folders without meta.json.

        A ``step-*`` folder without ``meta.json`` is never a checkpoint in progress (writers build under a temporary
        name and rename complete folders); it is what a kill during retention leaves (meta.json is deleted first).
        """
        removed = []
        for child in sorted(self.directory.iterdir()) if self.directory.is_dir() else ():
            if STEP_RE.match(child.name) and child.is_dir() and not (child / META_FILE).exists():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
                continue
            if not child.name.startswith(TMP_PREFIX):
                continue
            pid_text = child.name.rsplit("-", 1)[-1]
            pid = int(pid_text) if pid_text.isdigit() else None
            # Our own pid (or token) cannot belong to a live writer: this manager has not written yet.
            if pid is None or pid in (os.getpid(), self._token) or not process_alive(pid):
                if self._restore_replaced(child):
                    continue
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        if removed:
            log.info("removed %d incomplete checkpoint folder(s): %s", len(removed), [p.name for p in removed])
        return removed

    def _restore_replaced(self, aside: Path) -> bool:
        """Put back a complete checkpoint set aside for replacement when its writer died before the new one landed."""
        match = re.match(rf"^{re.escape(TMP_PREFIX)}replaced-(step-\d+)-\d+$", aside.name)
        if not match or not (aside / META_FILE).exists() or (self.directory / match.group(1)).exists():
            return False
        os.rename(aside, self.directory / match.group(1))
        _fsync_dir(self.directory)
        log.warning("restored %s, set aside by a writer that stopped while replacing it", match.group(1))
        return True

    # -- writing -----------------------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: dict) -> Path | None:
        """Write the checkpoint of ``step`` atomically, then delete checkpoints beyond ``max_num_checkpoints``.

        Args:
            step: Weight updates done.
            state: What the writer stores (the trainer's :class:`~.h5state.TrainState`).
            meta: JSON-serializable fields recorded in meta.json (global_cursor, losses, rng, config_fingerprint, ...);
                step, files, format, created, ortflow_version and meta_sha256 are added here.

        Returns:
            The checkpoint folder, or None on a rank that is not the writer.

        Raises:
            CheckpointError: writing failed (e.g. the disk is full); existing checkpoints are untouched and no
                temporary folder remains.
        """
        self._saved_steps.add(step)
        if not self.is_writer and self._shared is None:
            return None
        name = step_dirname(step)
        tmp = self.directory / f"{TMP_PREFIX}{name}-{self._token}"
        final = self.directory / name
        try:
            if self.is_writer or self._relay:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            if self._shared:
                self._shared[0]("checkpoint folder created")  # Sync point: every rank writes into the new folder
            self._writer(state, tmp)
            if self._relay and not self.is_writer:
                self._mirror.send(tmp)
            if self._shared:
                self._shared[0]("checkpoint files written")  # Sync point: rank 0 checksums every rank's file
            if not self.is_writer:
                if self._relay:
                    shutil.rmtree(tmp, ignore_errors=True)
                return None
            if self._relay:
                self._mirror.receive(tmp)
            self._finish(step, tmp, meta)
            self._move_into_place(tmp, final)
        except BaseException as err:
            if self.is_writer or self._relay:
                shutil.rmtree(tmp, ignore_errors=True)
            self._saved_steps.discard(step)
            if isinstance(err, (OSError, RuntimeError)):  # h5py raises RuntimeError on some write failures (disk full)
                raise CheckpointError(
                    f"could not write checkpoint {name} in {self.directory}: {write_failure(err)}; the earlier "
                    "checkpoints are intact and no partial folder was left. Free disk space or point checkpoint.dir "
                    "elsewhere"
                ) from err
            raise
        log.info("saved checkpoint %s", final)
        if self._mirror is not None:
            self._mirror.upload(final)  # complete on the store before retention deletes anything there
        self._apply_retention(protect={step})
        return final

    def amend(self, step: int, fields: dict) -> Path | None:
        """Record ``fields`` (the final evaluation's loss) in the checkpoint of ``step``, written before them: only its
        meta.json is written again (a new file, fsynced, renamed over the old one, its checksum recomputed); the state
        files stay as they are, and the checkpoint is complete at every moment.

        Returns:
            The checkpoint folder on the writer rank, else None.

        Raises:
            CheckpointError: the checkpoint of ``step`` is not there, or writing failed; the checkpoint stays complete
                with its earlier meta.json.
        """
        if not self.is_writer:
            return None
        folder = self.directory / step_dirname(step)
        part = folder / f"{META_FILE}.{TMP_PREFIX}{self._token}"
        try:
            _write_meta(part, {**json.loads((folder / META_FILE).read_text()), **fields})
            os.replace(part, folder / META_FILE)
            _fsync_dir(folder)
        except (OSError, ValueError) as err:
            part.unlink(missing_ok=True)
            raise CheckpointError(f"could not record {sorted(fields)} in checkpoint {folder}: {write_failure(err)}; "
                                  "the checkpoint is intact without them") from err
        if self._mirror is not None:
            self._mirror.amend(folder)
        return folder

    def _finish(self, step: int, tmp: Path, meta: dict) -> None:
        files = {}
        for file in sorted(tmp.iterdir()):
            _fsync_file(file)
            files[file.name] = {"sha256": file_sha256(file), "bytes": file.stat().st_size}
        if not files:
            raise CheckpointError(f"the state writer created no file in {tmp}")
        full_meta = {
            **meta,
            **({RUN_META_KEY: self._owner} if self._owner else {}),
            "format": FORMAT,
            "step": step,
            "files": files,
            "ortflow_version": __version__,
            "created": datetime.fromtimestamp(self._clock(), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        _write_meta(tmp / META_FILE, full_meta)
        _fsync_dir(tmp)

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        aside = None
        if final.exists():
            if (final / META_FILE).exists():
                # A complete checkpoint of this step exists: keep it until the new one is in place.
                aside = self.directory / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
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
        if self._mirror is not None:
            self._mirror.retain(self.max_num_checkpoints, protect)
        return doomed
