"""Sealed records: small JSON files that carry the sha256 of their own content, and the run folder's config record.

A run folder's files are verified before use against digests recorded by the stage that wrote them. The records that
hold those digests (``configure.json``, ``config.record.json``, ``.ortflow/run.json``) are themselves sealed: the
``record_sha256`` field is the sha256 of the record's other fields as canonical JSON, so a flipped bit or a truncation
of a record is found, and a record that is missing where its stage has run is refused instead of disabling the checks.

``config.yaml`` is written by configure (and by the flow's train stage when sections outside the artifacts change);
the writer records its sha256 and size in ``config.record.json``. Every reader (``ortflow train``, each rank,
export, evaluate) compares them first: a hand edit or a damaged file stops with the file, what was expected and the
fix (run ``ortflow configure CONFIG`` again, restore the file, or ``ortflow train --accept-changed-config``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ortflow.config.atomic import write_text_atomic

#: The key of a sealed record that holds the sha256 of its other fields.
SEAL_KEY = "record_sha256"
#: The run folder's record of ``config.yaml`` (written beside it by every writer of the resolved config; a visible
#: name, so that a run folder's sync to object storage carries it with the config).
CONFIG_RECORD = Path("config.record.json")


class RunFileDamaged(ValueError):
    """A file of a run folder differs from what the stage that wrote it recorded; the message names the file, what
    was expected and the fix."""


def _canonical(record: dict[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``record_sha256``: the sha256 of its other fields (canonical JSON)."""
    return {**{k: v for k, v in record.items() if k != SEAL_KEY},
            SEAL_KEY: hashlib.sha256(_canonical(record)).hexdigest()}


def seal_problem(record: Any) -> str | None:
    """Why ``record`` is not an intact sealed record (None when it is)."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    if SEAL_KEY not in record:
        return f"it has no {SEAL_KEY}"
    if hashlib.sha256(_canonical(record)).hexdigest() != record[SEAL_KEY]:
        return f"its content does not match its {SEAL_KEY} (edited or corrupted)"
    return None


def read_sealed(path: Path, fix: str) -> dict[str, Any] | None:
    """A sealed record, or None when the file does not exist.

    Raises:
        RunFileDamaged: it cannot be read, is not JSON, or differs from its seal; the message ends with ``fix``.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise RunFileDamaged(f"{path} cannot be read ({err}): {fix}") from None
    try:
        record = json.loads(text)
    except ValueError:
        raise RunFileDamaged(f"{path} is damaged (not valid JSON, {len(text)} characters): {fix}") from None
    problem = seal_problem(record)
    if problem:
        raise RunFileDamaged(f"{path} is damaged ({problem}): {fix}")
    return record


def write_sealed(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` sealed, atomically (fsynced, renamed into place); no temporary file remains on an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(seal(record), indent=2), fsync=True)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_config(run_dir: Path) -> None:
    """Record the sha256 and size of the run folder's ``config.yaml`` (its writer calls this after writing it)."""
    target = Path(run_dir) / "config.yaml"
    write_sealed(Path(run_dir) / CONFIG_RECORD, {"file": "config.yaml", "sha256": file_sha256(target),
                                                  "size": target.stat().st_size})


#: The record configure writes last into the run folder (sealed; it holds the artifacts' sha256).
CONFIGURE_RECORD = "configure.json"
CONFIGURE_FIX = ("run `ortflow configure CONFIG` again: it rebuilds what is damaged or missing (the checkpoints stay "
                 "valid for the same model)")


def read_configure(run_dir: Path) -> dict[str, Any]:
    """The run folder's ``configure.json``, its seal checked: what rank 0, export, evaluate and prepare-data trust.

    Raises:
        RunFileDamaged: it is missing (so nothing could be verified), unreadable, or differs from its seal.
    """
    path = Path(run_dir) / CONFIGURE_RECORD
    record = read_sealed(path, CONFIGURE_FIX)
    if record is None:
        raise RunFileDamaged(f"{path} is missing, so the artifacts cannot be verified: {CONFIGURE_FIX}")
    return record


CONFIG_FIX = ("run `ortflow configure CONFIG` again (it rewrites config.yaml from your config), restore the file, or, "
              "when the edit is intended, `ortflow train RUN_DIR --accept-changed-config`")


class ConfigChanged(RunFileDamaged):
    """``config.yaml`` differs from what its writer recorded (edited by hand, truncated, or flipped)."""


def verify_config(run_dir: Path, data: bytes | None = None) -> None:
    """Check the run folder's ``config.yaml`` against its record; ``data``: the file's bytes when the caller has
    already read them (so that what it parses is what was verified), else the file is read.

    Raises:
        RunFileDamaged: the record is damaged, or missing in a configured folder (``configure.json`` present).
        ConfigChanged: ``config.yaml`` differs from its record, naming the recorded and the found sha256 and size.
    """
    run_dir = Path(run_dir)
    target, record_path = run_dir / "config.yaml", run_dir / CONFIG_RECORD
    record = read_sealed(record_path, CONFIG_FIX)
    if record is None:
        if (run_dir / CONFIGURE_RECORD).exists():
            raise RunFileDamaged(f"{record_path} is missing, so {target} cannot be verified: {CONFIG_FIX}")
        return  # a folder whose config was written by hand (not configured): nothing recorded to compare
    if data is None:
        size, digest = target.stat().st_size, file_sha256(target)
    else:
        size, digest = len(data), hashlib.sha256(data).hexdigest()
    if digest != record.get("sha256") or size != record.get("size"):
        raise ConfigChanged(
            f"{target} differs from what configure wrote (expected sha256 {str(record.get('sha256'))[:16]}..., "
            f"{record.get('size')} bytes; found {digest[:16]}..., {size} bytes): {CONFIG_FIX}")
