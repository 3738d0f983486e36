"""Model versions: each deployment or scheduled run trains a new version in its own folder under ``output_dir``.

Layout (``output_dir`` of the config)::

    registry.json                  every version: status, fingerprints, parent, losses, exported model
    latest -> versions/<name>      the newest completed version (a symlink, replaced atomically)
    versions/<name>/               one run folder per version (config.yaml, artifacts/, data/, checkpoints/,
                                   tensorboard/, progress.json, checkpoints.json, export/model.onnx)

Version names are ``YYYYmmddTHHMMSSZ-<flow run id prefix>``, so sorting by name sorts by start time. A retry of
the same flow run finds its entry by flow-run id and resumes the same folder. Writers of the registry hold the run
folder's lock (:mod:`ortflow.runlock`); readers never need it (the file is replaced atomically).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ortflow.config import ConfigError, RunConfig
from ortflow.config.atomic import write_text_atomic
from ortflow.version_configs import fingerprints, recorded_config, version_config

log = logging.getLogger(__name__)

REGISTRY_NAME = "registry.json"
VERSIONS_DIR = "versions"
LATEST = "latest"
#: The summary's row naming the exported model's local file when the run folder is on object storage (its "exported
#: model" row then names the URL); the registry keeps the local file under "exported model", the URL beside it.
EXPORTED_LOCAL_COPY = "exported model, local copy"

@dataclass(frozen=True)
class Plan:
    """What one pipeline run does: train in ``config.output_dir`` (a version folder or the run folder), or skip."""

    config: RunConfig
    version: str | None
    parent: str | None = None
    resumed: bool = False
    skipped_because: str | None = None


def registry_path(base: Path) -> Path:
    return Path(base) / REGISTRY_NAME


def read_registry(base: Path) -> list[dict]:
    """The registry's entries, oldest first (empty when there is none)."""
    try:
        data = json.loads(registry_path(base).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        raise ValueError(f"{registry_path(base)} cannot be read ({err}); restore it or move it aside") from None
    return list(data.get("versions", []))


def _write_registry(base: Path, entries: list[dict]) -> None:
    path = registry_path(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"format": 1, "versions": entries}, indent=1))


def _update(base: Path, name: str, **fields: object) -> dict:
    entries = read_registry(base)
    entry = next(e for e in entries if e["version"] == name)
    entry.update(fields)
    _write_registry(base, entries)
    return entry


def continue_problems(cfg: RunConfig, last: dict | None, prints: dict[str, str] | None = None) -> list[str]:
    """Why ``versions.policy continue`` cannot warm-start from version ``last`` (its registry entry): the model
    file or the ``model`` section changed (the checkpoint no longer fits), or the ``optimizer`` section changed (a
    continued version trains with its parent's recipe on new data; a new recipe is a retrain)."""
    if cfg.versions.policy != "continue" or last is None:
        return []
    prints = prints or fingerprints(cfg)
    before = last.get("fingerprints", {})
    changed = [what for what, key in (("the model file or the model section", "model"),
                                      ("the optimizer section", "optimizer"))
               if key in before and before[key] != prints[key]]
    if not changed:
        return []
    return [f"versions.policy continue: {' and '.join(changed)} changed since version {last['version']}, so it "
            "cannot be continued; use policy retrain for this run (or restore the earlier settings)"]


def last_completed(base: Path) -> dict | None:
    """The newest completed version's registry entry (None when there is none)."""
    done = [e for e in read_registry(base) if e.get("status") == "completed"]
    return done[-1] if done else None


def version_name(flow_run_id: str | None, now: float | None = None) -> str:
    """``20261123T031500Z-5f3e2a1b``: UTC start time first, so names sort by time; then the end of the flow run id
    (its start is a timestamp too)."""
    stamp = datetime.fromtimestamp(now if now is not None else time.time(), UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{(flow_run_id or uuid.uuid4().hex).replace('-', '')[-8:]}"


def _warm_start_checkpoint(parent: dict, continue_from: str) -> Path:
    key = "best_checkpoint" if continue_from == "best" else "final_checkpoint"
    path = parent.get(key) or parent.get("final_checkpoint")
    if not path or not Path(path).exists():
        raise ConfigError([
            f"versions.policy continue: version {parent['version']}'s {continue_from} checkpoint ({path}) is gone; "
            "use policy retrain, or restore the checkpoint"
        ])
    return Path(path)


def plan_run(
    cfg: RunConfig, flow_run_id: str | None, new_version: bool, now: float | None = None
) -> Plan:
    """Decide the folder a pipeline run trains in, registering a new version when asked to.

    Call with the run folder's lock held. A run whose flow-run id is already registered (a Prefect retry of the
    flow run) resumes its own version folder.

    Args:
        cfg: The run config (``output_dir`` is the base folder holding versions).
        flow_run_id: The Prefect flow run (None outside one).
        new_version: Train a new version (deployments) instead of training ``output_dir`` itself (``ortflow run``).
        now: Start time (seconds since the epoch) for the version name.

    Returns:
        The plan: the folder's config, its version and parent, or why the run is skipped.

    Raises:
        ConfigError: ``continue`` cannot warm-start (the model changed, or the parent's checkpoint is gone).
        DataError: a data glob matches nothing.
    """
    if not new_version:
        return Plan(cfg, None)
    base = cfg.output_dir
    entries = read_registry(base)
    mine = next((e for e in entries if flow_run_id and e.get("flow_run_id") == flow_run_id and e.get("path")), None)
    if mine is not None:
        init = mine.get("init_from")
        run_cfg = recorded_config(cfg, mine, Path(mine["path"]), Path(init) if init else None)
        _update(base, mine["version"], status="running", retried_at=time.time())
        log.info("flow run %s resumes its version %s", flow_run_id, mine["version"])
        return Plan(run_cfg, mine["version"], mine.get("parent"), resumed=True)
    policy = cfg.versions
    prints = fingerprints(cfg)
    done = [e for e in entries if e.get("status") == "completed"]
    last = done[-1] if done else None
    name = version_name(flow_run_id, now)
    entry = {"version": name, "flow_run_id": flow_run_id, "started": time.time(), "policy": policy.policy,
             "fingerprints": prints}
    same_policy = last is not None and last.get("policy") == policy.policy  # a policy change is never skipped
    if policy.skip_unchanged and same_policy and last.get("fingerprints") == prints:
        reason = f"config, model, data and policy unchanged since version {last['version']}"
        _write_registry(base, [*entries, {**entry, "status": "skipped", "reason": reason, "parent": last["version"]}])
        return Plan(cfg, name, last["version"], skipped_because=reason)
    parent, init_from = None, None
    if policy.policy == "continue" and last is not None:
        problems = continue_problems(cfg, last, prints)
        if problems:
            raise ConfigError(problems)
        parent, init_from = last["version"], _warm_start_checkpoint(last, policy.continue_from)
    elif policy.policy == "continue":
        log.info("versions.policy continue: no earlier successful version, training from %s", cfg.model.path)
    folder = base / VERSIONS_DIR / name
    run_cfg = version_config(cfg, folder, init_from)
    _write_registry(base, [*entries, {**entry, "status": "running", "path": str(folder), "parent": parent,
                                      "init_from": str(init_from) if init_from else None}])
    return Plan(run_cfg, name, parent)


def plan_rerun(cfg: RunConfig, flow_run_id: str | None, version: str | None = None,
               overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """Rerun stages of an existing version in its own folder (a versioned run with ``from_stage``): the one named,
    else the newest that has a folder, with the config it recorded
    (:func:`ortflow.version_configs.recorded_config`). No new version is registered.

    Call with the run folder's lock held.

    Raises:
        ConfigError: the named version does not exist (or was pruned), there is no version yet, or the rerun would
            change the version's config, model or data.
    """
    base = cfg.output_dir
    entries = [e for e in read_registry(base) if e.get("path") and e.get("status") in ("completed", "failed", "stopped")
               and Path(e["path"]).is_dir()]
    if version is not None:
        entry = next((e for e in entries if e["version"] == version), None)
        if entry is None:
            names = ", ".join(e["version"] for e in entries[-5:]) or "none"
            raise ConfigError([f"version {version}: no such version folder in {base} to rerun stages of (pruned, "
                               f"skipped or never trained); newest versions: {names}"])
    elif entries:
        entry = entries[-1]
    else:
        raise ConfigError([f"from_stage reruns stages of an existing version, and {base} has none yet: run without "
                           "from_stage first (it trains a new version)"])
    init = entry.get("init_from")
    run_cfg = recorded_config(cfg, entry, Path(entry["path"]), Path(init) if init else None, overrides)
    _update(base, entry["version"], status="running", rerun_by=flow_run_id, rerun_started=time.time())
    log.info("rerunning stages of version %s in %s with the config it recorded", entry["version"], entry["path"])
    return Plan(run_cfg, entry["version"], entry.get("parent"), resumed=True)


def finish_version(base: Path, name: str, status: str, summary: dict | None = None) -> dict:
    """Record a version's end: status, losses, checkpoints and exported model; ``latest`` follows completed ones."""
    from ortflow.checkpoints import list_complete

    fields: dict[str, object] = {"status": status, "finished": time.time()}
    entry = next(e for e in read_registry(base) if e["version"] == name)
    folder = Path(entry["path"])
    if summary is not None:
        fields.update({k: summary.get(k) for k in ("steps", "final train loss", "final eval loss", "best eval loss",
                                                     "exported model")})
        if summary.get(EXPORTED_LOCAL_COPY):  # a run folder on the store: the summary named the model's URL
            fields.update({"exported model": summary[EXPORTED_LOCAL_COPY],
                           "exported model url": summary["exported model"]})
    try:
        index = json.loads((folder / "checkpoints.json").read_text())
    except (OSError, ValueError):
        index = {}
    scored = [k for k in index.get("kept", []) if k.get("eval_loss") is not None]
    if scored:
        fields["best_checkpoint"] = min(scored, key=lambda k: k["eval_loss"])["path"]
    complete = list_complete(folder / "checkpoints")
    if complete:
        fields["final_checkpoint"] = str(complete[-1].path)
        if summary is None:  # a stopped or failed version: the steps its newest checkpoint holds
            fields["steps"] = f"{complete[-1].step}/{_total_steps(folder) or '?'}"
    entry = _update(base, name, **fields)
    newest = latest_version(base)  # a rerun of an older version's stages leaves `latest` where it was
    if status == "completed" and newest is not None:
        _point_latest(Path(base), Path(newest["path"]))
    return entry


def _total_steps(folder: Path) -> int | None:
    try:
        return json.loads((folder / "progress.json").read_text()).get("total")
    except (OSError, ValueError, AttributeError):
        return None


def _point_latest(base: Path, folder: Path) -> None:
    link = base / LATEST
    tmp = base / f".{LATEST}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder.relative_to(base))
        os.replace(tmp, link)
    except OSError as err:  # a filesystem without symlinks: the registry alone still answers `latest`
        log.warning("cannot point %s at %s (%s); `latest` is resolved from %s", link, folder, err, REGISTRY_NAME)


def latest_version(base: Path) -> dict | None:
    """The newest completed version's registry entry, or None."""
    done = [e for e in read_registry(base) if e.get("status") == "completed"]
    return done[-1] if done else None


def resolve_run(source: Path) -> Path:
    """A run folder from what a user typed: ``OUTPUT_DIR/latest`` (or ``latest`` inside OUTPUT_DIR) is the newest
    completed version; anything else is returned as is.

    Raises:
        ValueError: ``latest`` was asked for but no version has completed.
    """
    source = Path(source)
    if source.name != LATEST:
        return source
    base = source.parent
    entry = latest_version(base)
    if entry is not None:
        return Path(entry["path"])
    if (base / "checkpoints").is_dir():  # an unversioned run folder: `ortflow run CONFIG` trains it in place
        return base
    raise ValueError(
        f"{source}: no completed version in {base.resolve()} ({REGISTRY_NAME} lists none); train one first "
        "(a deployment run, or `ortflow run CONFIG --new-version`)"
    )


def resolve_model(source: Path) -> Path:
    """An exported model from what a user typed: ``OUTPUT_DIR/latest`` is the newest version's exported model."""
    source = Path(source)
    if source.name != LATEST:
        return source
    entry = latest_version(source.parent)
    if entry is not None and entry.get("exported model"):
        return Path(entry["exported model"])
    return resolve_run(source) / "export" / "model.onnx"


def describe(entry: dict, lock_held: bool) -> str:
    """The status to show: ``running`` entries whose folder nobody holds are ``interrupted``."""
    status = entry.get("status", "?")
    return "interrupted" if status == "running" and not lock_held else status


def versions_to_prune(entries: list[dict], keep: int, pinned: tuple[str, ...] = ()) -> list[str]:
    """The versions whose folders a retention of ``keep`` completed versions deletes (a pure function).

    Kept: the newest ``keep`` completed versions, the newest completed one (``latest``) in any case, pinned ones,
    every version that is still running, and any version a running one warm-starts from. Deleted: older completed
    versions, and failed or stopped ones older than the oldest of the newest ``keep`` completed ones. Skipped entries
    own no folder; pruned ones are gone already.

    Args:
        entries: The registry's entries, oldest first.
        keep: Completed versions to keep (at least 1).
        pinned: Version names never deleted.

    Returns:
        Version names to delete, oldest first.
    """
    completed = [e["version"] for e in entries if e.get("status") == "completed"]
    window = completed[-max(1, keep):]
    kept = set(window) | set(pinned) | {e.get("parent") for e in entries if e.get("status") == "running"}
    oldest_kept = window[0] if window else None
    doomed = []
    for e in entries:
        name, status = e["version"], e.get("status")
        if name in kept or not e.get("path") or status in ("running", "skipped", "pruned"):
            continue
        if status == "completed" or (oldest_kept is not None and name < oldest_kept):
            doomed.append(name)
    return doomed


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                continue
    return total


@dataclass(frozen=True)
class PruneResult:
    """What a prune deleted and what is left."""

    deleted: tuple[str, ...]
    freed_bytes: int
    kept: tuple[str, ...]
    remaining_bytes: int


def prune_versions(base: Path, keep: int, pinned: tuple[str, ...] = ()) -> PruneResult:
    """Delete the folders :func:`versions_to_prune` names and mark their entries ``pruned``.

    Call with the run folder's lock held (the registry is rewritten).
    """
    import shutil

    base = Path(base)
    entries = read_registry(base)
    doomed = versions_to_prune(entries, keep, pinned)
    freed = 0
    for name in doomed:
        entry = next(e for e in entries if e["version"] == name)
        folder = Path(entry["path"])
        size = folder_bytes(folder)
        shutil.rmtree(folder, ignore_errors=True)
        freed += size - folder_bytes(folder)
        entry.update({"status": "pruned", "pruned": time.time(), "pruned_status": entry.get("status"),
                      "exported model": None, "exported model url": None})  # deleted with the folder
        log.info("pruned version %s (%.1f MB)", name, size / 1e6)
    if doomed:
        _write_registry(base, entries)
    kept = tuple(e["version"] for e in entries if e.get("path") and e.get("status") != "pruned")
    remaining = folder_bytes(base / VERSIONS_DIR)
    return PruneResult(tuple(doomed), freed, kept, remaining)
