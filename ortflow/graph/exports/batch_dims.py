"""Batch dimensions: make a fixed leading (batch) dim symbolic when the graph does not depend on it.

``torch.onnx.export`` without ``dynamic_axes`` fixes every dim of the inputs and outputs, the batch included. Such a
model would only train and evaluate at the traced batch size, and the short last eval batch would crash the engine.

The pass renames the fixed leading dim ``D`` of the inputs (and of the outputs that share it) to the symbolic
``batch`` when that is sound, and otherwise returns the model unchanged. An output whose leading dim is ``k * D``
(logits a traced ``view(-1, V)`` flattened to ``[D*T, V]``) becomes ``batch*k``.

Whether the graph depends on ``D`` cannot be read off reliably (traced shape arithmetic hides it in Constants,
Expand, Tile, ConstantOfShape, or in ops that mix rows such as a batch mean), so it is tested, with plain ONNX
Runtime inference on synthetic inputs:

1. the original model at batch ``D`` gives reference outputs;
2. the symbolic model must run at batch ``D + 1`` and at batch 1, its outputs' leading dims must follow the batch
   (``k * n`` rows at batch ``n``), and every row must equal the reference row computed from the same input row
   (rows are independent), to a tolerance of ``1e-4 * (1 + |reference|)`` (kernels may block differently at other
   batch sizes).

Anything else (a failure, other leading dims, rows that differ) keeps the dim fixed, and the report says why. The
check is skipped, and the dim kept, when inputs disagree on the leading dim or the model is too large to run here.
Weights are never touched: only the graph's input/output dims change and intermediate ``value_info`` shapes are
dropped (they would still state the fixed size; ONNX Runtime re-infers them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

log = logging.getLogger(__name__)

#: Name given to the batch dim made symbolic.
BATCH_DIM = "batch"
# Models larger than this (bytes of ModelProto) are not test-run: the dim is kept fixed.
_MAX_CHECK_BYTES = 1 << 30


@dataclass(frozen=True)
class BatchReport:
    """What :func:`make_batch_symbolic` decided.

    Attributes:
        fixed_batch: The leading dim the inputs fix (None when no input fixes one).
        symbolic: True when that dim was made symbolic.
        inputs: Inputs whose leading dim was (or would have been) changed.
        outputs: Outputs whose leading dim was (or would have been) changed.
        reason: Why the dim was kept fixed (empty when made symbolic or when nothing was fixed).
    """

    fixed_batch: int | None
    symbolic: bool
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form (recorded in configure.json)."""
        return {"fixed_batch": self.fixed_batch, "symbolic": self.symbolic, "inputs": list(self.inputs),
                "outputs": list(self.outputs), "reason": self.reason}  # fmt: skip


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in
            value_info.type.tensor_type.shape.dim]  # fmt: skip


def _data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _leading_fixed(model: onnx.ModelProto) -> tuple[int | None, str]:
    """The fixed leading dim shared by every data input, or (None, why not)."""
    leading = {i.name: (_dims(i) or [None])[0] for i in _data_inputs(model)}
    fixed = {v for v in leading.values() if isinstance(v, int) and v > 0}
    if not fixed:
        return None, ""
    if len(fixed) > 1 or any(not isinstance(v, int) for v in leading.values()):
        return None, f"inputs disagree on their leading dim ({leading})"
    return fixed.pop(), ""


def make_batch_symbolic(model: onnx.ModelProto) -> tuple[onnx.ModelProto, BatchReport]:
    """Return a copy of ``model`` whose fixed batch dim is symbolic when the graph allows it, and a report.

    Args:
        model: The user's model (left unchanged).

    Returns:
        (model, report): the original object itself when nothing changed.
    """
    batch, why = _leading_fixed(model)
    if batch is None:
        if why:
            log.info("batch dims kept as exported: %s", why)
        return model, BatchReport(None, False, reason=why)
    inputs = tuple(i.name for i in _data_inputs(model))
    factors = _output_factors(model, batch)
    outputs = tuple(factors)
    candidate = onnx.ModelProto()
    candidate.CopyFrom(model)
    graph = candidate.graph
    for info in [*graph.input, *graph.output]:
        if info.name in inputs or info.name in outputs:
            k = factors.get(info.name, 1)
            dim = info.type.tensor_type.shape.dim[0]
            dim.Clear()
            dim.dim_param = BATCH_DIM if k == 1 else f"{BATCH_DIM}*{k}"
    del graph.value_info[:]
    reason = "" if model.ByteSize() <= _MAX_CHECK_BYTES else "the model is too large to test-run here"
    reason = reason or _rows_independent(model, candidate, batch, factors)
    if reason:
        log.warning(
            "batch dim kept fixed at %d (inputs %s): %s; train.batch_size and train.eval_batch_size must be %d, "
            "and the last eval batch is padded", batch, list(inputs), reason, batch,
        )  # fmt: skip
        return model, BatchReport(batch, False, inputs, outputs, reason)
    log.info("batch dim %d made symbolic ('%s') on inputs %s and outputs %s: the graph does not depend on it",
             batch, BATCH_DIM, list(inputs), list(outputs))  # fmt: skip
    return candidate, BatchReport(batch, True, inputs, outputs)


def _output_factors(model: onnx.ModelProto, batch: int) -> dict[str, int]:
    """Outputs whose fixed leading dim is a multiple ``k * batch``, with their ``k``."""
    factors = {}
    for output in model.graph.output:
        first = (_dims(output) or [None])[0]
        if isinstance(first, int) and first > 0 and first % batch == 0:
            factors[output.name] = first // batch
    return factors


def _synthetic(model: onnx.ModelProto, rows: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs with ``rows`` rows: normal floats, ints in {0, 1} (valid ids for any table), random bools."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in _data_inputs(model):
        shape = [rows] + [d if isinstance(d, int) and d > 0 else 2 for d in _dims(info)[1:]]
        dtype = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[info.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime  # plain inference, only here: the rest of the pass needs onnx alone

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run([o.name for o in model.graph.output], feeds)


def _rows_independent(
    original: onnx.ModelProto, candidate: onnx.ModelProto, batch: int, factors: dict[str, int]
) -> str:
    """Empty when the candidate runs at other batch sizes with row-wise identical outputs; else why not."""
    big = _synthetic(original, batch + 1, seed=0)
    try:
        reference = _run(original, {k: v[:batch] for k, v in big.items()})
    except Exception as err:  # noqa: BLE001 - ONNX Runtime raises several types
        return f"the model does not run on synthetic inputs ({type(err).__name__}: {str(err)[:200]})"
    names = [o.name for o in original.graph.output]
    for rows, common in ((batch + 1, batch), (1, 1)):
        try:
            got = _run(candidate, {k: v[:rows] for k, v in big.items()})
        except Exception as err:  # noqa: BLE001
            return f"the graph fails at batch size {rows} ({type(err).__name__}: {str(err)[:200]})"
        for name, ref, out in zip(names, reference, got, strict=True):
            k = factors.get(name)
            if k is None:  # not a batched output: it must not change shape
                if out.shape != ref.shape:
                    return f"output '{name}' changes shape with the batch size ({ref.shape} -> {out.shape})"
                continue
            if out.shape[0] != k * rows:
                return f"output '{name}' has {out.shape[0]} rows at batch size {rows}, not {k * rows}"
            want, have = ref[: k * common], out[: k * common]
            if have.shape != want.shape or not np.allclose(have, want, rtol=1e-4, atol=1e-4):
                return f"output '{name}' rows change with the batch size (the graph mixes rows or hard-codes {batch})"
    return ""
