"""Torch's ``padding_idx`` in the engine's training graph: the lookup gives its padding row no gradient.

``nn.Embedding(padding_idx=p)`` leaves row ``p`` out of the lookup's gradient in torch (the row still trains from any
other use, e.g. an LM head tied to the table); ONNX's ``Gather`` has no such argument, so the engine's gradient of the
lookup adds the gradient of every position whose id is ``p`` into row ``p``. :func:`mask_padding_rows` rewrites the
engine's training graph (after the engine generated it): the incoming gradient of each lookup's gradient node is set
to zero at the positions whose id is the padding row, so the lookup's other rows and the table's other uses keep their
gradients and the forward pass is unchanged.

The lookup's gradient node has one of two forms (onnxruntime-training 1.19.2): ``GatherGrad(Shape(W), ids, dY)``
(``Gather(W, ids)``: ``dY`` is ``ids``' shape plus the embedding axis) and ``GatherNDGrad(Shape(W), ids_nd, dY)``
(:mod:`ortflow.graph.gradients.embedding`'s ``GatherND(W, Unsqueeze(ids, -1))``: ``ids_nd`` already has the trailing
axis of 1 that broadcasts over the embedding axis). ``W`` is the table or a chain of ``Identity`` / ``Cast`` nodes
reading it (mixed precision). A tensor-parallel rank's vocabulary split (:mod:`ortflow.graph.tensor_parallel.
tensor_vocab`) reads its rows of the table with ids shifted into them, ids of other ranks' rows reading local row 0
with their gradient already zeroed: the row to mask there is the padding row's local index on the rank that holds it
(:func:`local_padding_rows`), and masking local row 0 there also zeroes what is zero already.
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import Names, attribute, int64_constant, opset_version, report_change

#: Name prefix of the nodes this pass adds.
PREFIX = "padding_rows/"
_GRADS = {"GatherGrad": "Gather", "GatherNDGrad": "GatherND"}


def local_padding_rows(rows: dict[str, int], slicing: dict[str, tuple[int, int]], table_rows: dict[str, int],
                       size: int, rank: int) -> dict[str, int]:
    """The padding rows of tensor-parallel rank ``rank`` of ``size``: a table split along its rows (the vocabulary)
    holds rows ``[rank * n, (rank + 1) * n)`` of the whole table's ``table_rows``, so its padding row is there only on
    the rank that holds it, shifted; a table not split along its rows keeps its row.

    Args:
        rows: Table -> its padding row in the whole model.
        slicing: The split's sliced parameters -> (axis, parts) (``TensorParallelPlan.slicing``).
        table_rows: Table -> its number of rows in the whole model.
        size: The tensor-parallel size.
        rank: The tensor-parallel rank.
    """
    out = {}
    for table, row in rows.items():
        if slicing.get(table, (None,))[0] != 0:
            out[table] = row
            continue
        share = table_rows[table] // size
        if rank * share <= row < (rank + 1) * share:
            out[table] = row - rank * share
    return out


def mask_padding_rows(model: onnx.ModelProto, rows: dict[str, int],
                      report: list[dict] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """Zero the lookup gradient of each table in ``rows`` at the positions whose id is its padding row.

    Args:
        model: The engine's training model (left unchanged); only node and value protos are read.
        rows: Table (a parameter's name in ``model``) -> its padding row in that table.
        report: When given, receives one entry listing the masked gradient nodes.

    Returns:
        The rewritten model, and one line per lookup of a table in ``rows`` whose gradient is none of the forms
        above (that lookup's gradient is left as the engine wrote it).
    """
    model = copy.deepcopy(model)
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    types = _declared_types(graph)
    names = Names(graph)
    new_opset = opset_version(model) >= 13  # Unsqueeze's axes: an input from opset 13, an attribute before
    lookups = {}  # (data, ids) of a lookup of a padding table -> (table, forward op)
    for node in graph.node:
        if node.op_type in _GRADS.values() and node.domain in ("", "ai.onnx"):
            table = _table(node.input[0], producer, rows)
            if table is not None and _reads_rows(node):
                lookups[(node.input[0], node.input[1])] = (table, node)
    changes, masked, nodes = [], set(), []
    for node in graph.node:
        shape = producer.get(node.input[0]) if node.op_type in _GRADS and len(node.input) == 3 else None
        key = (shape.input[0], node.input[1]) if shape is not None and shape.op_type == "Shape" else None
        if key not in lookups or lookups[key][1].op_type != _GRADS[node.op_type]:
            nodes.append(node)
            continue
        table, forward = lookups[key]
        dtype = _type(forward.input[0], producer, types)
        if dtype is None:
            nodes.append(node)
            continue
        nodes += _mask_nodes(node, rows[table], dtype, names, new_opset)
        nodes.append(node)
        masked.add(key)
        changes.append(f"{node.op_type} '{node.name}' of '{table}': no gradient from ids equal to {rows[table]}")
    unmasked = [f"{fwd.op_type} '{fwd.name}' of '{table}'" for key, (table, fwd) in lookups.items()
                if key not in masked and _trained(table, graph)]
    if changes:
        del graph.node[:]
        graph.node.extend(nodes)
    report_change("mask_padding_rows", changes, report)
    return model, unmasked


def _mask_nodes(grad: onnx.NodeProto, row: int, dtype: int, names: Names, new_opset: bool) -> list[onnx.NodeProto]:
    """``Where(ids == row, 0, dY)`` before ``grad`` (its ids get a trailing axis of 1 for a ``GatherGrad``), and
    ``grad`` reading it: ``Where`` leaves no trace of a padding position's gradient, a non-finite one included."""
    base = f"{PREFIX}{grad.name}"
    ids, dy = grad.input[1], grad.input[2]

    def make(op: str, inputs: list[str], **attrs) -> tuple[onnx.NodeProto, str]:
        out = names.new(f"{base}/{op.lower()}")
        return helper.make_node(op, inputs, [out], name=names.new(f"{base}/{op}"), **attrs), out

    row_node, row_name = int64_constant(names, f"{base}/row", row)
    # the zero in the gradient's own type, bfloat16 included (numpy has no bfloat16: onnx maps it to float32)
    zero_name = names.new(f"{base}/zero")
    zero_node = helper.make_node("Constant", [], [zero_name], name=names.new(f"{base}/zero_const"),
                                 value=helper.make_tensor(zero_name, dtype, [], [0]))
    cast, ids64 = make("Cast", [ids], to=onnx.TensorProto.INT64)
    equal, padding = make("Equal", [ids64, row_name])
    out = [row_node, zero_node, cast, equal]
    if grad.op_type == "GatherGrad":  # ids without the embedding axis: broadcast over it
        if new_opset:
            axes_node, axes = int64_constant(names, f"{base}/axes", [-1])
            unsqueeze, padding = make("Unsqueeze", [padding, axes])
            out += [axes_node, unsqueeze]
        else:
            unsqueeze, padding = make("Unsqueeze", [padding], axes=[-1])
            out.append(unsqueeze)
    where, masked = make("Where", [padding, zero_name, dy])
    grad.input[2] = masked
    return [*out, where]


def _table(name: str, producer: dict[str, onnx.NodeProto], rows: dict[str, int]) -> str | None:
    """The padding table ``name`` reads, directly or through ``Identity`` / ``Cast`` nodes; else None."""
    while name not in rows:
        node = producer.get(name)
        if node is None or node.op_type not in ("Identity", "Cast"):
            return None
        name = node.input[0]
    return name


def _reads_rows(node: onnx.NodeProto) -> bool:
    """Whether a lookup reads whole rows of its table: ``Gather`` on axis 0, ``GatherND`` without batch dims."""
    if node.op_type == "Gather":
        return attribute(node, "axis", 0) == 0
    return attribute(node, "batch_dims", 0) == 0


def _declared_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {t.name: t.data_type for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.tensor_type.elem_type:
            types.setdefault(value.name, value.type.tensor_type.elem_type)
    return types


def _type(name: str, producer: dict[str, onnx.NodeProto], types: dict[str, int]) -> int | None:
    """The element type of a lookup's data (the lookup's output and its gradient have it): declared, or a ``Cast``'s
    target, or what an ``Identity`` reads."""
    while name not in types:
        node = producer.get(name)
        if node is None or node.op_type not in ("Identity", "Cast"):
            return None
        if node.op_type == "Cast":
            return attribute(node, "to")
        name = node.input[0]
    return types[name]


def _trained(table: str, graph: onnx.GraphProto) -> bool:
    """Whether the engine computes the table's gradient (its ``<name>_grad`` output, or the accumulated one)."""
    return any(o.name in (f"{table}_grad", f"{table}_grad.accumulation.out") for o in graph.output)
