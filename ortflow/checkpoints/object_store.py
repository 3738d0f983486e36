"""Checkpoints on an object store: the same complete-or-absent protocol as local folders, with a marker for a rename.

A checkpoint on the store is the key prefix ``step-%08d/`` holding the same files as the local folder; it is complete
when ``step-%08d/meta.json`` exists. Uploading a complete local checkpoint (:meth:`RemoteCheckpoints.upload`):

1. every file except meta.json goes to a temporary prefix ``.tmp-step-%08d-<token>/``;
2. each uploaded object's size is checked against meta.json's record;
3. the objects are copied to ``step-%08d/`` inside the store, and meta.json is written there last;
4. the temporary prefix is deleted.

A writer killed at any point leaves at most a temporary prefix or a ``step-*`` prefix without meta.json, which every
reader ignores and the next writer deletes (:meth:`RemoteCheckpoints.clean_stale`). Deleting goes the other way:
meta.json first. Downloads land in a local temporary folder, are verified (sizes and sha256 of meta.json), then
renamed into place, so the local copy keeps the local protocol too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path

from ortflow.checkpoints.folder import (
    META_FILE,
    STEP_RE,
    TMP_PREFIX,
    CheckpointError,
    CheckpointInfo,
    step_dirname,
    verify,
)
from ortflow.storage import RemoteDir, StorageError

log = logging.getLogger("ortflow.checkpoints")


class RemoteCheckpoints:
    """The checkpoint directory on the store (``remote``) and its local copy (``local``).

    Args:
        remote: The remote checkpoint directory.
        local: The local checkpoint directory the trainer writes and reads.
        token: Names this writer's temporary prefixes (rank 0's pid).
    """

    def __init__(self, remote: RemoteDir, local: Path, token: int | None = None):
        self.remote, self.local, self.token = remote, Path(local), token if token is not None else os.getpid()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on the store (prefixes holding meta.json), ascending."""
        found = []
        for rel in self.remote.glob(f"step-*/{META_FILE}"):
            match = STEP_RE.match(rel.split("/", 1)[0])
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    # -- writing -----------------------------------------------------------------------------------------------------

    def amend(self, folder: Path) -> None:
        """Replace the store's meta.json of the complete checkpoint ``folder`` with the local one (its state files are
        unchanged; one object written whole, so the store's checkpoint stays complete)."""
        folder = Path(folder)
        try:
            self.remote.put(folder / META_FILE, f"{folder.name}/{META_FILE}")
        except StorageError as err:
            raise CheckpointError(f"could not update {self.remote.url}/{folder.name}/{META_FILE}: {err}") from err

    def upload(self, folder: Path) -> None:
        """Upload the complete local checkpoint ``folder`` (see the module docstring for the protocol).

        Raises:
            CheckpointError: the store failed (after retries) or an uploaded object has the wrong size; the store
                keeps its earlier complete checkpoints.
        """
        folder = Path(folder)
        meta = json.loads((folder / META_FILE).read_text())
        name = folder.name
        tmp = f"{TMP_PREFIX}{name}-{self.token}"
        try:
            for file in sorted(meta["files"]):
                self.remote.put(folder / file, f"{tmp}/{file}")
            for file, record in meta["files"].items():
                size = self.remote.size(f"{tmp}/{file}")
                if size != record["bytes"]:
                    raise CheckpointError(f"{self.remote.url}/{tmp}/{file} holds {size} bytes after upload, not "
                                          f"{record['bytes']}; the store is not keeping what it is sent")
            self.remote.remove(f"{name}/{META_FILE}")  # a complete checkpoint of this step stops being one first
            for stale in set(self.remote.files(name)) - set(meta["files"]):
                self.remote.remove(f"{name}/{stale}")
            for file in sorted(meta["files"]):
                self.remote.copy(f"{tmp}/{file}", f"{name}/{file}")
            self.remote.put(folder / META_FILE, f"{name}/{META_FILE}")  # the marker, last
            self.remote.remove_tree(tmp)
        except StorageError as err:
            raise CheckpointError(f"could not upload checkpoint {name}: {err}") from err
        log.info("uploaded checkpoint %s to %s", name, self.remote.url)

    def send(self, tmp: Path) -> None:
        """Upload this rank's files of a checkpoint in progress (the local temporary folder ``tmp``) to the store's
        temporary prefix of the same name, where the writer rank collects them (:meth:`receive`).

        Raises:
            CheckpointError: the store failed after retries.
        """
        try:
            for file in sorted(Path(tmp).iterdir()):
                self.remote.put(file, f"{Path(tmp).name}/{file.name}")
        except StorageError as err:
            raise CheckpointError(f"could not send this rank's checkpoint files to the store: {err}") from err

    def receive(self, tmp: Path) -> list[str]:
        """Download into ``tmp`` the files other ranks sent to the store's temporary prefix of the same name."""
        try:
            theirs = sorted(set(self.remote.files(Path(tmp).name)) - {p.name for p in Path(tmp).iterdir()})
            for name in theirs:
                self.remote.get(f"{Path(tmp).name}/{name}", Path(tmp) / name)
        except StorageError as err:
            raise CheckpointError(f"could not collect the other ranks' checkpoint files from the store: {err}") \
                from err
        return theirs

    def delete(self, step: int) -> None:
        """Delete the checkpoint of ``step`` on the store; meta.json goes first."""
        name = step_dirname(step)
        self.remote.remove(f"{name}/{META_FILE}")
        self.remote.remove_tree(name)

    def retain(self, keep_newest: int, protect: Collection[int]) -> list[int]:
        """Apply the trainer's retention policy to the store's checkpoints; returns the deleted steps."""
        from ortflow.checkpoints.manager import retention_to_delete

        try:
            doomed = retention_to_delete(self.steps(), keep_newest, protect)
            for step in doomed:
                self.delete(step)
                log.info("retention: deleted checkpoint %s on %s", step_dirname(step), self.remote.url)
        except StorageError as err:
            raise CheckpointError(f"retention on the store failed: {err}") from err
        return doomed

    def clean_stale(self) -> list[str]:
        """Delete what killed writers left on the store: temporary prefixes and ``step-*`` prefixes without meta.json.

        Call only where no other writer of this checkpoint directory runs (the run folder's lock is held).
        """
        try:
            complete = {step_dirname(s) for s in self.steps()}
            tops = {rel.split("/", 1)[0] for rel in self.remote.files()}
            stale = sorted(t for t in tops if t.startswith(TMP_PREFIX) or (STEP_RE.match(t) and t not in complete))
            for top in stale:
                self.remote.remove_tree(top)
        except StorageError as err:
            raise CheckpointError(f"cannot clean the checkpoint directory on the store: {err}") from err
        if stale:
            log.info("removed %d incomplete checkpoint prefix(es) on %s: %s", len(stale), self.remote.url, stale)
        return stale

    # -- reading -----------------------------------------------------------------------------------------------------

    def download(self, step: int) -> CheckpointInfo:
        """Copy the store's checkpoint of ``step`` into the local directory (verified, then renamed into place).

        Raises:
            CheckpointError: it is incomplete or damaged on the store, or the download failed.
        """
        name = step_dirname(step)
        final = self.local / name
        tmp = self.local / f"{TMP_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            meta = json.loads(self.remote.read_bytes(f"{name}/{META_FILE}"))
            for file in sorted(meta.get("files", {})):
                self.remote.get(f"{name}/{file}", tmp / file)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
            info = verify(tmp)
        except (StorageError, FileNotFoundError, ValueError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {name} on {self.remote.url} cannot be used ({err})") from err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        log.info("downloaded checkpoint %s from %s", name, self.remote.url)
        return CheckpointInfo(final, info.step, info.meta)

    def pull(self, newest_only: bool) -> list[int]:
        """Make the local directory hold the store's complete checkpoints (the newest that verifies, or all).

        Local checkpoints the store lacks are deleted (the store is the truth), except when the store lists none.
        Returns the steps now held locally and on the store.
        """
        self.local.mkdir(parents=True, exist_ok=True)
        remote_steps = self.steps()
        local = {int(m.group(1)): p for p in self.local.iterdir() if (m := STEP_RE.match(p.name))}
        for step, path in local.items():
            if step not in remote_steps and remote_steps:
                (path / META_FILE).unlink(missing_ok=True)
                shutil.rmtree(path, ignore_errors=True)
        held = []
        for step in reversed(remote_steps):
            path = self.local / step_dirname(step)
            try:
                if not _same_meta(path, self.remote, step_dirname(step)):
                    self.download(step)
                held.append(step)
            except CheckpointError as err:
                log.warning("skipping checkpoint %s on the store: %s", step_dirname(step), err)
                continue
            if newest_only:
                break
        return sorted(held)


def _same_meta(path: Path, remote: RemoteDir, name: str) -> bool:
    """True when the local folder holds the very checkpoint the store holds (same meta.json content)."""
    try:
        local_meta = (path / META_FILE).read_bytes()
    except OSError:
        return False
    return json.loads(local_meta) == json.loads(remote.read_bytes(f"{name}/{META_FILE}"))

