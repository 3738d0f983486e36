"""Export: a complete checkpoint plus the eval model -> an inference ONNX model, verified before it is written.

No training session is made. The engine's own ``Module.export_model_for_inferencing`` needs the training model and
builds a training session (docs/engine.md); here the checkpoint file is only read (``CheckpointState``), and the
inference graph is cut out of the eval model with ``onnx``:

1. the parameters (graph inputs of the eval model) become initializers holding the checkpoint's values;
2. the graph keeps only the nodes the chosen outputs need; an output computed from the label input is refused (it
   belongs to the loss), so no loss node, label input, gradient or optimizer node can remain;
3. the result is checked for training-only operators, stamped with ``metadata_props``, verified against the eval
   graph in a plain ``InferenceSession``, optionally optimized offline and/or quantized, and only then renamed into
   place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow import __version__
from ortflow.checkpoints import (
    META_FILE,
    CheckpointInfo,
    verify,
)
from ortflow.config import RESOLVED_CONFIG_NAME, RunConfig, load_run_config
from ortflow.export import checksum
from ortflow.export import verify as verification
from ortflow.export.choose import pick_checkpoint
from ortflow.export.verify import ExportError
from ortflow.graph.exports.external_data import PROTO_LIMIT, needs_external_data, proto_bytes, save_with_external_data
from ortflow.graph.exports.gelu import decompose_gelu
from ortflow.graph.gradients.embedding import restore_gathers
from ortflow.graph.onnx_tools import infer_shapes, subgraph_reads, upstream
from ortflow.graph.precision.autocast import fold_parameter_casts, strip_autocast

log = logging.getLogger(__name__)

CONFIGURE_RECORD = "configure.json"
EVAL_MODEL = "eval_model.onnx"
TRAINING_DOMAINS = frozenset({"ai.onnx.training", "ai.onnx.preview.training"})
#: Operators that only training graphs hold: gradient accumulation, optimizers, the engine's loss internals and the
#: standard loss operators its loss blocks add. Any ``*Grad`` operator counts too.
TRAINING_OP_TYPES = frozenset({
    "InPlaceAccumulator", "InPlaceAccumulatorV2", "ZeroGradient", "Gradient", "YieldOp", "PassThrough",
    "AdamOptimizer", "AdamWOptimizer", "SGDOptimizer", "SGDOptimizerV2", "LambOptimizer", "InplaceClipGradNorm",
    "SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossInternal", "SoftmaxCrossEntropy", "SparseSoftmaxCrossEntropy",
    "NegativeLogLikelihoodLoss", "NegativeLogLikelihoodLossInternal", "BroadcastGradientArgs",
})


@dataclass(frozen=True)
class ExportSource:
    """Where export reads from.

    Attributes:
        checkpoint: The verified checkpoint.
        eval_model: The eval model (forward + loss) the inference graph is cut from.
        data_dir: Prepared data whose eval split verification runs on (None: random inputs).
        record: ``configure.json`` of the run, when found (original outputs, label and loss names).
        config: The run config, when found.
    """

    checkpoint: CheckpointInfo
    eval_model: Path
    data_dir: Path | None
    record: dict | None
    config: RunConfig | None


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote and how it checked it.

    Attributes:
        path: The inference model.
        checkpoint: The checkpoint folder it was made from.
        step: That checkpoint's step.
        eval_loss: Its recorded eval loss (None if no evaluation ran).
        inputs: The model's inputs.
        outputs: The model's outputs.
        verification: The float model against the eval graph (and the optimized model, if asked).
        optimized: Whether ONNX Runtime's offline (basic level) optimization was applied.
        quantization: The int8 model against the float one, when quantized.
        sha256: The written model's sha256 (also in its ``.sha256`` sidecar).
    """

    path: Path
    checkpoint: Path
    step: int
    eval_loss: float | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    verification: verification.Verification
    optimized: bool = False
    quantization: verification.QuantizationReport | None = None
    sha256: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        data = asdict(self)
        data["path"], data["checkpoint"] = str(self.path), str(self.checkpoint)
        return data


# ---------------------------------------------------------------------------------------------------------------------
# Finding the checkpoint, the eval model and the data


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_config(run_dir: Path) -> RunConfig | None:
    if not (run_dir / RESOLVED_CONFIG_NAME).exists():
        return None
    return load_run_config(run_dir)  # verified against its record: a damaged or edited config.yaml is named


def resolve_source(
    source: Path, eval_model: Path | None = None, config: RunConfig | None = None, checkpoint: str | None = None
) -> ExportSource:
    """Find the checkpoint, eval model, data and configure record that ``source`` names.

    Args:
        source: A run folder (its best checkpoint by eval loss, else the newest, is used) or a checkpoint folder
            (holding ``meta.json``), possibly copied away from its run.
        eval_model: The eval model; default: ``<run>/artifacts/eval_model.onnx`` for a run folder, and for a checkpoint
            folder ``eval_model.onnx`` inside it, next to it, or in ``<ckpt>/../../artifacts/``.
        config: The run config, if the caller has it (default: ``<run>/config.yaml`` when present).
        checkpoint: For a run folder, which checkpoint: ``best``, ``latest``, ``initial`` (the configured weights),
            ``step-N`` or ``N`` (default: best, else latest).

    Raises:
        ExportError: nothing usable at ``source``, or no eval model found.
        CheckpointError: the checkpoint named is damaged.
    """
    source = Path(source)
    if source.is_file():
        from ortflow.config import config_file_given

        raise ExportError(config_file_given(source) + " or one of its checkpoint folders")
    if not source.is_dir():
        raise ExportError(f"{source} does not exist or is not a folder; give a run folder or a checkpoint folder")
    if (source / META_FILE).exists():
        if checkpoint is not None:
            raise ExportError(f"{source} is a checkpoint folder: --checkpoint applies to run folders only")
        chosen = verify(source)  # named explicitly: a damaged one is refused, never swapped for another
        run_dir = source.parent.parent
        candidates = [source / EVAL_MODEL, source.parent / EVAL_MODEL, run_dir / "artifacts" / EVAL_MODEL]
        data_dir = run_dir / "data"
        config = config or _run_config(run_dir)
    else:
        run_dir = source
        config = config or _run_config(run_dir)
        chosen = pick_checkpoint(run_dir, config, checkpoint)
        artifacts = config.artifacts_dir if config else run_dir / "artifacts"
        candidates = [artifacts / EVAL_MODEL]
        data_dir = config.data_dir if config else run_dir / "data"
    if eval_model is not None:
        candidates = [Path(eval_model)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ExportError(
            f"no eval model for {chosen.path}: looked at {', '.join(map(str, candidates))}; pass --eval-model "
            "(the run's artifacts/eval_model.onnx) or copy it into the checkpoint folder"
        )
    if found.parent.resolve() == (Path(run_dir) / "artifacts").resolve():  # checked before any loader reads it
        from ortflow.artifacts_folder import verify_artifacts
        from ortflow.config.sealed import read_configure

        record = read_configure(run_dir)  # a missing or damaged configure.json stops here too
        verify_artifacts(found.parent, record)
    else:
        record = _read_json(run_dir / CONFIGURE_RECORD) or _read_json(found.parent.parent / CONFIGURE_RECORD)
    return ExportSource(
        checkpoint=chosen,
        eval_model=found,
        data_dir=data_dir if (data_dir / "manifest.json").exists() else None,
        record=record,
        config=config,
    )


def _load_eval_model(path: Path) -> onnx.ModelProto:
    """The eval model at ``path``; one copied beside a checkpoint has no recorded digest, so a damaged copy is named.

    Raises:
        ExportError: the file does not parse as an ONNX model.
    """
    try:
        return onnx.load(str(path))
    except Exception as err:  # noqa: BLE001 - onnx raises several types for bad files (protobuf's DecodeError, ...)
        raise ExportError(
            f"{path} is not a valid ONNX model ({type(err).__name__}: {err}): it is damaged or truncated; copy the "
            "run's artifacts/eval_model.onnx again (or pass it with --eval-model)"
        ) from None


# ---------------------------------------------------------------------------------------------------------------------
# Cutting the inference graph out of the eval model


def load_parameters(checkpoint_file: Path) -> dict[str, np.ndarray]:
    """Parameter values of a checkpoint, read without the engine's session.

    Args:
        checkpoint_file: A checkpoint folder (format 2: ``params.h5`` with h5py), or a format 1 folder's or the
            artifacts' engine ``checkpoint`` file (its flatbuffers read directly).
    """
    from ortflow.checkpoints import h5state, legacy

    path = Path(checkpoint_file)
    if path.is_dir():
        return h5state.read_params(path)
    return legacy.read_engine_checkpoint(path).parameters


def label_names(eval_proto: onnx.ModelProto, record: dict | None, config: RunConfig | None) -> set[str]:
    """Inputs of the eval graph that only the loss reads (the label or target)."""
    inputs = {i.name for i in eval_proto.graph.input}
    if record is not None and "label_input" in record:
        names = {record["label_input"]} if record["label_input"] else set()
    elif config is not None:
        names = set() if config.model.loss == "model_output" else {config.model.label_input}
    else:
        names = {"labels", "target"}
    return names & inputs


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    return {n for n in node.input if n} | subgraph_reads(node)


def default_outputs(eval_proto: onnx.ModelProto, record: dict | None, labels: set[str]) -> list[str]:
    """The original model's outputs: from ``configure.json`` when present, else what the eval graph feeds its loss.

    Without a record, the loss part of the eval graph is the set of nodes downstream of the label input; the tensors
    it reads from the rest of the graph are the model's outputs (for ``model_output`` losses, the eval outputs).
    """
    if record and record.get("model_outputs"):
        names = [o["name"] if isinstance(o, dict) else str(o) for o in record["model_outputs"]]
        if record.get("loss") == "model_output":
            names = [n for n in names if n != record.get("loss_output")] or names
        return names
    graph = eval_proto.graph
    tainted = _downstream(graph, labels)
    if not labels:
        return [o.name for o in graph.output]
    produced = {out for node in graph.node for out in node.output}
    fed_to_loss = []
    for node in graph.node:
        if any(out in tainted for out in node.output):
            fed_to_loss += [n for n in node.input if n in produced and n not in tainted and n not in fed_to_loss]
    return fed_to_loss


def _downstream(graph: onnx.GraphProto, sources: set[str]) -> set[str]:
    """Tensors computed (directly or not) from ``sources``; ONNX graphs list nodes in topological order."""
    tainted = set(sources)
    for node in graph.node:
        if _node_inputs(node) & tainted:
            tainted.update(node.output)
    return tainted


def training_ops(model: onnx.ModelProto) -> list[str]:
    """``domain:op_type`` of every node that only belongs in a training graph (gradients, optimizers, losses)."""
    found = []
    for node in model.graph.node:
        if node.domain in TRAINING_DOMAINS or node.op_type.endswith("Grad") or node.op_type in TRAINING_OP_TYPES:
            found.append(f"{node.domain or 'ai.onnx'}:{node.op_type} ({node.name or node.output[0]})")
    return found


def build_inference_model(
    eval_proto: onnx.ModelProto,
    parameters: dict[str, np.ndarray],
    outputs: Sequence[str],
    labels: set[str],
) -> onnx.ModelProto:
    """The inference graph: the eval graph's nodes that ``outputs`` need, with the parameters as initializers.

    Args:
        eval_proto: The eval model (parameters are graph inputs there).
        parameters: Parameter values from the checkpoint.
        outputs: Tensors to output.
        labels: The label inputs; an output computed from one is refused.

    Raises:
        ExportError: an output is unknown, belongs to the loss, or the result holds training-only operators.
    """
    graph = eval_proto.graph
    produced = {out: node for node in graph.node for out in node.output}
    graph_inputs = {i.name: i for i in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    tainted = _downstream(graph, labels)
    for name in outputs:
        if name not in produced and name not in graph_inputs and name not in initializers:
            raise ExportError(
                f"output '{name}' is not a tensor of the eval model; choose from the model's outputs, e.g. "
                f"{default_outputs(eval_proto, None, labels)}"
            )
        if name in tainted:
            raise ExportError(
                f"output '{name}' is computed from the label input {sorted(labels)}: it belongs to the loss, which an "
                "inference model does not hold; choose outputs computed from the model's inputs"
            )
    needed, keep_nodes = upstream(graph, outputs)

    nodes = [graph.node[i] for i in keep_nodes]
    new_inits = []
    for name in sorted(needed):
        if name in parameters and (name in graph_inputs or name in initializers):
            value = parameters[name]
            declared = graph_inputs.get(name)
            if declared is not None:
                expected = helper.tensor_dtype_to_np_dtype(declared.type.tensor_type.elem_type)
                if value.dtype != expected:
                    raise ExportError(
                        f"parameter '{name}' is {value.dtype} in the checkpoint but {expected} in the eval model: the "
                        "checkpoint and eval model come from different runs; pass the run's eval model"
                    )
            new_inits.append(numpy_helper.from_array(value, name))
        elif name in initializers:
            new_inits.append(initializers[name])
    inputs = [i for i in graph.input if i.name in needed and i.name not in parameters]

    typed = _value_infos(eval_proto)
    out_infos = [typed.get(name) or helper.make_empty_tensor_value_info(name) for name in outputs]
    value_info = [vi for vi in graph.value_info if vi.name in needed and vi.name not in set(outputs)]
    new_graph = helper.make_graph(nodes, graph.name or "ortflow_inference", inputs, out_infos, new_inits,
                                  value_info=value_info)
    used_domains = {n.domain for n in nodes} | {f.domain for f in eval_proto.functions} | {""}
    opsets = [o for o in eval_proto.opset_import if o.domain in used_domains or o.domain == "ai.onnx"]
    model = helper.make_model(new_graph, opset_imports=opsets, producer_name="ortflow", producer_version=__version__)
    model.ir_version = eval_proto.ir_version
    model.functions.extend(eval_proto.functions)
    bad = training_ops(model)
    if bad:
        raise ExportError(
            f"the inference graph for outputs {list(outputs)} still holds training-only operators {bad}; choose "
            "outputs computed before the loss"
        )
    return model


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Types of the graph's tensors (shape inference where it works; the engine's contrib ops may defeat it)."""
    try:
        inferred = infer_shapes(model)
    except Exception as err:  # noqa: BLE001 - onnx raises several types; types only improve the output's metadata
        log.debug("shape inference failed: %s", err)
        inferred = model
    graph = inferred.graph
    return {vi.name: vi for vi in [*graph.value_info, *graph.output, *graph.input]}


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def _compute_tolerance(reference: list[dict[str, np.ndarray]], config: RunConfig | None) -> float:
    """Four units in the last place of the largest reference output in the compute type (fp16: 2**-10 relative,
    bf16: 2**-7): kernels fused differently at the exported model's optimization level round differently."""
    largest = max((float(np.abs(v).max()) for batch in reference for v in batch.values() if v.size), default=1.0)
    ulp = 2.0**-7 if config is not None and config.precision.use_bfloat16 else 2.0**-10
    return 4 * ulp * largest


def _metadata(checkpoint: CheckpointInfo, source: ExportSource) -> dict[str, str]:
    fingerprint = checkpoint.meta.get("config_fingerprint") or (source.record or {}).get("fingerprint") or ""
    return {
        "ortflow_version": __version__,
        "config_fingerprint": str(fingerprint),
        "step": str(checkpoint.step),
        "eval_loss": "none" if checkpoint.eval_loss is None else repr(checkpoint.eval_loss),
        "ortflow_checkpoint": checkpoint.path.name,
    }


def _stamp(path: Path, metadata: dict[str, str]) -> None:
    model = onnx.load(str(path), load_external_data=False)  # external data stays where it is
    kept = [p for p in model.metadata_props if p.key not in metadata]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def export_model(
    source: Path,
    out: Path,
    outputs: Sequence[str] = (),
    eval_model: Path | None = None,
    optimize: bool = False,
    quantize: bool = False,
    tolerance: float = 1e-4,
    config: RunConfig | None = None,
    checkpoint: str | None = None,
    precision: str | None = None,
    proto_limit: int = PROTO_LIMIT,
) -> ExportResult:
    """Export an inference model from a checkpoint and the eval model, verify it, and write it atomically.

    Args:
        source: A run folder (best checkpoint by eval loss, else the newest) or a checkpoint folder.
        out: Where to write the model (replaced atomically; nothing is written when verification fails).
        outputs: Outputs to keep (default: the original model's outputs).
        eval_model: The eval model (default: found next to the checkpoint or in the run's artifacts).
        optimize: Apply ONNX Runtime's offline graph optimization at the basic level (portable across machines).
        quantize: Dynamic int8 quantization of the weights; the change in outputs (and loss, when the labels are
            known) on the eval split is reported in the result.
        tolerance: Largest absolute difference to the eval graph's outputs accepted by verification.
        config: The run config (default: the run folder's ``config.yaml`` when present).
        checkpoint: Which checkpoint of a run folder: ``best``, ``latest``, ``initial``, ``step-N`` (default: best,
            else latest).
        precision: ``fp32`` (default; a mixed-precision run's autocast casts are removed) or ``compute`` (the
            graph as trained, fp16/bf16 weights stored in the compute type); default: the config's
            ``export.precision``. Verified against the eval graph in the same precision.
        proto_limit: Model bytes from which the weights go to ``<out>.data`` beside ``out`` (2 GiB, the protobuf
            limit; tests lower it).

    Returns:
        Where the model is and the verification numbers.

    Raises:
        CheckpointError: the checkpoint is damaged.
        ExportError: no checkpoint or eval model, a bad output name, or a verification mismatch.
    """
    src = resolve_source(Path(source), eval_model, config, checkpoint)
    checkpoint = src.checkpoint
    precision = precision or (src.config.export.precision if src.config else "fp32")
    if precision == "compute" and src.config is not None and src.config.precision.use_bfloat16:
        raise ExportError(
            "export.precision compute: a bf16 model cannot be verified here (the CPU provider that verification runs "
            "on has no bf16 kernels); export fp32 (the default) and convert it where it will run"
        )
    eval_proto = _load_eval_model(src.eval_model)
    if precision == "fp32":  # a mixed-precision run's eval graph without its casts: the user's fp32 model
        eval_proto = strip_autocast(eval_proto)
    eval_proto = restore_gathers(eval_proto)  # the user's Gathers back (ortflow/graph/gradients/embedding.py)
    # fused GELUs as standard ops: no com.microsoft domain (graph/exports/gelu.py)
    eval_proto = decompose_gelu(eval_proto)
    labels = label_names(eval_proto, src.record, src.config)
    names = list(outputs) or default_outputs(eval_proto, src.record, labels)
    if not names:
        raise ExportError(f"cannot tell the model's outputs from {src.eval_model}; pass them with --outputs")
    parameters = load_parameters(checkpoint.path)
    model = build_inference_model(eval_proto, parameters, names, labels)
    if precision == "compute":
        model = fold_parameter_casts(model)
    out = Path(out)
    size = proto_bytes(model)
    external = needs_external_data(size, 0, proto_limit)
    if external and (optimize or quantize):
        raise ExportError(f"--optimize and --quantize take models under 2 GB; this one ({size / 1e9:.1f} GB) is "
                          "exported with its weights in external data: export without them")
    if external:
        return _export_external(model, out, src, eval_proto, parameters, names, labels, tolerance, precision)

    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.parent / f".{out.name}.tmp-{os.getpid()}"
    plain, optimized_path, quantized_path = (Path(f"{stem}.{kind}.onnx") for kind in ("fp32", "opt", "int8"))
    batch_size = src.config.train.resolved_eval_batch_size if src.config else 8
    try:
        onnx.save(model, str(plain))
        onnx.checker.check_model(str(plain))
        feeds, data_note = verification.sample_batches(src.data_dir, eval_proto, parameters, batch_size, labels)
        reference = verification.reference_outputs(eval_proto, parameters, feeds, names)
        if precision == "compute":
            tolerance = max(tolerance, _compute_tolerance(reference, src.config))
        result = verification.verify_against(plain, feeds, reference, tolerance, data_note)
        final = plain
        if optimize:
            verification.optimize_offline(plain, optimized_path)
            result = verification.verify_against(optimized_path, feeds, reference, tolerance, data_note)
            final = optimized_path
        quant = None
        if quantize:
            quant = verification.quantize(final, quantized_path, feeds, src.record, labels, data_note)
            final = quantized_path
        _stamp(final, _metadata(checkpoint, src))
        digest = checksum.sha256_file(final)
        os.replace(final, out)
        checksum.write_sidecar(out, digest)  # a crash before this leaves a stale sidecar: detected, re-exported
    finally:
        for tmp in out.parent.glob(f"{stem.name}*"):  # its own and whatever the optimizer or quantizer made beside
            tmp.unlink(missing_ok=True)
    log.info("exported %s from %s (outputs %s, max abs diff %s)", out, checkpoint.path, names, result.max_abs_diff)
    return ExportResult(
        path=out,
        checkpoint=checkpoint.path,
        step=checkpoint.step,
        eval_loss=checkpoint.eval_loss,
        inputs=tuple(i.name for i in model.graph.input),
        outputs=tuple(names),
        verification=result,
        optimized=optimize,
        quantization=quant,
        sha256=digest,
    )


def _export_external(model, out: Path, src: ExportSource, eval_proto, parameters, names, labels, tolerance,
                     precision) -> ExportResult:
    """Write ``out`` with its weights in ``<out name>.data`` beside it, verified first in a scratch folder beside
    ``out``; then the data file and the model are renamed into place, the data first (a crash between the two
    renames leaves the previous model file reading the new weights: export again)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.tmp-{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    location = f"{out.name}.data"
    staged = scratch / out.name
    try:
        save_with_external_data(model, staged, location)
        del model  # its weights left the proto as they were written
        onnx.checker.check_model(str(staged))  # by path: the checker reads the data files, not the proto
        batch_size = src.config.train.resolved_eval_batch_size if src.config else 8
        feeds, data_note = verification.sample_batches(src.data_dir, eval_proto, parameters, batch_size, labels)
        reference = verification.reference_outputs(eval_proto, parameters, feeds, names)
        if precision == "compute":
            tolerance = max(tolerance, _compute_tolerance(reference, src.config))
        result = verification.verify_against(staged, feeds, reference, tolerance, data_note)
        _stamp(staged, _metadata(src.checkpoint, src))
        inputs = tuple(i.name for i in onnx.load(str(staged), load_external_data=False).graph.input)
        digest = checksum.sha256_file(staged)
        os.replace(scratch / location, out.parent / location)
        os.replace(staged, out)
        checksum.write_sidecar(out, digest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("exported %s with its weights in %s from %s (outputs %s, max abs diff %s)", out, location,
             src.checkpoint.path, names, result.max_abs_diff)
    return ExportResult(path=out, checkpoint=src.checkpoint.path, step=src.checkpoint.step,
                        eval_loss=src.checkpoint.eval_loss, inputs=inputs, outputs=tuple(names), verification=result,
                        optimized=False, quantization=None, sha256=digest)
