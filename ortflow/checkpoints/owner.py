"""Which run a checkpoint belongs to: a run identity kept in the run folder and recorded in every checkpoint.

A run folder gets a random id the first time it is trained (``<run folder>/.ortflow/run.json``, a sealed record:
:mod:`ortflow.config.sealed`) that also names the folder it was given in. Every checkpoint's ``meta.json`` records
the id, the run's name, its folder and its config fingerprint under ``run``. A resume from a checkpoint directory
refuses a newest checkpoint another run wrote (two runs pointed at one ``checkpoint.dir``), naming both runs, instead
of continuing the other run's weights; a checkpoint named on purpose (``checkpoint.checkpoint_to_load_path``) is the
user's choice and is not checked.

The identity survives a move and not a copy. When the record names another folder than the one it is read in:

* the folder it names still holds a record with the same id: this folder is a copy (``cp -r exp1 exp2``), so it is a
  new run with a new id, which refuses the original's checkpoints and never deletes them;
* otherwise the folder was moved: it keeps its id (its checkpoints are its own) and the record names the new place.

A record that is missing or damaged is rebuilt from the run's own checkpoints (the newest whose ``run`` names this
folder) when there are any, so a damaged ``run.json`` never makes a run refuse its own checkpoints.

A run folder on object storage keeps its id on the store (``.ortflow/run.json`` there), so every machine that
trains it, each with its own local copy, is the same run.
"""

from __future__ import annotations

import errno
import json
import logging
import uuid
from pathlib import Path

from ortflow.checkpoints.folder import RUN_META_KEY, CheckpointError, CheckpointInfo, final_checkpoint, list_complete
from ortflow.config import RunConfig
from ortflow.config.sealed import RunFileDamaged, read_sealed, write_sealed

log = logging.getLogger("ortflow.checkpoints")

RUN_FILE = Path(".ortflow") / "run.json"


def _read_record(path: Path) -> dict | None:
    """The run record at ``path``; None when missing or damaged (logged). A record written before records were
    sealed (``run_id`` and ``name`` only) is read as it is."""
    try:
        return read_sealed(path, "it is rebuilt from the run's checkpoints")
    except RunFileDamaged as err:
        try:  # an unsealed record of an older ortflow
            old = json.loads(path.read_text())
            if isinstance(old, dict) and set(old) <= {"run_id", "name"} and isinstance(old.get("run_id"), str):
                return old
        except (OSError, ValueError):
            pass
        log.warning("%s", err)
        return None


def _id_from_checkpoints(cfg: RunConfig, folder: Path) -> str | None:
    """The run id the newest checkpoint written from this folder records (None when there is none)."""
    for info in reversed(list_complete(Path(cfg.checkpoints_dir))):
        theirs = info.meta.get(RUN_META_KEY)
        if isinstance(theirs, dict) and theirs.get("output_dir") == str(folder) and theirs.get("run_id"):
            return str(theirs["run_id"])
    return None


def _is_copy(record: dict, folder: Path) -> bool:
    """Whether the folder the record names still holds this run (so ``folder`` is a copy of it)."""
    named = record.get("folder")
    if not named or named == str(folder):
        return False
    original = _read_record(Path(named) / RUN_FILE)
    return original is not None and original.get("run_id") == record.get("run_id")


def _write(path: Path, record: dict) -> None:
    try:
        write_sealed(path, record)
    except OSError as err:
        reason = "the disk is full" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        raise CheckpointError(f"cannot write {path}: {reason}; free space or make the run folder writable, "
                              f"then train again") from None


def run_id_of(cfg: RunConfig, create: bool = True) -> str | None:
    """This run folder's id (see the module's docstring for copies, moves and damaged records)."""
    folder = Path(cfg.output_dir).resolve()
    path = folder / RUN_FILE
    record = _read_record(path)
    run_id = record.get("run_id") if record else None
    if record is not None and _is_copy(record, folder):
        log.warning("%s is a copy of the run in %s: it is a new run with its own id", folder, record["folder"])
        run_id = None
    elif record is None:
        run_id = _id_from_checkpoints(cfg, folder)
    needs_write = record is None or run_id != record.get("run_id") or record.get("folder") != str(folder)
    if create and (run_id is None or needs_write):
        run_id = run_id or uuid.uuid4().hex
        _write(path, {"run_id": run_id, "name": cfg.name, "folder": str(folder)})
    return run_id


def run_owner(cfg: RunConfig, create: bool = True) -> dict:
    """This run's identity as recorded in its checkpoints: id, name, folder and config fingerprint.

    Args:
        cfg: The run config (its ``output_dir`` holds the id).
        create: Give the folder an id when it has none, and record a move or copy (the process that trains it);
            False reads only.
    """
    if cfg.storage.remote_dir is not None:
        return {"run_id": _remote_run_id(cfg, create), "name": cfg.name, "output_dir": cfg.storage.remote_dir,
                "config_fingerprint": cfg.section_fingerprint()}
    return {"run_id": run_id_of(cfg, create), "name": cfg.name, "output_dir": str(Path(cfg.output_dir).resolve()),
            "config_fingerprint": cfg.section_fingerprint()}


def completed_run(cfg: RunConfig) -> CheckpointInfo | None:
    """This run's own final checkpoint when training has nothing left to do (:func:`.folder.final_checkpoint`), else
    None; a local run folder's checkpoints are checked against its identity (a copy's or another run's go to the
    ranks, which refuse them naming both runs)."""
    owner = None if cfg.storage.remote_dir else run_owner(cfg, create=False)
    return final_checkpoint(cfg.checkpoints_dir, cfg.train.num_weight_updates, owner)


def _remote_run_id(cfg: RunConfig, create: bool) -> str | None:
    from ortflow.storage import RemoteDir

    remote = RemoteDir.from_config(cfg.storage)
    try:
        return json.loads(remote.read_bytes(RUN_FILE.as_posix()))["run_id"]
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        pass  # a damaged id file: a new id, as for a local folder
    if not create:
        return None
    run_id = uuid.uuid4().hex
    remote.write_bytes(RUN_FILE.as_posix(), json.dumps({"run_id": run_id, "name": cfg.name}).encode())
    return run_id
