"""Inspect a user's ONNX model and build the engine's training artifacts from it.

The artifacts are what every rank loads: ``training_model.onnx`` (forward + loss + gradients), ``eval_model.onnx``
(forward + loss) and ``checkpoint`` (the initial parameters). No optimizer graph: ortflow applies the update itself
(:mod:`ortflow.trainer.optim`). They are built once, in one process, by :func:`build_artifacts`.

How the config maps onto the engine (each point checked against onnxruntime-training 1.19.2):

* The loss is a custom ``onnxblock.Block`` rather than ``LossType``: it picks the configured output by name (so the
  loss output need not be the model's first) and hands the engine's loss block the configured label name (the
  built-in ``LossType`` path always names it ``labels`` or ``target``).
* ``model_output``: the block returns the model's own loss output; the engine builds gradients from it unchanged.
* No optimizer graph is built (``optimizer=None``): the engine only computes forward and backward; ortflow averages,
  clips and applies the update (AdamW, SGD, Lamb) on the engine's buffers.
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ortflow.artifacts_folder import ARTIFACT_FILES
from ortflow.config import RunConfig
from ortflow.configure import mixed_precision, training_graph
from ortflow.configure.engine_input import PROTO_LIMIT, ArtifactsError, artifacts_error, engine_input, prepare
from ortflow.engine import artifacts as engine_artifacts
from ortflow.engine import onnxblock
from ortflow.graph.exports.batch_dims import BatchReport
from ortflow.graph.exports.token_tables import token_tables

log = logging.getLogger(__name__)


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class TensorInfo:
    """A graph input, output or initializer.

    Attributes:
        name: Tensor name.
        dtype: numpy dtype name ("float32", "int64", ...).
        shape: Dimensions; symbolic ones as their name (str), unknown ones as None.
    """

    name: str
    dtype: str
    shape: tuple[int | str | None, ...]

    def to_dict(self) -> dict:
        """JSON-ready form: {"name", "dtype", "shape"}."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelInfo:
    """What :func:`inspect_model` finds in an ONNX model."""

    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    float_initializers: tuple[TensorInfo, ...]
    opset: int
    ir_version: int
    #: Each graph input -> the ``[table, rows]`` of every embedding table its values index
    #: (:func:`~ortflow.graph.exports.token_tables.token_tables`, as lists: configure.json records them).
    token_tables: dict[str, list[list]]

    def output(self, name: str) -> TensorInfo | None:
        """The output called ``name``, or None."""
        return next((o for o in self.outputs if o.name == name), None)


@dataclass(frozen=True)
class ArtifactsInfo:
    """What :func:`build_artifacts` built.

    Attributes:
        artifacts_dir: Folder holding :data:`ARTIFACT_FILES`.
        train_inputs: The training model's user inputs (label included), in the order the engine's Module takes them.
        eval_inputs: The same for the eval model.
        trainable: Names of trained parameters, sorted.
        frozen: Names of float initializers kept fixed, sorted.
        loss: The configured loss name.
        loss_output: The model output the loss reads (or, for model_output, the loss itself).
        label_input: Name of the label/target input (None for model_output).
        num_parameters: Number of trained scalar values.
        rewrites: What the model-preparation pass changed (``ortflow.graph.prepare``), one entry per pass.
        batch: What the batch-dimension pass decided (None when the model was too big to load here).
        passes: The preparation passes the model went through, in order (``ortflow.graph.prepare.PASSES``).
        torch: For a dynamo export, the torch parameters trained, their aliases, what was untied and what frozen
            (:meth:`ortflow.graph.exports.torch_params.TorchParameters.to_record`); None otherwise.
    """

    artifacts_dir: Path
    train_inputs: tuple[TensorInfo, ...]
    eval_inputs: tuple[TensorInfo, ...]
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    loss: str
    loss_output: str
    label_input: str | None
    num_parameters: int
    rewrites: tuple[dict, ...] = ()
    batch: BatchReport | None = None
    passes: tuple[str, ...] = ()
    torch: dict | None = None


def _tensor_type_info(name: str, type_proto: onnx.TypeProto) -> TensorInfo:
    tensor = type_proto.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name if tensor.elem_type else "unknown"
    shape: list[int | str | None] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        elif dim.HasField("dim_param"):
            shape.append(dim.dim_param)
        else:
            shape.append(None)
    return TensorInfo(name, dtype, tuple(shape))


def _graph_inputs(graph: onnx.GraphProto, exclude: set[str]) -> tuple[TensorInfo, ...]:
    return tuple(_tensor_type_info(i.name, i.type) for i in graph.input if i.name not in exclude)


def inspect_model(path: Path | str) -> ModelInfo:
    """Read an ONNX model's inputs, outputs, float initializers, opset, IR version and token tables (external data
    is not loaded).

    Inputs that are also initializers (old exporters list weights as inputs) are reported as initializers only.

    Args:
        path: The ``.onnx`` file.

    Returns:
        The model's :class:`ModelInfo`.
    """
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    init_names = {t.name for t in graph.initializer}
    floats = tuple(
        TensorInfo(t.name, np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name, tuple(int(d) for d in t.dims))
        for t in graph.initializer
        if t.data_type in _FLOAT_TYPES
    )
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ModelInfo(
        inputs=_graph_inputs(graph, init_names),
        outputs=tuple(_tensor_type_info(o.name, o.type) for o in graph.output),
        float_initializers=floats,
        opset=opset,
        ir_version=proto.ir_version,
        token_tables={name: [list(t) for t in tables] for name, tables in token_tables(proto).items()},
    )


def split_parameters(info: ModelInfo, frozen_patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Split the float initializers into (trainable, frozen) names, both sorted, by fnmatch patterns.

    Raises:
        ArtifactsError: If a pattern matches no float initializer, or nothing is left to train.
    """
    names = sorted(t.name for t in info.float_initializers)
    frozen: set[str] = set()
    for pattern in frozen_patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ArtifactsError(
                f"model.frozen: pattern '{pattern}' matches no float initializer; fix or remove it "
                f"(initializers: {sample or 'none'})"
            )
        frozen.update(matched)
    trainable = [n for n in names if n not in frozen]
    if not trainable:
        fix = " outside model.frozen; freeze fewer parameters" if names else "; export it with weights as initializers"
        raise ArtifactsError(f"nothing to train: the model has no float initializers{fix}")
    return trainable, sorted(frozen)


class ConfiguredLoss(onnxblock.Block):
    """Applies the engine's loss block to one named model output with a named label input."""

    def __init__(self, loss_block: onnxblock.Block | None, output_name: str, label_name: str | None,
                 scale_input: str | None = None):
        super().__init__()
        self._loss = loss_block
        self._output = output_name
        self._label = label_name
        self._scale = scale_input

    def build(self, *graph_outputs: str) -> str:
        # model_output: backpropagate from the model's own loss
        loss = self._output if self._loss is None else self._loss(self._output, self._label)
        if self._scale is None:
            return loss
        mixed_precision.add_scale_input(self.base.graph, self._scale)  # fp16 loss scaling: loss x scale input
        return onnxblock.blocks.Mul()(loss, self._scale)


def loss_block(cfg: RunConfig) -> onnxblock.Block | None:
    blocks = {
        "cross_entropy": onnxblock.loss.CrossEntropyLoss,
        "mse": onnxblock.loss.MSELoss,
        "bce_with_logits": onnxblock.loss.BCEWithLogitsLoss,
        "l1": onnxblock.loss.L1Loss,
    }
    if cfg.model.loss == "cross_entropy" and cfg.model.ignore_index is not None:
        return onnxblock.loss.CrossEntropyLoss(ignore_index=cfg.model.ignore_index)
    return None if cfg.model.loss == "model_output" else blocks[cfg.model.loss]()


def check_loss_io(cfg: RunConfig, info: ModelInfo) -> str:
    """The output the loss reads; checks names and shapes against the model before the engine sees them."""
    if not info.outputs:
        raise ArtifactsError("model.path: the model has no outputs")
    names = [o.name for o in info.outputs]
    output_name = cfg.model.loss_output or names[0]
    output = info.output(output_name)
    if output is None:
        raise ArtifactsError(f"model.loss_output: '{output_name}' is not a model output; outputs are {names}")
    if cfg.model.loss == "model_output":
        if output.shape not in ((), (1,)):
            raise ArtifactsError(
                f"model.loss_output: '{output_name}' must be a scalar loss for model.loss model_output, "
                f"but its shape is {list(output.shape)}"
            )
        return output_name
    if output.dtype != "float32":
        raise ArtifactsError(f"model.loss_output: '{output_name}' is {output.dtype}; the engine's losses need float32")
    # An output without shape information reports (); [B, T, V] (or more dims) is flattened by the preparation pass.
    if cfg.model.loss == "cross_entropy" and len(output.shape) == 1:
        raise ArtifactsError(
            f"model.loss cross_entropy needs class scores [N, C] or [B, T, C], but '{output_name}' has shape "
            f"{list(output.shape)}; for one score per row use model.loss bce_with_logits"
        )
    label = next((i for i in info.inputs if i.name == cfg.model.label_input), None)
    if label is not None and cfg.model.loss == "cross_entropy" and label.dtype != "int64":
        raise ArtifactsError(
            f"model.label_input: the model already has an input '{label.name}' of type {label.dtype}; "
            "cross_entropy needs int64 labels: pick another name"
        )
    return output_name


def in_mixed_precision(cfg: RunConfig, prepared):
    """The prepared model (the whole one, a pipeline stage's or a tensor-parallel piece's) rewritten for
    ``precision.use_mixed_precision`` (ortflow/configure/mixed_precision.py). A stage's or piece's inputs and outputs
    keep their fp32 type (the autocast pass casts at the graph's edges), so what crosses between stages and pieces
    stays fp32 and a half-precision value passes through its fp32 copy unchanged."""
    if not cfg.precision.use_mixed_precision:
        return prepared
    try:  # the autocast pass reads no weights: parameters stay fp32 initializers, where their data lies
        return dataclasses.replace(prepared, model=mixed_precision.prepare_model(cfg, prepared.model))
    except ValueError as err:
        raise ArtifactsError(str(err)) from err


#: Free space below which a failed build is put down to the disk, not to the model (the engine's C++ write errors
#: carry no errno).
_MIN_FREE_BYTES = 1 << 20


def build_artifacts(cfg: RunConfig, out_dir: Path, stale_record: Path | None = None,
                    proto_limit: int = PROTO_LIMIT) -> ArtifactsInfo:
    """Build the training and eval models and the initial checkpoint into ``out_dir``.

    Everything is written into a scratch folder next to ``out_dir`` first and swapped in at the end, so a crash
    never leaves a mix of old and new artifacts.

    Args:
        cfg: The run config; reads the ``model`` section.
        out_dir: The artifacts folder (replaced if it exists).
        stale_record: A file that vouches for the old artifacts (configure.json); deleted just before the new
            artifacts replace the old, so a failed build leaves old artifacts and their record as they were.
        proto_limit: Model bytes (graph and weights) from which the weights stay in their files while the engine
            builds (:func:`ortflow.configure.engine_input.engine_input`); 2 GiB, lowered by tests.

    Returns:
        What was built, including the training model's inputs in the engine's order.

    Raises:
        ArtifactsError: If the config does not fit the model (unknown output, bad frozen pattern, nothing to train).
    """
    info = inspect_model(cfg.model.path)
    trainable, frozen = split_parameters(info, cfg.model.frozen)
    output_name = check_loss_io(cfg, info)
    label_name = None if cfg.model.loss == "model_output" else cfg.model.label_input
    prepared, batch = prepare(cfg, trainable, output_name, label_name, proto_limit)
    if prepared.frozen:  # not weights (running statistics, constants the engine does not differentiate): no gradient
        trainable = [n for n in trainable if n not in prepared.frozen]
        frozen = sorted([*frozen, *prepared.frozen])
        if not trainable:
            raise ArtifactsError(
                f"nothing to train: the parameters model.frozen leaves ({', '.join(prepared.frozen)}) are running "
                "statistics or constants the engine does not differentiate; freeze fewer parameters"
            )

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        prepared = in_mixed_precision(cfg, prepared)
        scale_input = mixed_precision.scale_input(cfg)
        engine_model, linked = engine_input(Path(cfg.model.path), prepared, scratch, proto_limit)
        cwd = os.getcwd()
        if linked:
            os.chdir(scratch)  # the engine's checkpoint writer reads external data relative to the current folder
        try:
            # Blocks note the current folder when built (for temp.onnx): build them after the chdir.
            loss = ConfiguredLoss(loss_block(cfg), prepared.loss_input, prepared.label_input, scale_input)
            engine_artifacts.generate_artifacts(
                engine_model,
                requires_grad=trainable,
                frozen_params=frozen,
                loss=loss,
                optimizer=None,
                artifact_directory=scratch,
            )
        except Exception as err:  # noqa: BLE001 - the engine raises bare RuntimeErrors and C++ errors
            if "No space left" in str(err) or shutil.disk_usage(scratch).free < _MIN_FREE_BYTES:
                raise OSError(errno.ENOSPC, "No space left on device", str(out_dir.parent)) from err  # not the model
            raise artifacts_error(cfg, err, prepared, trainable) from err
        finally:
            os.chdir(cwd)
        for name in linked:  # the links to the user's weights: the checkpoint holds them now
            (scratch / name).unlink(missing_ok=True)
        missing = [f for f in ARTIFACT_FILES if not (scratch / f).exists()]
        if missing:
            raise RuntimeError(f"the engine did not write {missing} into {scratch}")
        if scale_input:
            mixed_precision.unscale_eval_model(scratch / "eval_model.onnx", scale_input)
        graph_report = training_graph.rewrite_training_model(cfg, scratch / "training_model.onnx")
        train_inputs, eval_inputs = _user_inputs(scratch, set(trainable) | set(frozen) | {scale_input} - {None})
        if stale_record is not None:
            stale_record.unlink(missing_ok=True)
        _swap_in(scratch, out_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    sizes = {t.name: int(np.prod(t.shape, dtype=np.int64)) for t in info.float_initializers}
    built = ArtifactsInfo(
        artifacts_dir=out_dir,
        train_inputs=train_inputs,
        eval_inputs=eval_inputs,
        trainable=tuple(trainable),
        frozen=tuple(frozen),
        loss=cfg.model.loss,
        loss_output=output_name,
        label_input=label_name,
        num_parameters=sum(sizes[n] for n in trainable),
        rewrites=(*prepared.report, *graph_report),
        batch=batch,
        passes=prepared.passes,
    )
    log.info(
        "built artifacts in %s: %d trainable tensors (%d values), %d frozen, loss %s on '%s'",
        out_dir, len(trainable), built.num_parameters, len(frozen), cfg.model.loss, output_name,
    )
    return built


def _user_inputs(folder: Path, parameters: set[str]) -> tuple[tuple[TensorInfo, ...], tuple[TensorInfo, ...]]:
    """Inputs of the training and eval models that the engine's Module takes from the caller, in its order.

    The engine turns every parameter into a graph input and, in the training model, adds a gradient accumulation
    buffer per trainable parameter and a ``lazy_reset_grad`` flag: the Module feeds those itself.
    """
    internal = parameters | {f"{p}_grad.accumulation.buffer" for p in parameters} | {"lazy_reset_grad"}
    result = []
    for name in ("training_model.onnx", "eval_model.onnx"):
        graph = onnx.load(str(folder / name), load_external_data=False).graph
        result.append(_graph_inputs(graph, internal | {t.name for t in graph.initializer}))
    return result[0], result[1]


def _swap_in(scratch: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by ``scratch``: two renames, so readers see either the old or the new folder."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(scratch, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
