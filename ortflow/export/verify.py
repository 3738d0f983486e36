"""Verification of an exported model against the eval graph, offline optimization and int8 quantization.

The reference is the eval graph itself, cut to the chosen outputs by ``onnx.utils.Extractor`` (an implementation
independent of export's own pruning) and run in a plain ``InferenceSession`` with the checkpoint's parameters fed as
inputs. Nothing here imports the training engine.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import helper

log = logging.getLogger(__name__)

NUM_BATCHES = 8
"""Eval batches verification and the quantization report run on."""


class ExportError(ValueError):
    """Export cannot go on; the message names the file or option at fault and what to do."""


class VerificationError(ExportError):
    """The exported model's outputs differ from the eval graph's beyond the tolerance."""


@dataclass(frozen=True)
class Verification:
    """The exported model against the eval graph.

    Attributes:
        max_abs_diff: Largest absolute difference per output over the batches.
        tolerance: Largest difference accepted.
        num_batches: Batches compared.
        num_rows: Rows compared (first dimension of the first input, summed).
        data: Where the inputs came from ("eval split of <dir>" or "random inputs: <why>").
    """

    max_abs_diff: dict[str, float]
    tolerance: float
    num_batches: int
    num_rows: int
    data: str


@dataclass(frozen=True)
class QuantizationReport:
    """The int8 model against the float one on the same batches.

    Attributes:
        max_abs_diff: Largest absolute output difference per output.
        mean_abs_diff: Mean absolute output difference per output.
        argmax_agreement: Share of rows whose argmax over the last axis agrees (outputs with a class axis).
        loss_fp32: The configured loss of the float model, when labels and the loss output are at hand.
        loss_int8: The same for the int8 model.
        bytes_fp32: File size of the float model.
        bytes_int8: File size of the int8 model.
        data: Where the inputs came from.
    """

    max_abs_diff: dict[str, float]
    mean_abs_diff: dict[str, float]
    argmax_agreement: dict[str, float] = field(default_factory=dict)
    loss_fp32: float | None = None
    loss_int8: float | None = None
    bytes_fp32: int = 0
    bytes_int8: int = 0
    data: str = ""


# ---------------------------------------------------------------------------------------------------------------------
# Inputs


def _user_inputs(eval_proto: onnx.ModelProto, parameters: dict[str, np.ndarray], labels: set[str]) -> list:
    inits = {t.name for t in eval_proto.graph.initializer}
    return [i for i in eval_proto.graph.input if i.name not in parameters and i.name not in inits | labels]


def random_batch(
    eval_proto: onnx.ModelProto, parameters: dict[str, np.ndarray], labels: set[str], batch_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs shaped like the eval graph's data inputs (symbolic dims: batch_size first, then 4).

    Integer inputs get 0 or 1 (valid token and class ids for any vocabulary); floats are standard normal.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in _user_inputs(eval_proto, parameters, labels):
        tensor = info.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else (batch_size if i == 0 else 4)
            for i, d in enumerate(tensor.shape.dim)
        ]
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[info.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[info.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def sample_batches(
    data_dir: Path | None,
    eval_proto: onnx.ModelProto,
    parameters: dict[str, np.ndarray],
    batch_size: int,
    labels: set[str] = frozenset(),
    num_batches: int = NUM_BATCHES,
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Up to ``num_batches`` batches of the eval split, else one random batch; and a note saying which.

    Args:
        data_dir: Prepared data folder (with manifest.json), or None.
        eval_proto: The eval model (for the random fallback's input specs).
        parameters: Parameter names to leave out of the random inputs.
        batch_size: Rows per batch.
        labels: Label inputs (not generated for random batches: the inference model does not take them).
        num_batches: Batches to read from the eval split.
    """
    if data_dir is None:
        return [random_batch(eval_proto, parameters, labels, batch_size)], "random inputs: no prepared data found"
    try:
        from ortflow.dataprep.loader import EvalLoader
    except ImportError as err:  # the loader is optional for export; verification still runs on random inputs
        note = f"random inputs: cannot read the eval split ({err})"
        return [random_batch(eval_proto, parameters, labels, batch_size)], note
    batches = []
    for item in EvalLoader(data_dir, batch_size, rank=0, world_size=1).batches(num_batches):
        feeds = item[0] if isinstance(item, tuple) else item
        batches.append({name: np.asarray(value) for name, value in feeds.items()})
    if not batches:
        return [random_batch(eval_proto, parameters, labels, batch_size)], f"random inputs: {data_dir} has no eval rows"
    return batches, f"eval split of {data_dir}"


# ---------------------------------------------------------------------------------------------------------------------
# Running and comparing


def _session(model: Path, level=onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def run(session: onnxruntime.InferenceSession, feeds: dict[str, np.ndarray], outputs: Sequence[str]) -> dict:
    """Run ``outputs`` with the feeds the session takes (extra feeds, e.g. labels, are left out)."""
    wanted = {i.name for i in session.get_inputs()}
    missing = wanted - feeds.keys()
    if missing:
        raise VerificationError(f"the batch lacks inputs {sorted(missing)} that the model needs")
    values = session.run(list(outputs), {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(outputs, values, strict=True))


def reference_outputs(
    eval_proto: onnx.ModelProto,
    parameters: dict[str, np.ndarray],
    batches: list[dict[str, np.ndarray]],
    outputs: Sequence[str],
) -> list[dict[str, np.ndarray]]:
    """The eval graph's values of ``outputs`` on each batch, with the checkpoint's parameters fed as inputs."""
    # Basic level: bit-exact with the engine's eval graph (docs/engine.md); higher levels fuse kernels.
    with tempfile.TemporaryDirectory(prefix="ortflow-ref-") as tmp:
        cut = Path(tmp) / "reference.onnx"
        onnx.save(needed_graph(eval_proto, outputs), str(cut))
        session = _session(cut, onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC)
        return [run(session, {**batch, **parameters}, outputs) for batch in batches]


def needed_graph(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """``model`` cut to what ``outputs`` need (the labels drop out with the loss): the nodes they are computed by, in
    the graph's order, and the graph inputs and initializers those read; found in one walk back from the outputs,
    linear in the graph's size (``onnx.utils.extract_model`` searches every node for each tensor it visits, and checks
    and infers shapes of the whole graph first: seconds on a small GPT-2, more than the export itself)."""
    from ortflow.graph.onnx_tools import upstream

    graph = model.graph
    needed, keep = upstream(graph, outputs)
    typed = {v.name: v for v in [*graph.value_info, *graph.output]}
    cut = helper.make_graph(
        [graph.node[i] for i in keep], graph.name or "reference",
        [i for i in graph.input if i.name in needed],
        [typed.get(name) or helper.make_empty_tensor_value_info(name) for name in outputs],
        [t for t in graph.initializer if t.name in needed],
        value_info=[v for v in graph.value_info if v.name in needed and v.name not in set(outputs)],
    )
    result = helper.make_model(cut, opset_imports=model.opset_import)
    result.ir_version = model.ir_version
    result.functions.extend(model.functions)
    return result


def _rows(batches: list[dict[str, np.ndarray]]) -> int:
    return sum(int(next(iter(b.values())).shape[0]) if b and next(iter(b.values())).ndim else 1 for b in batches)


def verify_against(
    model: Path,
    batches: list[dict[str, np.ndarray]],
    reference: list[dict[str, np.ndarray]],
    tolerance: float,
    data_note: str,
) -> Verification:
    """Run ``model`` in a plain InferenceSession on the batches and compare with the reference outputs.

    Raises:
        VerificationError: an output differs by more than ``tolerance`` (or in shape, or is not finite).
    """
    session = _session(model)
    outputs = list(reference[0])
    worst = dict.fromkeys(outputs, 0.0)
    for batch, expected in zip(batches, reference, strict=True):
        got = run(session, batch, outputs)
        for name in outputs:
            if got[name].shape != expected[name].shape:
                raise VerificationError(
                    f"verification failed: output '{name}' of {model.name} has shape {got[name].shape}, the eval graph "
                    f"{expected[name].shape}"
                )
            diff = np.abs(got[name].astype(np.float64) - expected[name].astype(np.float64))
            finite_ref = np.isfinite(expected[name])
            if not np.array_equal(np.isfinite(got[name]), finite_ref):
                raise VerificationError(
                    f"verification failed: output '{name}' has NaN/inf where the eval graph has not"
                )
            worst[name] = max(worst[name], float(diff[finite_ref].max(initial=0.0)))
    bad = {n: d for n, d in worst.items() if d > tolerance}
    if bad:
        raise VerificationError(
            f"verification failed: outputs of the exported model differ from the eval graph by {bad} (tolerance "
            f"{tolerance}, on {data_note}). Check that the eval model belongs to this checkpoint's run; if the "
            "difference is expected (e.g. after --optimize), raise the tolerance"
        )
    return Verification(worst, tolerance, len(batches), _rows(batches), data_note)


def optimize_offline(model: Path, out: Path) -> Path:
    """ONNX Runtime's offline graph optimization at the basic level.

    Basic (constant folding, redundant node elimination, standard-op fusions) keeps only standard operators and no
    hardware-specific layouts, so the result runs on any machine and any execution provider; the extended and layout
    levels may emit CPU-specific contrib operators, which ORT documents as tied to the machine that produced them.
    """
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(out)
    options.log_severity_level = 3
    onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return out


def _loss(kind: str, output: np.ndarray, target: np.ndarray) -> float | None:
    """The configured loss in numpy (mean reduction, as the engine's loss blocks use)."""
    x = output.astype(np.float64)
    if kind == "cross_entropy":
        logits = x.reshape(-1, x.shape[-1])
        labels = target.reshape(-1).astype(np.int64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(labels)), labels].mean())
    t = target.astype(np.float64).reshape(x.shape)
    if kind == "mse":
        return float(((x - t) ** 2).mean())
    if kind == "l1":
        return float(np.abs(x - t).mean())
    if kind == "bce_with_logits":
        return float((np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))).mean())
    return None


def quantize(
    model: Path,
    out: Path,
    batches: list[dict[str, np.ndarray]],
    record: dict | None,
    labels: set[str],
    data_note: str,
) -> QuantizationReport:
    """Dynamic int8 quantization of the weights, and how much the outputs (and the loss) change on the batches.

    Args:
        model: The float model.
        out: Where to write the int8 model.
        batches: Inputs (with labels when they come from the eval split).
        record: ``configure.json`` (loss kind, loss output, label name), if known.
        labels: Label input names.
        data_note: Where the batches came from.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(model), str(out), weight_type=QuantType.QInt8)
    fp32, int8 = _session(model), _session(out)
    outputs = [o.name for o in fp32.get_outputs()]
    diffs: dict[str, list[np.ndarray]] = {n: [] for n in outputs}
    agree: dict[str, list[np.ndarray]] = {}
    loss_kind = (record or {}).get("loss")
    loss_output = (record or {}).get("loss_output")
    label = next(iter(labels), None)
    losses: list[tuple[float, float, int]] = []
    for batch in batches:
        a, b = run(fp32, batch, outputs), run(int8, batch, outputs)
        for name in outputs:
            diffs[name].append(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64)).ravel())
            if np.issubdtype(a[name].dtype, np.floating) and a[name].ndim >= 2 and a[name].shape[-1] > 1:
                agree.setdefault(name, []).append((a[name].argmax(-1) == b[name].argmax(-1)).ravel())
        if loss_kind and loss_output in outputs and label in batch:
            pair = (_loss(loss_kind, a[loss_output], batch[label]), _loss(loss_kind, b[loss_output], batch[label]))
            if None not in pair:
                losses.append((*pair, len(batch[label])))
    report = QuantizationReport(
        max_abs_diff={n: float(np.concatenate(d).max(initial=0.0)) for n, d in diffs.items()},
        mean_abs_diff={n: float(np.concatenate(d).mean()) for n, d in diffs.items()},
        argmax_agreement={n: float(np.concatenate(v).mean()) for n, v in agree.items()},
        # Weighted by rows, as the trainer averages its eval loss (the last eval batch may be short).
        loss_fp32=float(np.average([p[0] for p in losses], weights=[p[2] for p in losses])) if losses else None,
        loss_int8=float(np.average([p[1] for p in losses], weights=[p[2] for p in losses])) if losses else None,
        bytes_fp32=model.stat().st_size,
        bytes_int8=out.stat().st_size,
        data=data_note,
    )
    log.info("int8 quantization on %s: %s", data_note, report)
    return report
