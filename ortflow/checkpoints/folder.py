"""Checkpoint folders: complete-or-absent, verified on load, and the resume choice.

A checkpoint is a folder ``step-%08d`` under the checkpoint directory holding HDF5 files (docs/reliability.md):
``params.h5`` (every parameter once) and the optimizer state (``optimizer.h5``, or one
``optimizer-rank%05d-of-%05d.h5`` per rank under ZeRO-1), plus ``meta.json``, written last, with the size and sha256 of
every file and a sha256 of meta.json's own content (``meta_sha256``), so an edit or a flipped bit anywhere, meta
included, is detected. Folders without ``meta.json`` are incomplete and every reader here ignores them. Format 1
folders (the engine's single ``checkpoint`` file, written before ortflow owned the update) still verify and resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint"
"""The engine's state file of format 1 checkpoints (and of the artifacts' initial state)."""
PARAMS_FILE = "params.h5"
META_FILE = "meta.json"
FORMAT = 2
"""Version of the folder layout and meta.json fields; bump when either changes incompatibly."""
READABLE_FORMATS = (1, 2)
META_SHA_KEY = "meta_sha256"

MICRO_BATCHES_KEY = "micro_batches_per_rank"
"""meta.json: micro-batches each rank ran forward in training mode up to the checkpoint, resumes included."""

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
_REQUIRED_META = ("format", "step", "files")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written; the message names the file, the problem and what to do."""


def h5_file(path: Path | str, mode: str):
    """``h5py.File(path, mode)``: the one place that imports h5py for the checkpoint files.

    It is imported at the first file a process opens, not with this package: most ranks never read or write one (in
    plain data parallelism only rank 0 writes; a fresh run reads none), and h5py costs a rank a tenth of a second.
    """
    import h5py

    return h5py.File(path, mode)


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
        """The engine's state file of a format 1 checkpoint (format 2 holds ``params.h5`` instead)."""
        return self.path / CHECKPOINT_FILE

    @property
    def format(self) -> int:
        """Folder format: 1 (the engine's file) or 2 (HDF5)."""
        return int(self.meta.get("format", 1))

    @property
    def global_cursor(self) -> int | None:
        """Samples consumed by all ranks together when this checkpoint was written (the loader's cursor)."""
        return self.meta.get("global_cursor")

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each rank ran forward in training mode up to this checkpoint (what torch's BatchNorm counts
        in ``num_batches_tracked``). Checkpoints that do not record it count ``step`` updates of the micro-batches
        per update their run was configured with."""
        recorded = self.meta.get(MICRO_BATCHES_KEY)
        if recorded is not None:
            return int(recorded)
        steps, updates = self.meta.get("num_train_steps"), self.meta.get("num_weight_updates")
        return self.step * (int(steps) // int(updates) if steps and updates else 1)

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


def meta_digest(meta: dict) -> str:
    """sha256 of meta.json's content without its own digest (canonical JSON: sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != META_SHA_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_meta_digest(path: Path, meta: dict) -> None:
    recorded = meta.get(META_SHA_KEY)
    if recorded is None and meta.get("format") == 1:
        return  # format 1 predates the digest
    if recorded != meta_digest(meta):
        raise CheckpointError(
            f"{path / META_FILE} was modified after it was written (its {META_SHA_KEY} does not match its content); "
            "use an earlier checkpoint (or delete this folder to resume from the previous one)"
        )


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
        match = STEP_RE.match(child.name)
        if not match or not child.is_dir() or not (child / META_FILE).exists():
            continue
        try:
            meta = _read_meta(child)
        except CheckpointError as err:
            log.warning("ignoring checkpoint: %s", err)
            continue
        found.append(CheckpointInfo(child, int(match.group(1)), meta))
    return sorted(found, key=lambda info: info.step)


def file_sha256(path: Path) -> str:
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
    if meta["format"] not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path / META_FILE}: format {meta['format']} is not supported by this ortflow (reads formats "
            f"{READABLE_FORMATS}); use the ortflow version that wrote it"
        )
    _check_meta_digest(path, meta)
    step = meta["step"]
    match = STEP_RE.match(path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(f"{path / META_FILE} records step {step} but the folder is {path.name}; it was moved")
    files = meta["files"]
    if not isinstance(files, dict) or not files or (meta["format"] == 1 and CHECKPOINT_FILE not in files):
        raise CheckpointError(f"{path / META_FILE}: 'files' lists no checkpoint file; the meta is damaged")
    advice = "the checkpoint is damaged: use an earlier one (or delete this folder to resume from the previous one)"
    for name, record in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; {advice}")
        size = file.stat().st_size
        if size != record["bytes"]:
            kind = "truncated" if size < record["bytes"] else "wrong size"
            raise CheckpointError(f"{file} is {kind}: {size} of {record['bytes']} bytes; {advice}")
        if file_sha256(file) != record["sha256"]:
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


def final_checkpoint(directory: Path, num_updates: int, owner: dict | None = None) -> CheckpointInfo | None:
    """The run's final checkpoint (at step ``num_updates`` or later) when it is the newest and verifies, else None.

    With it, training has nothing left to do: a launch would only start ranks (or queue a scheduler job) that resume
    at the last step and exit. A damaged final checkpoint gives None: the ranks fall back to an older one and train
    again. ``owner`` (this run's identity, :func:`.owner.run_owner`): a checkpoint another run wrote, or one that a
    folder without an id of its own yet (a copy) holds, gives None too: the ranks refuse it, naming both runs.
    """
    done = list_complete(directory)
    if not done or done[-1].step < num_updates:
        return None
    try:
        info = verify(done[-1].path)
    except (CheckpointError, OSError):
        return None
    theirs = info.meta.get(RUN_META_KEY)
    if owner is not None and isinstance(theirs, dict) and theirs.get("run_id") != owner.get("run_id"):
        return None
    return info


def resolve_resume(
    directory: Path, checkpoint_to_load: Path | None, owner: dict | None = None
) -> CheckpointInfo | None:
    """The checkpoint a run resumes from.

    Args:
        directory: The run's checkpoint directory.
        checkpoint_to_load: A checkpoint the user named (config ``checkpoint.checkpoint_to_load_path``), or None.
        owner: This run's identity (:func:`.owner.run_owner`): the newest checkpoint must belong to it.

    Returns:
        The named checkpoint (verified), else the newest complete one that verifies, else None (fresh start).

    Raises:
        CheckpointError: the named checkpoint is damaged (there is no silent fall back when the user chose one), or
            the newest checkpoint in ``directory`` belongs to another run.
    """
    if checkpoint_to_load is not None:
        return verify(Path(checkpoint_to_load))
    found = latest_verified(directory)
    if found is not None and owner is not None:
        check_owner(found, owner)
    return found


#: The key of meta.json that names the run a checkpoint belongs to (``owner.run_owner``).
RUN_META_KEY = "run"


def _describe(owner: dict) -> str:
    fingerprint, run_id = str(owner.get("config_fingerprint"))[:12], str(owner.get("run_id"))[:8]
    return f"run '{owner.get('name')}' (folder {owner.get('output_dir')}, config {fingerprint}, id {run_id})"


def check_owner(info: CheckpointInfo, owner: dict) -> None:
    """Refuse to resume this run from a checkpoint another run wrote.

    Raises:
        CheckpointError: naming both runs and the fix.
    """
    theirs = info.meta.get(RUN_META_KEY)
    if not isinstance(theirs, dict) or not theirs.get("run_id") or not owner.get("run_id"):
        return  # written before checkpoints recorded their run: nothing to compare
    if theirs["run_id"] == owner["run_id"]:
        return
    raise CheckpointError(
        f"{info.path} belongs to {_describe(theirs)}, not to this {_describe(owner)}: two runs share the checkpoint "
        f"folder {info.path.parent}, and resuming would continue the other run's weights. Give each run its own "
        f"checkpoint.dir (or remove it to use <output_dir>/checkpoints); a copied run folder is a new run, so move "
        f"the checkpoints it copied out of its checkpoint folder; to start from that checkpoint on purpose, set "
        f"checkpoint.init_from to it"
    )
