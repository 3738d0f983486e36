"""Fold the integer constant arithmetic an exporter leaves in the graph into ``Constant`` nodes.

``torch.onnx.export(..., dynamo=True, optimize=False)`` writes the axes of a ``ReduceMean`` (Llama's RMSNorm), the
target shapes of ``Reshape`` and similar small int64 tensors as ``Reshape``/``Concat``/``Cast`` of ``Constant``
nodes. ONNX's shape inference does not evaluate them, so it cannot tell the rank of what they feed, and the
tensor-parallel and pipeline splits, which type every tensor they pass between pieces, lose the shape there. Each node
whose inputs are all constants and whose outputs are small integer tensors is evaluated once (onnx's reference
implementation) and replaced by ``Constant`` nodes of its values. Float values are never folded: no computed value
changes, and nothing becomes an initializer.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ortflow.graph.onnx_tools import constant_values, report_change

#: Integer results of at most this many values are folded.
MAX_ELEMENTS = 64
_INTS = (np.int64, np.int32)


def fold_int_constants(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``model`` with every node of constant int inputs and small int outputs replaced by Constant nodes (a copy).

    Args:
        model: The model (left unchanged); weights may be absent (only small constants are read).
        report: Receives ``{"pass": "fold_int_constants", "changes": [...]}`` when something was folded.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    known: dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        value = constant_values(graph, tensor.name)
        if value is not None and value.size <= MAX_ELEMENTS:
            known[tensor.name] = value
    rebuilt, folded = [], 0
    for node in graph.node:
        values = _evaluate(node, known)
        if values is None:
            rebuilt.append(node)
            continue
        known.update(values)
        if node.op_type == "Constant":
            rebuilt.append(node)
            continue
        folded += 1
        rebuilt += [helper.make_node("Constant", [], [name], name=f"{name}/folded",
                                     value=numpy_helper.from_array(np.asarray(v), name)) for name, v in values.items()]
    if folded:
        del graph.node[:]
        graph.node.extend(rebuilt)
        report_change("fold_int_constants", [f"{folded} integer constant node(s) folded"], report)
    return out


def _evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The node's outputs when its inputs are known constants and its outputs small integer tensors, else None."""
    if node.domain not in ("", "ai.onnx") or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
        return None
    if node.op_type == "Constant":
        attr = next(iter(node.attribute), None)
        if attr is None or attr.name not in ("value", "value_int", "value_ints"):
            return None
        value = numpy_helper.to_array(attr.t) if attr.name == "value" else np.asarray(
            attr.i if attr.name == "value_int" else list(attr.ints), dtype=np.int64)
        return None if value.size > MAX_ELEMENTS else {node.output[0]: value}
    inputs = [i for i in node.input if i]
    if not inputs or any(i not in known for i in inputs) or node.op_type in ("RandomNormalLike", "RandomUniformLike"):
        return None
    try:
        results = ReferenceEvaluator(node).run(None, {i: known[i] for i in inputs})
    except Exception:  # noqa: BLE001 - an op the reference cannot run is left in the graph
        return None
    if any(not isinstance(r, np.ndarray) or r.dtype.type not in _INTS or r.size > MAX_ELEMENTS for r in results):
        return None
    return dict(zip(node.output, results, strict=False))
