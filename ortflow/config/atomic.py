"""Writing a small file atomically: a temporary file beside it, renamed into place; on any error (a full disk, a
read-only folder) the temporary file is removed, so a failed write leaves the old file and nothing else."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path | str, text: str, fsync: bool = False) -> Path:
    """Replace ``path`` with ``text`` atomically (``fsync``: flushed to the disk before the rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
