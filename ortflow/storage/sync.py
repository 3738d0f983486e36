"""Keeping a local copy of a remote run folder: upload what changed here, download what changed there.

The store is the truth; the local copy is a working folder. A record of what each side held when the two last
agreed (``.ortflow/storage.json`` in the local copy: size and modification time here, ETag there) lets a sync move
only the files that changed. Hidden names (``.ortflow/`` locks and cache tokens, ``.ranks/`` heartbeats, temporary
files) and symbolic links stay local; checkpoints move by their own protocol (:mod:`ortflow.checkpoints.object_store`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

from ortflow.storage.remote_dir import RemoteDir

log = logging.getLogger("ortflow.storage")

RECORD = Path(".ortflow") / "storage.json"


def _local_files(local: Path, skip: Collection[str]) -> dict[str, os.stat_result]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(local):
        rel_dir = Path(dirpath).relative_to(local)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (rel_dir == Path(".") and d in skip)
                       and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            path = Path(dirpath) / name
            if name.startswith(".") or path.is_symlink() or (rel_dir == Path(".") and name in skip):
                continue
            found[(rel_dir / name).as_posix()] = path.stat()
    return found


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or (info.get("size"), info.get("mtime")))


class FolderSync:
    """Sync between the local folder ``local`` and the remote folder ``remote``, skipping top-level names ``skip``."""

    def __init__(self, remote: RemoteDir, local: Path, skip: Collection[str] = ()):
        self.remote, self.local, self.skip = remote, Path(local), set(skip)

    def _read_record(self) -> dict[str, dict]:
        try:
            return json.loads((self.local / RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def _write_record(self, record: dict[str, dict]) -> None:
        path = self.local / RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=0, sort_keys=True))
        os.replace(tmp, path)

    def push(self, only: Collection[str] | None = None) -> list[str]:
        """Upload every local file that changed since the last sync (or only those of the relative paths ``only``);
        returns their relative paths."""
        record = self._read_record()
        sent = []
        for rel, st in sorted(_local_files(self.local, self.skip).items()):
            if only is not None and rel not in only:
                continue
            known = record.get(rel, {})
            if known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns:
                continue
            self.remote.put(self.local / rel, rel)
            info = self.remote.retry(f"reading {rel}", lambda rel=rel: self.remote.fs.info(self.remote.key(rel)))
            record[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": _etag(info)}
            sent.append(rel)
        self._write_record(record)
        if sent:
            log.info("uploaded %d file(s) to %s", len(sent), self.remote.url)
        return sent

    def pull(self) -> list[str]:
        """Download every remote file that changed on the store since the last sync (or is missing here); returns
        their paths. A file that changed only here (a log still being written) is left for :meth:`push`."""
        record = self._read_record()
        here = _local_files(self.local, self.skip)
        got = []
        for rel, info in sorted(self.remote.files().items()):
            top = rel.split("/", 1)[0]
            if top in self.skip or any(part.startswith(".") for part in rel.split("/")):
                continue
            if rel in here and record.get(rel, {}).get("etag") == _etag(info):
                continue  # the store still holds what was last synced: a change made here is the next push's
            target = self.local / rel
            tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
            self.remote.get(rel, tmp)
            os.replace(tmp, target)
            st = target.stat()
            record[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": _etag(info)}
            got.append(rel)
        self._write_record(record)
        if got:
            log.info("downloaded %d file(s) from %s", len(got), self.remote.url)
        return got
