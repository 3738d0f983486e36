"""One remote folder on an object store, reached through fsspec, every operation retried.

Object stores have no folders and no rename: a "folder" is a key prefix, and what makes a group of keys complete is a
marker written last (``meta.json`` of a checkpoint). Operations that fail for a reason that may pass (the server
restarts, the network drops) are retried with a doubling delay; errors that would repeat (missing key, access denied)
are raised at once. When the retries run out, :class:`StorageError` names the URL, the operation and the fix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ortflow.config.storage import REMOTE_SCHEMES, normalize_url, url_scheme

log = logging.getLogger("ortflow.storage")

T = TypeVar("T")
MAX_DELAY_S = 30.0
#: Errors that would repeat on a retry (what is missing stays missing, a refused credential stays refused).
#: botocore's errors for credentials that are missing or incomplete (named, not imported: botocore is optional).
NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


class StorageError(OSError):
    """An object-store operation that failed after every retry; the message names the URL and what to do."""


class StorageAccessDenied(StorageError, PermissionError):
    """The store refused this process's credentials for an operation (never retried: a refusal repeats)."""

    #: Read by the pipeline's retry policy: running the stage again meets the same refusal.
    will_repeat = True


#: Where each scheme's filesystem finds its credentials (docs/operations.md, Remote storage).
CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
               "gs": "GOOGLE_APPLICATION_CREDENTIALS", "az": "AZURE_STORAGE_CONNECTION_STRING (or "
               "AZURE_STORAGE_ACCOUNT_NAME + a key)"}


def filesystem(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url``'s scheme (s3fs, gcsfs, adlfs), built with ``options`` (storage_options), and
    ``url`` as that filesystem's path.

    Raises:
        StorageError: the scheme's package is not installed.
    """
    from fsspec.core import url_to_fs  # local: local runs never import the object-store stack

    try:
        # Listings are never cached: other processes (the ranks, another machine) write the same folder. Instances are
        # not shared either: one built before the environment's credentials or endpoint changed would keep the old.
        return url_to_fs(url, **{"use_listings_cache": False, "skip_instance_cache": True, **(options or {})})
    except ImportError:
        scheme = url_scheme(url)
        package = REMOTE_SCHEMES.get(scheme, scheme)
        raise StorageError(f"{url}: reading {scheme}:// needs the `{package}` package: pip install {package}") from None


class RemoteDir:
    """A folder on an object store: paths are relative to ``url``; every call is retried on transient errors.

    Args:
        url: The folder, ``s3://bucket/prefix``.
        options: fsspec storage_options of the filesystem.
        retries: Retries of a failed operation.
        retry_delay_s: Seconds before the first retry (doubling, at most 30 s).
        sleep: Waits between retries (passed in so tests need not wait).
    """

    def __init__(self, url: str, options: dict[str, Any] | None = None, retries: int = 6, retry_delay_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.url = normalize_url(url)
        self.fs, self._root = filesystem(self.url, options)
        self._root = self._root.rstrip("/")
        self.options, self.retries, self.retry_delay_s, self._sleep = options, retries, retry_delay_s, sleep

    @classmethod
    def from_config(cls, storage: Any, url: str | None = None) -> RemoteDir:
        """The remote run folder of a config's ``storage`` section (or ``url`` with its options)."""
        return cls(url or storage.remote_dir, storage.options, storage.retries, storage.retry_delay_s)

    def key(self, rel: str = "") -> str:
        """The store path of ``rel`` (for the filesystem's own calls)."""
        return f"{self._root}/{rel}".rstrip("/") if rel else self._root

    def child(self, rel: str) -> RemoteDir:
        """The remote folder ``rel`` below this one, on the same filesystem instance."""
        sub = object.__new__(RemoteDir)
        sub.__dict__.update(self.__dict__, url=f"{self.url}/{rel.strip('/')}", _root=self.key(rel.strip("/")))
        return sub

    def retry(self, what: str, call: Callable[[], T]) -> T:
        """``call()`` retried on transient errors; ``what`` names the operation in messages."""
        delay = self.retry_delay_s
        for attempt in range(self.retries + 1):
            try:
                return call()
            except PermissionError as err:
                credentials = CREDENTIALS.get(url_scheme(self.url), CREDENTIALS["az"])
                raise StorageAccessDenied(
                    f"{what} on {self.url} was refused ({type(err).__name__}: {err}): the store does not accept this "
                    f"process's credentials for that folder; check {credentials} and the bucket's access policy "
                    "(docs/operations.md, Remote storage), then run again"
                ) from err
            except PERMANENT:
                raise
            except Exception as err:  # noqa: BLE001 - botocore, aiohttp and fsspec raise unrelated types
                if type(err).__name__ in NO_CREDENTIALS:  # botocore's: none found anywhere; a retry finds none
                    credentials = CREDENTIALS.get(url_scheme(self.url), CREDENTIALS["az"])
                    raise StorageAccessDenied(
                        f"{what} on {self.url}: no credentials for the store ({err}); set {credentials}, or the "
                        "storage options (docs/operations.md, Remote storage), then run again"
                    ) from err
                if attempt == self.retries:
                    raise StorageError(
                        f"{what} on {self.url} failed after {self.retries + 1} attempts ({type(err).__name__}: {err}); "
                        "check that the object store is reachable (endpoint, network, credentials). The run folder "
                        "on the store keeps every complete checkpoint: run again to resume from the newest"
                    ) from err
                log.warning("%s on %s failed (%s: %s); retrying in %.1f s", what, self.url, type(err).__name__,
                            err, delay)
                self._sleep(delay)
                self.fs.invalidate_cache()
                delay = min(delay * 2, MAX_DELAY_S)
        raise AssertionError("not reached")

    # -- reading -----------------------------------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return self.retry(f"checking {rel}", lambda: self.fs.exists(self.key(rel)))

    def size(self, rel: str) -> int:
        return int(self.retry(f"reading the size of {rel}", lambda: self.fs.size(self.key(rel))))

    def files(self, rel: str = "") -> dict[str, dict]:
        """Every file below ``rel`` (recursively): path relative to ``rel`` -> fsspec info (size, ETag, ...)."""
        base = self.key(rel)

        def find() -> dict:
            return self.fs.find(base, detail=True) if self.fs.exists(base) else {}

        found = self.retry(f"listing {rel or '/'}", find)
        return {path[len(base):].lstrip("/"): info for path, info in found.items() if info.get("type") != "directory"}

    @property
    def bucket(self) -> str:
        """The bucket (container) this folder lives in."""
        return self._root.split("/", 1)[0]

    def check_bucket(self) -> None:
        """Read, never write: the bucket's metadata (S3 HeadBucket), else, when that is refused (a bucket policy that
        grants only a prefix refuses it), whether this folder's ``config.yaml`` exists.

        Raises:
            FileNotFoundError: the bucket does not exist.
            StorageAccessDenied: the store refuses this process's credentials.
            StorageError: the store cannot be reached (after this folder's retries).
        """
        try:
            self.retry(f"reading the bucket {self.bucket}", lambda: self.fs.info(self.bucket))
        except StorageAccessDenied:
            self.retry("checking config.yaml", lambda: self.fs.exists(self.key("config.yaml")))

    def glob(self, pattern: str) -> list[str]:
        """Paths relative to this folder that match ``pattern`` (fsspec glob)."""
        found = self.retry(f"listing {pattern}", lambda: self.fs.glob(self.key(pattern)))
        return sorted(path[len(self._root):].lstrip("/") for path in found)

    def read_bytes(self, rel: str) -> bytes:
        return self.retry(f"reading {rel}", lambda: self.fs.cat_file(self.key(rel)))

    def get(self, rel: str, local: Path) -> None:
        """Download ``rel`` to the local file ``local`` (its folder is created)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        self.retry(f"downloading {rel}", lambda: self.fs.get_file(self.key(rel), str(local)))

    # -- writing -----------------------------------------------------------------------------------------------------

    def put(self, local: Path, rel: str) -> None:
        """Upload the local file ``local`` to ``rel``."""
        self.retry(f"uploading {rel}", lambda: self.fs.put_file(str(local), self.key(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.retry(f"writing {rel}", lambda: self.fs.pipe_file(self.key(rel), data))

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` inside the store (no download)."""
        self.retry(f"copying {src} to {dst}", lambda: self.fs.copy(self.key(src), self.key(dst)))

    def remove(self, rel: str) -> None:
        """Delete the file ``rel``; a missing one is not an error."""
        def rm() -> None:
            try:
                self.fs.rm_file(self.key(rel))
            except FileNotFoundError:
                pass
        self.retry(f"deleting {rel}", rm)

    def remove_tree(self, rel: str) -> None:
        """Delete every key below ``rel``."""
        for name in self.files(rel):
            self.remove(f"{rel}/{name}")
