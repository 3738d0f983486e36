"""Which run a checkpoint belongs to: a run identity kept in the run folder and recorded in every checkpoint.

A run folder gets a random id the first time it is trained (``<run folder>/.ortflow/run.json``); copying or moving
the folder keeps it, so a moved run still resumes. Every checkpoint's ``meta.json`` records the id, the run's name,
its folder and its config fingerprint under ``run``. A resume from a checkpoint directory refuses a newest checkpoint
another run wrote (two runs pointed at one ``checkpoint.dir``), naming both runs, instead of continuing the other
run's weights. A checkpoint named on purpose (``checkpoint.checkpoint_to_load_path``) is the user's choice and is
not checked. A run folder on object storage keeps its id on the store (``.ortflow/run.json`` there), so every
machine that trains it, each with its own local copy, is the same run.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from ortflow.config import RunConfig

RUN_FILE = Path(".ortflow") / "run.json"


def run_owner(cfg: RunConfig, create: bool = True) -> dict:
    """This run's identity as recorded in its checkpoints: id, name, folder and config fingerprint.

    Args:
        cfg: The run config (its ``output_dir`` holds the id).
        create: Give the folder an id when it has none (the process that trains it); False reads only.
    """
    if cfg.storage.remote_dir is not None:
        return {"run_id": _remote_run_id(cfg, create), "name": cfg.name, "output_dir": cfg.storage.remote_dir,
                "config_fingerprint": cfg.section_fingerprint()}
    path = Path(cfg.output_dir) / RUN_FILE
    try:
        run_id = json.loads(path.read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        run_id = None
    if run_id is None and create:
        run_id = uuid.uuid4().hex
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"run_id": run_id, "name": cfg.name}))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return {"run_id": run_id, "name": cfg.name, "output_dir": str(Path(cfg.output_dir).resolve()),
            "config_fingerprint": cfg.section_fingerprint()}


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
