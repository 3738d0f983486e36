"""Cache keys of the pipeline's stages: the stage's config sections, the fingerprints of its input files, and
whether its outputs are still on disk and verify against their checksums.

A key built only from inputs replays a stale result once the outputs are deleted; a key that hashes the outputs
themselves never matches (the key is computed before the stage writes them). So each stage keeps a *generation*
token in ``<output_dir>/.ortflow/cache/<stage>``: the token is part of the key, and it is replaced whenever the
stage's outputs are missing or incomplete. While the outputs stay intact the key stays the same and Prefect returns
the persisted result; once they are gone, or one of them no longer matches its recorded sha256 (artifacts against
configure.json, shards against the manifest, checkpoints against their meta.json, the exported model against its
sidecar), the key changes and the stage runs again. ``invalidate`` replaces tokens on
purpose (``ortflow run --from STAGE``).

The key also names the run folder (its store URL for a remote one): a stage's result holds paths inside the folder it
ran in, so a copy of a run folder (tokens included) runs its stages itself instead of replaying the original's
results, which point at the original's checkpoints and exported model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from ortflow.artifacts_folder import ARTIFACT_FILES, verify_artifacts
from ortflow.checkpoints import list_complete, verify
from ortflow.config import RunConfig
from ortflow.config.atomic import write_text_atomic

log = logging.getLogger(__name__)

#: The stages in pipeline order; ``--from STAGE`` reruns the named one and every later one.
STAGES: tuple[str, ...] = ("configure", "prepare_data", "train", "retain", "export")

CACHE_DIR = ".ortflow/cache"


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _manifest_fingerprint(cfg: RunConfig) -> str | None:
    try:
        return json.loads((cfg.data_dir / "manifest.json").read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def _final_checkpoint(cfg: RunConfig) -> dict | None:
    """Step and checkpoint hash of the newest complete checkpoint (the train stage's result)."""
    done = list_complete(cfg.checkpoints_dir)
    if not done:
        return None
    newest = done[-1]
    return {"step": newest.step, "files": newest.meta.get("files")}


def _index(cfg: RunConfig) -> dict | None:
    try:
        return json.loads((cfg.output_dir / "checkpoints.json").read_text())
    except (OSError, ValueError):
        return None


# --- what each stage's key is made of ----------------------------------------------------------------------------


def _configure_record(run_dir: Path) -> dict | None:
    """configure.json of a run folder (None when missing or damaged). The configure package (onnx, the engine, the
    graph passes) is imported here, when a stage's key is first computed, not with the flows: a flow run that is
    skipped, or only exports, and ``ortflow serve`` start without it."""
    from ortflow.configure.configure import read_configure_record as read

    return read(run_dir)


def _configure_inputs(cfg: RunConfig) -> dict:
    # configure.fingerprint covers the model file (and its external data), the model section and the layout and
    # precision settings the artifacts depend on. A folder configured since for another config (`ortflow configure`
    # by hand between two flow runs) holds artifacts that are not this config's: its record's fingerprint enters the
    # key, so the stage runs and builds them again instead of replaying its result (once it has, the key is the one
    # that result was stored under).
    from ortflow.configure.configure import fingerprint

    key = fingerprint(cfg)
    built_for = (_configure_record(cfg.output_dir) or {}).get("fingerprint", key)
    return {"fingerprint": key} if built_for == key else {"fingerprint": key, "folder_built_for": built_for}


def _prepare_inputs(cfg: RunConfig) -> dict:
    from ortflow.dataprep.sources import fingerprint_entry, resolve_sources
    from ortflow.dataprep.tokenizer import tokenizer_digest

    data = cfg.data
    train = resolve_sources(data.train, data.format, "data.train", cfg.storage.options)
    test = resolve_sources(data.test, data.format, "data.test", cfg.storage.options) if data.test else []
    record = _configure_record(cfg.output_dir) or {}
    return {
        "data": cfg.model_dump(mode="json", include={"data"}),
        "seed": cfg.train.seed,
        "model_inputs": record.get("fingerprint"),
        "sources": [fingerprint_entry(s) for s in [*train, *test]],
        "tokenizer": tokenizer_digest(data.text.tokenizer),  # a tokenizer file rewritten in place makes other ids
    }


def _train_inputs(cfg: RunConfig) -> dict:
    sections = ("model", "optimizer", "lr_schedule", "train", "precision", "distributed", "checkpoint")
    return {
        "sections": cfg.section_fingerprint(*sections),
        "artifacts": (_configure_record(cfg.output_dir) or {}).get("fingerprint"),
        "data": _manifest_fingerprint(cfg),
    }


def _retain_inputs(cfg: RunConfig) -> dict:
    # The final checkpoint identifies the training result; retention never deletes it.
    return {"checkpoint": cfg.model_dump(mode="json", include={"checkpoint"}), "final": _final_checkpoint(cfg)}


def _export_inputs(cfg: RunConfig) -> dict:
    index = _index(cfg) or {}
    source = next((k for k in index.get("kept", []) if k.get("step") == index.get("export_step")), None)
    return {"export": cfg.model_dump(mode="json", include={"export"}), "source": source}


# --- whether each stage's outputs are intact --------------------------------------------------------------------


def _configure_done(cfg: RunConfig) -> bool:
    record = _configure_record(cfg.output_dir)
    if record is None or not all((cfg.artifacts_dir / name).exists() for name in ARTIFACT_FILES):
        return False
    return _trusted(lambda: verify_artifacts(cfg.artifacts_dir, record))


def _prepare_done(cfg: RunConfig) -> bool:
    from ortflow.dataprep import verify_data
    from ortflow.dataprep.manifest import MANIFEST_NAME

    if not (cfg.data_dir / MANIFEST_NAME).exists():  # never prepared (a new version): nothing to distrust
        return False
    return _trusted(lambda: verify_data(cfg.data_dir))  # every shard's size and sha256 against the manifest


def _train_done(cfg: RunConfig) -> bool:
    final = _final_checkpoint(cfg)
    if final is None or final["step"] < cfg.train.num_weight_updates:
        return False
    return _trusted(lambda: verify(list_complete(cfg.checkpoints_dir)[-1].path))


def _retain_done(cfg: RunConfig) -> bool:
    index = _index(cfg)
    if index is None or not all(Path(k["path"]).exists() for k in index.get("kept", [])):
        return False
    return all(_trusted(lambda path=k["path"]: verify(Path(path))) for k in index.get("kept", []))


def _export_done(cfg: RunConfig) -> bool:
    from ortflow.export.checksum import verify_model

    return cfg.export_path.exists() and _trusted(lambda: verify_model(cfg.export_path))


def _trusted(check: Callable[[], object]) -> bool:
    """Whether a verification passes; a stage whose outputs fail theirs runs again (the failure is logged)."""
    try:
        check()
    except (ValueError, OSError) as err:  # DataError, CheckpointError, ArtifactsDamaged, ExportError
        log.warning("cached output not trusted, the stage runs again: %s", err)
        return False
    return True


_STAGE_PARTS: dict[str, tuple[Callable[[RunConfig], dict], Callable[[RunConfig], bool]]] = {
    "configure": (_configure_inputs, _configure_done),
    "prepare_data": (_prepare_inputs, _prepare_done),
    "train": (_train_inputs, _train_done),
    "retain": (_retain_inputs, _retain_done),
    "export": (_export_inputs, _export_done),
}


def _token_path(cfg: RunConfig, stage: str) -> Path:
    return cfg.output_dir / CACHE_DIR / stage


def _write_token(path: Path) -> str:
    token = uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, token)
    return token


def generation(cfg: RunConfig, stage: str, outputs_intact: bool) -> str:
    """The stage's generation token; a new one when its outputs are not intact (so the old key no longer matches)."""
    path = _token_path(cfg, stage)
    if outputs_intact:
        try:
            return path.read_text().strip()
        except OSError:
            pass
    return _write_token(path)


def outputs_intact(cfg: RunConfig, stage: str) -> bool:
    """Whether the stage's outputs are on disk and complete."""
    return _STAGE_PARTS[stage][1](cfg)


def _folder(cfg: RunConfig) -> str:
    """The run folder a stage's result belongs to: the store URL of a remote one (every machine's local copy is the
    same run), else the local folder's absolute path."""
    return cfg.storage.remote_dir or str(Path(cfg.output_dir).resolve())


def stage_key(cfg: RunConfig, stage: str) -> str:
    """The cache key of ``stage`` for this config and the current state of the run folder.

    Args:
        cfg: The run config.
        stage: One of :data:`STAGES`.

    Returns:
        A hex digest of the run folder, the stage's config sections, its input fingerprints and its generation token.
    """
    inputs, done = _STAGE_PARTS[stage]
    return _hash({"stage": stage, "folder": _folder(cfg), "inputs": inputs(cfg),
                  "generation": generation(cfg, stage, done(cfg))})


def invalidate(cfg: RunConfig, from_stage: str) -> list[str]:
    """Make ``from_stage`` and every later stage run again on the next pipeline run (new generation tokens).

    Args:
        cfg: The run config.
        from_stage: One of :data:`STAGES`.

    Returns:
        The stages invalidated, in order.

    Raises:
        ValueError: ``from_stage`` is not a stage name.
    """
    if from_stage not in STAGES:
        raise ValueError(f"unknown stage '{from_stage}'; use one of {', '.join(STAGES)}")
    stages = list(STAGES[STAGES.index(from_stage):])
    for stage in stages:
        _write_token(_token_path(cfg, stage))
    return stages


@dataclass
class StageCache(CachePolicy):
    """Prefect cache policy of one pipeline stage; the task's ``config`` argument supplies the run folder.

    Tasks without a ``config`` argument (or whose key cannot be computed, e.g. a missing model file) get no key,
    so they run and report the real error.
    """

    stage: str = ""

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        cfg = inputs.get("config")
        if not isinstance(cfg, RunConfig):
            return None
        return stage_key(cfg, self.stage)
