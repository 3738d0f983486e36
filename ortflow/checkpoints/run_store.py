"""A run folder on object storage and its local copy (``output_dir`` of a config whose ``storage.remote_dir`` is set):
files move by the folder sync, checkpoints by their protocol (:mod:`.object_store`), and each pipeline stage gets what
it reads from the store before it runs and puts back what it wrote once it ends.

The launching process (the flow, or ``ortflow configure``/``prepare-data``/``retain``) brings the copy up to the store
when it starts, downloads the checkpoints a stage reads (the newest for training to resume from, all of them for
retention and export), and uploads what each stage wrote. The ranks upload their checkpoints themselves as each one
completes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ortflow.checkpoints.object_store import RemoteCheckpoints
from ortflow.config import RunConfig
from ortflow.storage import FolderSync, RemoteDir

log = logging.getLogger("ortflow.storage")


class RunStore:
    """A run folder on the store and its local copy (``cfg.output_dir``): files, and checkpoints by their protocol.

    Args:
        cfg: A config whose ``storage.remote_dir`` is set.
        token: Names the writer's temporary checkpoint prefixes (rank 0's pid; default this process's).
    """

    #: Top-level names the folder sync leaves alone: checkpoints move by their protocol, versions by their own runs.
    SKIP = ("checkpoints", "versions")

    def __init__(self, cfg: RunConfig, token: int | None = None):
        self.remote = RemoteDir.from_config(cfg.storage)
        self.local = Path(cfg.output_dir)
        self.checkpoints = RemoteCheckpoints(self.remote.child("checkpoints"), cfg.checkpoints_dir, token)
        self.files = FolderSync(self.remote, self.local, self.SKIP)

    def pull(self, checkpoints: str = "none") -> None:
        """Bring the local copy up to the store: every changed file, and ``checkpoints`` "none", "newest" or "all"."""
        self.local.mkdir(parents=True, exist_ok=True)
        self.files.pull()
        if checkpoints != "none":
            self.checkpoints.pull(newest_only=checkpoints == "newest")

    def push(self) -> None:
        """Upload every local file that changed (checkpoints are uploaded by the writer rank as they complete)."""
        self.files.push()

    def push_deletions(self) -> list[int]:
        """Delete the store's checkpoints that the local copy no longer holds (after the retention stage, which
        ran on a local copy holding all of them)."""
        from ortflow.checkpoints.folder import list_complete

        here = {info.step for info in list_complete(self.checkpoints.local)}
        gone = [step for step in self.checkpoints.steps() if step not in here]
        for step in gone:
            self.checkpoints.delete(step)
        return gone

    def remove_tree(self, rel: str) -> None:
        """Delete a folder of the run on the store (a pruned version)."""
        self.remote.remove_tree(rel)


#: Checkpoints a stage reads, so they are downloaded before it runs.
STAGE_CHECKPOINTS = {"train": "newest", "retain_checkpoints": "all", "export": "all"}


def is_remote_run(cfg: RunConfig) -> bool:
    return cfg.storage.remote_dir is not None


def store_url(cfg: RunConfig, path: Path | str) -> str | None:
    """The URL on the store of ``path``, a file of a remote run folder's local copy (None for a local run folder or a
    path outside the run folder, which never reaches the store)."""
    if not is_remote_run(cfg):
        return None
    try:
        rel = Path(path).absolute().relative_to(Path(cfg.output_dir).absolute())
    except ValueError:
        return None
    return f"{cfg.storage.remote_dir}/{rel.as_posix()}".rstrip("/.")


def pull(cfg: RunConfig, checkpoints: str = "none") -> None:
    """Bring the local copy of a remote run folder up to the store (no-op for a local run folder)."""
    if is_remote_run(cfg):
        RunStore(cfg).pull(checkpoints)


def push(cfg: RunConfig) -> None:
    """Upload what changed in the local copy (no-op for a local run folder)."""
    if is_remote_run(cfg):
        RunStore(cfg).push()


def push_log(cfg: RunConfig, log_file: Path) -> str | None:
    """Upload ``ortflow run``'s log file once the flow run ended (the stages uploaded it only up to the last one);
    returns why it could not be uploaded (None when it was, or when the run folder is local)."""
    if not is_remote_run(cfg):
        return None
    try:
        RunStore(cfg).files.push(only={Path(log_file).relative_to(cfg.output_dir).as_posix()})
    except (OSError, ValueError) as err:  # a store out of reach: the local copy keeps the log
        return str(err)
    return None


def remove_versions(cfg: RunConfig, names: list[str]) -> None:
    """Delete pruned versions' folders on the store."""
    if is_remote_run(cfg):
        store = RunStore(cfg)
        for name in names:
            store.remove_tree(f"versions/{name}")


def around_stage(stage: str, cfg: RunConfig, call: Any) -> Any:
    """``call`` (a stage task) wrapped so that the store is read before it and written after it."""
    if not is_remote_run(cfg):
        return call

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        store = RunStore(cfg)
        store.pull(STAGE_CHECKPOINTS.get(stage, "none"))
        result = call(*args, **kwargs)
        store.push()
        if stage == "retain_checkpoints":
            deleted = store.push_deletions()  # the stage ran on a copy holding every checkpoint
            if deleted:
                log.info("retention: deleted checkpoint steps %s on %s", deleted, cfg.storage.remote_dir)
        return result

    return run


# -- a command given a URL (ortflow evaluate, export, sample) ----------------------------------------------------------

#: fsspec storage_options (JSON) for reading a remote run folder's config before the config's own options are known.
OPTIONS_ENV = "ORTFLOW_STORAGE_OPTIONS"
_CHECKPOINT_URL = re.compile(r"^(?P<run>.+)/checkpoints/(?P<step>step-\d+)$")
_REGISTRY = "registry.json"
_LATEST = "latest"


def _env_options() -> dict:
    return json.loads(os.environ.get(OPTIONS_ENV) or "{}")


def _latest_version_url(base: str) -> str:
    """``OUTPUT_DIR/latest`` on the store: the newest completed version's folder (an unversioned run folder: itself).

    Raises:
        ValueError: no version has completed and the folder holds no checkpoint.
    """
    remote = RemoteDir(base, _env_options())
    try:
        entries = json.loads(remote.read_bytes(_REGISTRY)).get("versions", [])
    except FileNotFoundError:
        entries = []
    except ValueError as err:
        raise ValueError(f"{base}/{_REGISTRY} cannot be read ({err}); restore it on the store") from None
    done = [e for e in entries if e.get("status") == "completed"]
    if done:
        return f"{base}/versions/{done[-1]['version']}"
    if remote.glob("checkpoints/step-*/meta.json"):  # an unversioned run folder: `ortflow run CONFIG` trains it
        return base
    raise ValueError(f"{base}/{_LATEST}: no completed version on the store ({_REGISTRY} lists none); train one first "
                     "(a deployment run, or `ortflow run CONFIG --new-version`)")


def fetch_run(url: str) -> Path:
    """Bring the local copy of the remote run folder ``url`` up to the store, every complete checkpoint included (what
    ``ortflow evaluate`` and ``export`` read), and return it: the copy ``ortflow run`` keeps
    (``<storage.cache_dir>/runs/<scheme>/<bucket>/<path>``, the cache folder of the config on the store).

    ``url`` may also name a checkpoint folder of the run (``.../checkpoints/step-N``: its local copy is returned) or
    ``OUTPUT_DIR/latest`` (the newest completed version's folder). The store is reached with the environment's
    credentials and endpoint, and ``$ORTFLOW_STORAGE_OPTIONS`` (JSON) until the config's own ``storage.options`` are
    read.

    Raises:
        ConfigError: the folder holds no config.yaml (it is not a configured run folder), or the config is invalid.
        StorageError: the store cannot be reached after retries, or refuses the credentials.
    """
    import yaml

    from ortflow.config import RESOLVED_CONFIG_NAME, ConfigError, config_from_dict
    from ortflow.config.storage import cache_folder, normalize_url

    url = normalize_url(url)
    if url.endswith(f"/{_LATEST}"):
        return fetch_run(_latest_version_url(url[:-len(_LATEST) - 1]))
    checkpoint = _CHECKPOINT_URL.match(url)
    if checkpoint:
        return fetch_run(checkpoint["run"]) / "checkpoints" / checkpoint["step"]
    remote = RemoteDir(url, _env_options())
    try:
        raw = yaml.safe_load(remote.read_bytes(RESOLVED_CONFIG_NAME))
    except FileNotFoundError:
        raise ConfigError([f"{url}/{RESOLVED_CONFIG_NAME} does not exist: not a run folder configured on the store "
                           "(`ortflow run CONFIG` or `ortflow configure CONFIG` with output_dir set to the URL)"]
                          ) from None
    storage = dict(raw.get("storage") or {})
    local = cache_folder(url, storage.get("cache_dir"))
    storage.update(remote_dir=url, options={**(storage.get("options") or {}), **_env_options()})
    cfg = config_from_dict({**raw, "output_dir": str(local), "storage": storage}, base_dir=local,
                           source=f"{url}/{RESOLVED_CONFIG_NAME}")
    RunStore(cfg).pull("all")
    log.info("local copy of %s in %s", url, local)
    return local


def _run_cache_dir(folder: str) -> str | None:
    """``storage.cache_dir`` of the run folder that the store's ``folder`` belongs to (the folder itself, or the run
    folder above its ``export/``), or None: where :func:`fetch_run` keeps that run's local copy."""
    import yaml

    from ortflow.config import RESOLVED_CONFIG_NAME

    candidates = [folder, folder.rsplit("/", 1)[0]] if folder.endswith("/export") else [folder]
    for candidate in candidates:
        try:
            raw = yaml.safe_load(RemoteDir(candidate, _env_options()).read_bytes(RESOLVED_CONFIG_NAME))
        except FileNotFoundError:
            continue
        except yaml.YAMLError:
            return None  # not a config ortflow wrote: the default cache
        storage = raw.get("storage") if isinstance(raw, dict) else None
        return storage.get("cache_dir") if isinstance(storage, dict) else None
    return None


def fetch_file(url: str) -> Path:
    """Download the file ``url`` (an exported model on the store, with its ``.sha256`` sidecar when there is one)
    into its place in the local copies (``<cache>/runs/<scheme>/<bucket>/<path>``, under the ``storage.cache_dir`` of
    the run folder it belongs to, as :func:`fetch_run` keeps that run's copy) and return it. ``OUTPUT_DIR/latest`` is
    the newest completed version's exported model.

    Raises:
        FileNotFoundError: the store holds no such file.
        StorageError: the store cannot be reached after retries, or refuses the credentials.
    """
    from ortflow.config.storage import cache_folder, normalize_url

    url = normalize_url(url)
    if url.endswith(f"/{_LATEST}"):
        url = f"{_latest_version_url(url[:-len(_LATEST) - 1])}/export/model.onnx"
    folder, name = url.rsplit("/", 1)
    remote = RemoteDir(folder, _env_options())
    local = cache_folder(url, _run_cache_dir(folder))
    if not remote.exists(name):
        raise FileNotFoundError(f"{url} does not exist on the store; export a model first (ortflow run CONFIG or "
                                "ortflow export)")
    for each in (name, f"{name}.sha256"):
        if each == name or remote.exists(each):
            tmp = local.with_name(f".{each}.{os.getpid()}.part")
            remote.get(each, tmp)
            os.replace(tmp, local.with_name(each))
    return local
