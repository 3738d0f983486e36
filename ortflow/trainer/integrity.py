"""Checksums of the training artifacts, recorded by configure and checked by rank 0 before the first step.

A resume trusts the artifacts as much as the checkpoints: a flipped bit in ``training_model.onnx`` (a constant, an
attribute) would train a different model without any error. ``configure.json`` records the sha256 of every artifact
file; rank 0 compares them at start, before any rank loads them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ortflow.trainer.artifacts import ARTIFACT_FILES

#: Key of the artifact checksums in configure.json.
DIGESTS_KEY = "artifact_sha256"


class ArtifactsDamaged(ValueError):
    """An artifact file differs from what configure built."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def artifact_digests(artifacts_dir: Path) -> dict[str, str]:
    """sha256 of each artifact file, by name (a pipeline's stage files by their path under ``stages/``, the
    tensor-parallel pieces' under ``tensor/``)."""
    folder = Path(artifacts_dir)
    parts = [*sorted(folder.glob("stages/stage-*")), *sorted(folder.glob("tensor/rank-*/piece-*"))]
    names = [*ARTIFACT_FILES, *(f"{part.relative_to(folder).as_posix()}/{name}" for part in parts
                                for name in ARTIFACT_FILES)]
    return {name: _sha256(folder / name) for name in names}


def verify_artifacts(artifacts_dir: Path, record: dict | None) -> None:
    """Check the artifact files against configure.json's checksums (a record without them is from an older ortflow).

    Raises:
        ArtifactsDamaged: naming the file and the fix.
    """
    recorded = (record or {}).get(DIGESTS_KEY)
    if not recorded:
        return
    for name, digest in recorded.items():
        path = Path(artifacts_dir) / name
        if not path.is_file():
            raise ArtifactsDamaged(f"{path} is missing; re-run `ortflow configure CONFIG`")
        if _sha256(path) != digest:
            raise ArtifactsDamaged(
                f"{path} does not match its sha256 in configure.json (altered or corrupted): delete configure.json "
                "and re-run `ortflow configure CONFIG` (the checkpoints stay valid for the same model)"
            )
