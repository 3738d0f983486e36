"""Remote run folders and sources: which URLs ortflow reads and writes, and the ``storage`` section.

``output_dir`` and the data sources (``data.train``, ``data.test``) may be URLs of an object store that fsspec reaches:
``s3://``, ``gs://``, ``az://`` (also spelled ``abfs://``). ``file://`` URLs are plain local paths. Any other
``scheme://`` is refused when the config is built, so a URL never silently becomes a local folder named ``s3:``.

A remote ``output_dir`` is the truth; ortflow works in a local copy of it (``storage.cache_dir``) and moves files
between the two at stage boundaries and at every checkpoint (docs/operations.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field

from ortflow.config.base import (  # noqa: F401 - the URL helpers are this module's public names too
    LOCAL_SCHEME,
    REMOTE_SCHEMES,
    Section,
    absolute_path,
    is_remote,
    local_path,
    url_problem,
    url_scheme,
)

#: Where the local copies of remote run folders live unless ``storage.cache_dir`` says otherwise.
CACHE_ENV = "ORTFLOW_CACHE_DIR"


def normalize_url(url: str) -> str:
    """A remote URL without trailing slashes, its scheme in lower case (``az`` and ``abfs`` kept as written)."""
    scheme = url_scheme(url)
    return f"{scheme}://{url[len(scheme) + 3:].strip('/')}"


def default_cache_root() -> Path:
    """``$ORTFLOW_CACHE_DIR``, else ``~/.cache/ortflow``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ortflow").expanduser()


def cache_folder(url: str, cache_root: Path | None) -> Path:
    """The local copy of the remote folder ``url``: ``<cache root>/runs/<scheme>/<bucket>/<path>``."""
    url = normalize_url(url)
    scheme = url_scheme(url)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    parts = [p for p in url[len(scheme) + 3:].split("/") if p not in ("", ".", "..")]
    return root.absolute() / "runs" / scheme / Path(*parts)


class StorageConfig(Section):
    """Object storage: the remote run folder (when ``output_dir`` is a URL) and how ortflow reaches it."""

    remote_dir: str | None = Field(
        None, description="The remote run folder (s3://, gs://, az://); set from output_dir when it is a URL, which "
        "then names the local copy. Leave unset: write the URL as output_dir."
    )
    cache_dir: Path | None = Field(
        None, description="Folder of the local copies of remote run folders (default: $ORTFLOW_CACHE_DIR, else "
        "~/.cache/ortflow); each rank and the launching process keep theirs here."
    )
    options: dict[str, Any] = Field(
        {}, description="fsspec storage_options of the store's filesystem (s3fs: endpoint_url, region_name, anon, "
        "client_kwargs, ...). Credentials belong in the environment (AWS_ACCESS_KEY_ID, "
        "GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_CONNECTION_STRING, ...), not in the config."
    )
    retries: int = Field(6, ge=0, le=100, description="Retries of a failed store operation before the stage stops "
                         "with an error (the run resumes from the newest complete checkpoint on the store).")
    retry_delay_s: float = Field(1.0, gt=0, description="Seconds before the first retry; each later one waits twice "
                                 "as long, at most 30 s.")


def remote_output_dir(data: object, base_dir: Path | None) -> object:
    """Raw config with a URL ``output_dir`` split into ``storage.remote_dir`` and the local copy's folder.

    Raises:
        ValueError: the URL's scheme is not one ortflow reads, or it names no bucket.
    """
    if not isinstance(data, dict) or url_scheme(data.get("output_dir")) is None:
        return data
    url = data["output_dir"]
    problem = url_problem(url, "output_dir", remote_ok=True)
    if problem:
        raise ValueError(problem)
    if not is_remote(url):
        return {**data, "output_dir": local_path(url)}
    storage = data.get("storage") or {}
    storage = dict(storage) if isinstance(storage, dict) else storage.model_dump()
    if storage.get("remote_dir") not in (None, normalize_url(url)):
        raise ValueError(f"storage.remote_dir {storage['remote_dir']} differs from output_dir {url}; remove "
                         "storage.remote_dir (output_dir names the remote run folder)")
    cache_root = storage.get("cache_dir")
    if cache_root is not None:
        cache_root = absolute_path(cache_root, base_dir)
    storage.update(remote_dir=normalize_url(url), cache_dir=cache_root)
    return {**data, "storage": storage, "output_dir": str(cache_folder(url, cache_root))}


def remote_problems(storage: StorageConfig, local_fields: dict[str, object]) -> list[str]:
    """Fields set to their own local folders that a remote run folder cannot hold (they would never reach the store).

    Args:
        storage: The storage section.
        local_fields: Field name -> value, for fields that default to a folder inside output_dir.
    """
    if storage.remote_dir is None:
        return []
    return [f"{name}: with a remote output_dir ({storage.remote_dir}) this folder lives inside it; remove {name}"
            for name, value in local_fields.items() if value is not None]
