"""Build a folder of split artifacts (pipeline stages, tensor-parallel pieces) all or nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def building(artifacts_dir: Path, name: str) -> Iterator[Path]:
    """Yield a scratch folder inside ``artifacts_dir`` (also the current folder: the engine may write ``temp.onnx``
    there); on success it replaces ``artifacts_dir/name``, on any error it is removed and the old folder stays."""
    target = Path(artifacts_dir) / name
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=artifacts_dir))
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        yield scratch
        shutil.rmtree(target, ignore_errors=True)
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        os.chdir(cwd)
