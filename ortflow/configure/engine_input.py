"""The model the engine gets: the user's model after ortflow's preparation pass, weights loaded or (past 2 GB) in files.

Used by :func:`ortflow.configure.artifacts.build_artifacts`; the rewrites themselves live in :mod:`ortflow.graph`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ortflow.config import RunConfig
from ortflow.graph.exports.batch_dims import BatchReport, make_batch_symbolic
from ortflow.graph.exports.external_data import (
    PROTO_LIMIT,
    data_bytes,
    external_files,
    needs_external_data,
    proto_bytes,
)
from ortflow.graph.exports.ties import describe_copies, folded_tie_copies
from ortflow.graph.gradients.differentiable import explain_engine_error
from ortflow.graph.onnx_tools import GraphError
from ortflow.graph.prepare import CONSTANT_ELEMENTS, PreparedModel, prepare_model

log = logging.getLogger(__name__)


class ArtifactsError(ValueError):
    """The model and the config cannot be turned into training artifacts; the message names the field to fix."""


def prepare(
    cfg: RunConfig, trainable: list[str], output_name: str, label_name: str | None, proto_limit: int
) -> tuple[PreparedModel, BatchReport | None]:
    """The batch-dimension pass (:mod:`ortflow.graph.exports.batch_dims`), then the model-preparation pass.

    The batch pass test-runs the model at two batch sizes, so it needs the weights: it runs when the model with its
    external data fits in a proto (report None otherwise: the batch dims stay as exported). The preparation passes
    never read weights.
    """
    model = onnx.load(str(cfg.model.path), load_external_data=False)
    batch = None
    _load_small_external(model, Path(cfg.model.path).parent)
    if _fits(Path(cfg.model.path), model, proto_limit):
        onnx.external_data_helper.load_external_data_for_model(model, str(Path(cfg.model.path).parent))
        for line in describe_copies(folded_tie_copies(model, set(trainable)), model):
            log.warning("model.path: %s", line)
        model, batch = make_batch_symbolic(model)
    try:
        repeatable = repeatable_gathers(cfg)
        prepared = prepare_model(model, set(trainable), cfg.model.loss, output_name, label_name, repeatable,
                                 fuse_gelu=gelu_fusion(cfg), keep=set(cfg.model.pipeline_cuts))
        return prepared, batch
    except GraphError as err:
        raise ArtifactsError(str(err)) from None


def split_source(cfg: RunConfig, trainable: list[str], proto_limit: int) -> PreparedModel:
    """The model that pipeline stages and tensor-parallel pieces are cut from: the whole model after the batch pass (so
    every cut graph inherits the symbolic batch) and the preparation passes without the loss
    (:mod:`ortflow.graph.prepare`; each cut graph is prepared again by :func:`prepare_cut`).

    A model past ``proto_limit`` keeps its weights in their files: its initializers still point into the data files
    (constants loaded, as :func:`prepare` does), the batch pass is skipped (it test-runs the model: the batch dims stay
    as exported), and each stage cut from it reaches the engine through :func:`engine_input`. The cut reads only the
    tensors' names, types and dims (:mod:`ortflow.graph.pipeline_parallel.pipeline_cuts`); a tensor-parallel split
    reads each weight it slices alone from its file (:func:`ortflow.graph.tensor_parallel.tensor_shard.shard_model`),
    and each piece reaches the engine through :func:`engine_input` too, its slices written to a data file of its own.

    Raises:
        ArtifactsError: A pass refuses the model (names the node and the fix).
    """
    model = onnx.load(str(cfg.model.path), load_external_data=False)
    _load_small_external(model, Path(cfg.model.path).parent)
    if _fits(Path(cfg.model.path), model, proto_limit):
        onnx.external_data_helper.load_external_data_for_model(model, str(Path(cfg.model.path).parent))
        model, _ = make_batch_symbolic(model)
    try:
        return prepare_model(model, set(trainable), cfg.model.loss, None, None, False, fuse_gelu=gelu_fusion(cfg),
                             keep=set(cfg.model.pipeline_cuts))
    except GraphError as err:
        raise ArtifactsError(str(err)) from None


def prepare_cut(cfg: RunConfig, model: onnx.ModelProto, parameters, loss_output: str | None) -> PreparedModel:
    """One pipeline stage's or tensor-parallel piece's graph through the same preparation passes as the whole model.

    Args:
        cfg: The run config.
        model: The cut graph.
        parameters: The parameters it trains.
        loss_output: The model output the loss reads, on the graph that computes the loss; None on the others.

    Raises:
        ArtifactsError: A pass refuses the graph (names the node and the fix).
    """
    label = None if loss_output is None or cfg.model.loss == "model_output" else cfg.model.label_input
    try:
        return prepare_model(model, set(parameters), cfg.model.loss, loss_output, label, repeatable_gathers(cfg),
                             fuse_gelu=gelu_fusion(cfg), keep=set(cfg.model.pipeline_cuts))
    except GraphError as err:
        raise ArtifactsError(str(err)) from None


def gelu_fusion(cfg: RunConfig) -> str:
    """How exported GELUs reach the engine (:func:`ortflow.graph.exports.gelu.gelu_rewrites`): with model.fuse_gelu,
    ``"cpu"`` on CPU ranks (the engine's Gelu for the erf form, the sigmoid form for the tanh form, whose engine
    gradient is slow on CPU: :mod:`ortflow.graph.gradients.gelu_grad`) and ``"engine"`` on GPUs (the engine's Gelu /
    FastGelu, in fp32, fp16 and bf16: docs/engine.md "GELU"); ``"as_exported"`` without it."""
    if not cfg.model.fuse_gelu:
        return "as_exported"
    return "cpu" if cfg.distributed.device == "cpu" else "engine"


def repeatable_gathers(cfg: RunConfig) -> bool:
    """Whether embedding reads become GatherND (:mod:`ortflow.graph.gradients.embedding`): on the CPU, with
    distributed.deterministic_compute, because the CPU engine's Gather gradient sums repeated ids in thread order.
    The CUDA engine's GatherGrad is another kernel, not examined here: CUDA graphs are left as they are."""
    return cfg.distributed.device == "cpu" and cfg.distributed.deterministic_compute


def _load_small_external(model: onnx.ModelProto, folder: Path) -> None:
    """Load the constants an exporter put in external data (tensors of at most ``CONSTANT_ELEMENTS`` values) even
    when the weights stay on disk (a model over 2 GB): the passes read them (ortflow/graph/prepare.py)."""
    for tensor in model.graph.initializer:
        if (tensor.data_location == onnx.TensorProto.EXTERNAL
                and int(np.prod(tensor.dims, dtype=np.int64)) <= CONSTANT_ELEMENTS):
            onnx.external_data_helper.load_external_data_for_tensor(tensor, str(folder))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _fits(model_path: Path, model: onnx.ModelProto, proto_limit: int) -> bool:
    return not needs_external_data(proto_bytes(model), data_bytes(model_path, model), proto_limit)


def engine_input(model_path: Path, prepared: PreparedModel, scratch: Path,
                 proto_limit: int = PROTO_LIMIT) -> tuple[onnx.ModelProto, list[str]]:
    """What generate_artifacts gets: the prepared proto with its weights loaded, or, when that would reach the
    proto limit, the prepared proto whose initializers still point into the data files; then the files are linked
    (or copied) into ``scratch`` at the same relative locations, and the engine must run with ``scratch`` as the
    current folder.

    The engine's own path input (``generate_artifacts(path)``) loads every weight into Python protos several times over
    (five times the weights' bytes were measured) and serialises the model whole, which fails past 2 GB unless
    every initializer is a parameter. Given references, the engine moves the parameters to graph inputs without
    reading them, and its checkpoint writer reads each one from its file (relative to the current folder) into the
    checkpoint, writing ``checkpoint.data`` beside it past its own size limit.

    A tensor-parallel piece holds its slices of the split weights (new arrays, made by
    :func:`ortflow.graph.tensor_parallel.tensor_shard.shard_model`) beside its references to the replicated ones: past
    the limit, every initializer held in the proto with more than ``CONSTANT_ELEMENTS`` values is moved (in
    ``prepared.model`` itself) into a data file written in ``scratch`` (:func:`write_held_weights`), so the engine gets
    references only.

    Returns:
        (the model for the engine, the data files linked or written into ``scratch``: empty when the weights are
        loaded).
    """
    model = prepared.model
    files = external_files(model)
    if _fits(model_path, model, proto_limit):
        if files:
            model = onnx.ModelProto.FromString(model.SerializeToString())
            onnx.external_data_helper.load_external_data_for_model(model, str(model_path.parent))
        return model, []
    for name in files:
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(model_path.parent / name, target)
        except OSError:  # another filesystem: copy once
            shutil.copyfile(model_path.parent / name, target)
    written = write_held_weights(model, scratch, files)
    return model, files + ([written] if written else [])


#: External data offsets are aligned to this many bytes (a page: the readers may map the file).
ALIGNMENT = 4096


def write_held_weights(model: onnx.ModelProto, folder: Path, taken: list[str]) -> str | None:
    """Move every initializer of ``model`` held in the proto with more than ``CONSTANT_ELEMENTS`` values into one data
    file in ``folder`` (named apart from ``taken``), each tensor a reference to its bytes there, one tensor at a time.

    Returns:
        The file's name, relative to ``folder``; None when no initializer was moved.
    """
    held = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
            and int(np.prod(t.dims, dtype=np.int64)) > CONSTANT_ELEMENTS]
    if not held:
        return None
    name = "piece.data"
    while name in taken:
        name = "_" + name
    with open(folder / name, "wb") as out:
        for tensor in held:
            data = tensor.raw_data or numpy_helper.to_array(tensor).tobytes()
            offset = -out.tell() % ALIGNMENT + out.tell()
            out.seek(offset)
            out.write(data)
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)
            del tensor.external_data[:]
            for key, value in (("location", name), ("offset", str(offset)), ("length", str(len(data)))):
                tensor.external_data.add(key=key, value=value)
            tensor.data_location = onnx.TensorProto.EXTERNAL
    return name


def artifacts_error(cfg: RunConfig, err: Exception, prepared: PreparedModel, trainable: list[str]) -> ArtifactsError:
    explained = explain_engine_error(str(err), prepared.model, set(trainable))
    if explained is not None:
        return ArtifactsError(f"model.path: the engine could not differentiate {cfg.model.path.name}: {explained}")
    return ArtifactsError(
        f"model.path: the engine could not build a training graph from {cfg.model.path.name}: "
        f"{type(err).__name__}: {err}. ortflow already declared LayerNormalization/Dropout outputs and replaced Splits "
        "with unused outputs; see docs/your-model.md for the ops the engine cannot "
        "differentiate and what to write instead"
    )
