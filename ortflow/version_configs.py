"""The config a model version trains with: the fingerprints of what it trains (config sections, model file, data
sources), the config of its folder, and the config a rerun of it runs with.

A rerun of an existing version (``from_stage`` on a versioned run, a Prefect retry of the flow run that trained it)
keeps what the version was trained with. A version's folder records its config (``config.yaml``), its data (the
shards' ``manifest.json``) and its model (``configure.json``); the registry records the fingerprints of its config
sections, model file and data sources. A rerun takes the version's recorded training sections
(:data:`TRAINING_SECTIONS`) instead of the current config's, keeps this run's other settings (retries, time limits,
checkpoint period), and is refused when it would change what the version was trained with: overrides of a training
section, a model file or data sources that changed on disk since (a stage would rebuild the artifacts or re-shard
the data from them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ortflow.config import ConfigError, RunConfig, apply_overrides, config_from_dict, load_run_config

#: Sections whose values decide what a version trains (a change means "not unchanged" for skip_unchanged).
TRAINING_SECTIONS = ("model", "data", "train", "optimizer", "lr_schedule", "precision", "distributed", "export")


def fingerprints(cfg: RunConfig) -> dict[str, str]:
    """Cheap identities of what a version trains: config sections, model file (+ optimizer), data sources.

    Raises:
        DataError: a data glob matches nothing (never train on an empty source).
    """
    from ortflow.configure.configure import fingerprint as model_fingerprint
    from ortflow.dataprep.sources import fingerprint_entry, resolve_sources

    data = cfg.data
    sources = resolve_sources(data.train, data.format, "data.train", cfg.storage.options)
    sources += resolve_sources(data.test, data.format, "data.test", cfg.storage.options) if data.test else []
    digest = hashlib.sha256(json.dumps([fingerprint_entry(s) for s in sources], sort_keys=True).encode())
    return {
        "config": cfg.section_fingerprint(*TRAINING_SECTIONS),
        "model": model_fingerprint(cfg),
        "optimizer": cfg.section_fingerprint("optimizer"),
        "data": digest.hexdigest(),
    }


def version_config(cfg: RunConfig, folder: Path, init_from: Path | None) -> RunConfig:
    """The config of a version folder: every output inside it, warm-started from ``init_from`` when given.

    Raises:
        ConfigError: ``export.path`` is set (every version exports into its own folder; one path would be overwritten
            by each version).
    """
    if cfg.export.path is not None:
        raise ConfigError([
            f"export.path {cfg.export.path}: a versioned run exports into its version folder "
            f"(versions/<version>/export/model.onnx, and {cfg.output_dir / 'latest'}/export/model.onnx is the newest); "
            "remove export.path from the config or the run's overrides, or copy the newest model elsewhere with "
            "`ortflow export OUTPUT_DIR/latest -o PATH`"
        ])
    raw = cfg.model_dump(mode="json")
    raw["output_dir"] = str(folder)
    if cfg.storage.remote_dir is not None:  # the version's folder on the store mirrors its local copy
        raw["storage"]["remote_dir"] = f"{cfg.storage.remote_dir}/{Path(folder).relative_to(cfg.output_dir).as_posix()}"
    raw["checkpoint"].update(dir=None, checkpoint_to_load_path=None, init_from=str(init_from) if init_from else None)
    raw["tensorboard"]["log_dir"] = None
    raw["export"]["path"] = None
    return config_from_dict(raw, source=f"version {folder.name}")


def recorded_config(cfg: RunConfig, entry: dict, folder: Path, init_from: Path | None,
                    overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config a rerun of version ``entry`` runs with: its recorded training sections, this run's other settings.

    Args:
        cfg: This run's config (the deployment's or the command's, with this run's overrides applied).
        entry: The version's registry entry.
        folder: The version's folder.
        init_from: The checkpoint the version warm-started from, if any.
        overrides: This run's ``--set`` overrides, refused when they change a training section.

    Raises:
        ConfigError: the rerun would change the version's config, model or data.
    """
    name = entry["version"]
    base = version_config(cfg, folder, init_from)
    try:
        recorded = load_run_config(folder).model_dump(mode="json")
    except ConfigError:  # the version stopped before its config was written: the registry's fingerprints decide
        recorded = None
    if recorded is not None:
        raw = base.model_dump(mode="json")
        raw.update({section: recorded[section] for section in TRAINING_SECTIONS})
        base = config_from_dict(raw, source=f"version {name}")
    run = apply_overrides(base, list(overrides)) if overrides else base
    changed = []
    if run.section_fingerprint(*TRAINING_SECTIONS) != base.section_fingerprint(*TRAINING_SECTIONS):
        changed.append("this run's overrides change its training settings")
    before, now = entry.get("fingerprints", {}), fingerprints(run)
    for key, what in (("config", "its config differs from the one it was trained with (it recorded no config.yaml)"),
                      ("model", "the model file (or its external data) changed on disk"),
                      ("data", "the data sources changed on disk")):
        if recorded is not None and key == "config":
            continue
        if key in before and before[key] != now[key]:
            changed.append(what)
    if changed:
        raise ConfigError([
            f"version {name}: {'; '.join(changed)}. A rerun of a version's stages (from_stage, a flow-run retry) "
            "uses the config, data and model the version was trained with and never changes them: restore them, or "
            "train a new version (a run without from_stage)"
        ])
    return run
