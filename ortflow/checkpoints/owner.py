"""Which run a checkpoint belongs to: a run identity kept in the run folder and recorded in every checkpoint.

A run folder gets a random id the first time it is trained (``<run folder>/.ortflow/run.json``); copying or moving
the folder keeps it, so a moved run still resumes. Every checkpoint's ``meta.json`` records the id, the run's name,
its folder and its config fingerprint under ``run``. A resume from a checkpoint directory refuses a newest checkpoint
another run wrote (two runs pointed at one ``checkpoint.dir``), naming both runs, instead of continuing the other
run's weights. A checkpoint named on purpose (``checkpoint.checkpoint_to_load_path``) is the user's choice and is
not checked.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from ortflow.checkpoints.folder import CheckpointError, CheckpointInfo
from ortflow.config import RunConfig

RUN_FILE = Path(".ortflow") / "run.json"
META_KEY = "run"


def run_owner(cfg: RunConfig, create: bool = True) -> dict:
    """This run's identity as recorded in its checkpoints: id, name, folder and config fingerprint.

    Args:
        cfg: The run config (its ``output_dir`` holds the id).
        create: Give the folder an id when it has none (the process that trains it); False reads only.
    """
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


def _describe(owner: dict) -> str:
    fingerprint, run_id = str(owner.get("config_fingerprint"))[:12], str(owner.get("run_id"))[:8]
    return f"run '{owner.get('name')}' (folder {owner.get('output_dir')}, config {fingerprint}, id {run_id})"


def check_owner(info: CheckpointInfo, owner: dict) -> None:
    """Refuse to resume this run from a checkpoint another run wrote.

    Raises:
        CheckpointError: naming both runs and the fix.
    """
    theirs = info.meta.get(META_KEY)
    if not isinstance(theirs, dict) or not theirs.get("run_id") or not owner.get("run_id"):
        return  # written before checkpoints recorded their run: nothing to compare
    if theirs["run_id"] == owner["run_id"]:
        return
    raise CheckpointError(
        f"{info.path} belongs to {_describe(theirs)}, not to this {_describe(owner)}: two runs share the checkpoint "
        f"folder {info.path.parent}, and resuming would continue the other run's weights. Give each run its own "
        f"checkpoint.dir (or remove it to use <output_dir>/checkpoints); to start from that checkpoint on purpose, "
        f"set checkpoint.init_from to it"
    )
