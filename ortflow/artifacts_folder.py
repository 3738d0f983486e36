"""The artifacts folder as ranks read it: where each part lives, its records, and the files' checksums.

Configure (:mod:`ortflow.configure`) writes the folder; every rank reads it through this module alone, which imports
nothing from ortflow, so the rank runtime never loads the graph passes or the artifact builders.

Checksums: a resume trusts the artifacts as much as the checkpoints: a flipped bit in ``training_model.onnx``
(a constant, an attribute) would train a different model without any error. ``configure.json`` records the sha256
of every artifact file and is sealed (its own ``record_sha256``, :mod:`ortflow.config.sealed`); rank 0, export and
evaluate read it with :func:`ortflow.config.sealed.read_configure` and compare the files before anything loads
them. A missing or damaged ``configure.json`` stops them: it never disables the checks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: The engine's artifacts of one model (the whole model, a pipeline stage or a tensor-parallel piece).
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "checkpoint")
#: A CUDA whole model's training graph cut for CUDA graph capture (ortflow/graph/capture.py): the part the CUDA
#: provider records and replays, and (when some nodes cannot be recorded) the part run after it as usual.
CAPTURE_HEAD = "training_head.onnx"
CAPTURE_TAIL = "training_tail.onnx"
#: The fp16 loss scale: a scalar graph input the loss block multiplies the loss by (configure adds it, ranks feed it).
LOSS_SCALE_INPUT = "loss_scale"

#: Pipeline stages: ``stages/stage-SS/`` and ``stages/stages.json``.
STAGES_DIR = "stages"
STAGES_RECORD = "stages.json"
#: A split part's inputs that carry the gradients of what it sends, and its outputs that carry its inputs' gradients.
GRAD_IN_SUFFIX = ".grad_in"
BACKPROP_SUFFIX = ".backprop"
#: A middle stage's eval-model input: true normalises BatchNorm by the batch (its training forward), false by the
#: running statistics (evaluation): ortflow/graph/pipeline_parallel/batchnorm_forward.py.
BATCH_STATISTICS_INPUT = "ortflow.batch_statistics"
#: Tensor-parallel pieces: ``tensor/rank-RR/piece-PP/`` and ``tensor/tensor.json``.
TENSOR_DIR = "tensor"
TENSOR_RECORD = "tensor.json"
#: Pipeline x tensor parallelism: ``pipetensor/stage-SS/tensor/rank-RR/piece-PP/`` and ``pipetensor/pipetensor.json``.
PIPE_TENSOR_DIR = "pipetensor"
PIPE_TENSOR_RECORD = "pipetensor.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_dir(artifacts_dir: Path, index: int) -> Path:
    """The artifact folder of stage ``index``."""
    return Path(artifacts_dir) / STAGES_DIR / f"stage-{index:02d}"


def read_stages_record(artifacts_dir: Path) -> dict | None:
    """``stages.json`` of a run's artifacts, or None when the stages are not built."""
    return _read_json(Path(artifacts_dir) / STAGES_DIR / STAGES_RECORD)


def piece_dir(artifacts_dir: Path, rank: int, piece: int) -> Path:
    """The artifact folder of piece ``piece`` of tensor-parallel rank ``rank``."""
    return Path(artifacts_dir) / TENSOR_DIR / f"rank-{rank:02d}" / f"piece-{piece:02d}"


def read_tensor_record(artifacts_dir: Path) -> dict | None:
    """``tensor.json`` of a run's artifacts, or None when the pieces are not built."""
    return _read_json(Path(artifacts_dir) / TENSOR_DIR / TENSOR_RECORD)


def stage_base(artifacts_dir: Path, stage: int) -> Path:
    """The folder whose ``tensor/rank-RR/piece-PP`` hold stage ``stage``'s pieces (:func:`piece_dir`)."""
    return Path(artifacts_dir) / PIPE_TENSOR_DIR / f"stage-{stage:02d}"


def read_pipe_tensor_record(artifacts_dir: Path) -> dict | None:
    """``pipetensor.json`` of a run's artifacts, or None when they are not built."""
    return _read_json(Path(artifacts_dir) / PIPE_TENSOR_DIR / PIPE_TENSOR_RECORD)


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
    # A checkpoint past the engine's flatbuffer limit keeps its tensors in checkpoint.data beside it.
    names += [f"{name}.data" for name in names if name.endswith("checkpoint") and (folder / f"{name}.data").exists()]
    names += [name for name in (CAPTURE_HEAD, CAPTURE_TAIL) if (folder / name).exists()]
    return {name: _sha256(folder / name) for name in names}


_FIX = ("run `ortflow configure CONFIG` again: it rebuilds what is damaged or missing (the checkpoints stay valid for "
        "the same model)")


def verify_artifacts(artifacts_dir: Path, record: dict) -> None:
    """Check the artifact files against the checksums of ``record`` (configure.json, read with its seal checked).

    Raises:
        ArtifactsDamaged: a file is missing or differs, or the record holds no checksums; naming the file and the fix.
    """
    recorded = record.get(DIGESTS_KEY)
    if not recorded:
        raise ArtifactsDamaged(f"configure.json of {Path(artifacts_dir).parent} records no artifact checksums: {_FIX}")
    for name, digest in recorded.items():
        path = Path(artifacts_dir) / name
        if not path.is_file():
            raise ArtifactsDamaged(f"{path} is missing: {_FIX}")
        found = _sha256(path)
        if found != digest:
            raise ArtifactsDamaged(
                f"{path} does not match its sha256 in configure.json (altered or corrupted: expected {digest[:16]}..., "
                f"found {found[:16]}...): {_FIX}"
            )
