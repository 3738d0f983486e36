"""Running stages of an existing model version again (``from_stage`` on a versioned run, a Prefect retry of the flow
run that trained it): the version keeps what it was trained with.

A version's folder records its config (``config.yaml``), its data (the shards' ``manifest.json``) and its model
(``configure.json``); the registry records the fingerprints of its config sections, model file and data sources.
A rerun takes the version's recorded training sections (:data:`ortflow.versions.TRAINING_SECTIONS`) instead of the
current config's, keeps this run's other settings (retries, time limits, checkpoint period), and is refused when
it would change what the version was trained with: overrides of a training section, a model file or data sources
that changed on disk since (a stage would rebuild the artifacts or re-shard the data from them).
"""

from __future__ import annotations

from pathlib import Path

from ortflow.config import ConfigError, RunConfig, apply_overrides, config_from_dict, load_run_config


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
    from ortflow.versions import TRAINING_SECTIONS, fingerprints, version_config

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
