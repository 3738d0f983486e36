"""The exported model's checksum: a ``model.onnx.sha256`` sidecar written with it, checked before it is trusted.

Not every flipped bit makes an ONNX file unloadable: a bit in a weight loads fine and silently changes predictions.
So export writes the sha256 of the model next to it (``sha256sum`` format: ``<digest>  model.onnx``), the pipeline's
rerun compares it before it reuses an export, ``ortflow export --verify PATH`` checks it on demand, and ``ortflow
sample`` checks it before it loads the model.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from ortflow.export.verify import ExportError

log = logging.getLogger(__name__)

SUFFIX = ".sha256"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sidecar_path(model: Path) -> Path:
    """``model.onnx`` -> ``model.onnx.sha256``."""
    model = Path(model)
    return model.with_name(model.name + SUFFIX)


def write_sidecar(model: Path, digest: str) -> Path:
    """Write the sidecar of ``model`` (atomically; no temporary file is left on failure)."""
    path = sidecar_path(model)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(f"{digest}  {Path(model).name}\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def recorded_digest(model: Path) -> str | None:
    """The digest the sidecar records, or None when there is no readable sidecar."""
    try:
        text = sidecar_path(model).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0] if text and len(text[0]) == 64 else None


def verify_model(model: Path, required: bool = True) -> str | None:
    """Check an exported model against its sidecar.

    Args:
        model: The exported model.
        required: Refuse a model without a sidecar (else warn and go on: a model from elsewhere has none).

    Returns:
        The model's sha256 when it matches its sidecar, None when there is no sidecar (and it is not required).

    Raises:
        ExportError: the model is missing, differs from its recorded checksum, or (``required``) has none.
    """
    model = Path(model)
    if not model.is_file():
        raise ExportError(f"{model} does not exist or is not a file; export it first (ortflow export RUN_DIR)")
    recorded = recorded_digest(model)
    if recorded is None:
        if required:
            raise ExportError(f"{model} has no checksum ({sidecar_path(model).name} is missing or unreadable); "
                              "re-export it to get one")
        log.warning("%s has no checksum sidecar (%s): its integrity is not checked", model, sidecar_path(model).name)
        return None
    actual = sha256_file(model)
    if actual != recorded:
        raise ExportError(
            f"{model} does not match its checksum in {sidecar_path(model).name} (sha256 {actual[:16]}..., recorded "
            f"{recorded[:16]}...): the file is corrupted or was altered; re-export it (ortflow export RUN_DIR)"
        )
    return actual
