"""Read trained embedding tables with ``GatherND`` so that their gradient is repeatable on the CPU.

The engine differentiates ``Gather`` with its CPU ``GatherGrad`` kernel (onnxruntime-training 1.19.2,
``orttraining/training_ops/cpu/tensor/gather_grad.cc``): it zeroes the gradient, then a ``ThreadPool::TryParallelFor``
over every gradient element adds ``grad[g]`` into ``output[ids[g] * block + offset]`` under one global mutex. With more
than one intra-op thread the order in which repeated ids are summed follows thread timing, so two runs on the same
batches differ in the last bits (and every element takes the one lock). ``SessionOptions.use_deterministic_compute``
does not change that kernel.

``GatherND(W, Unsqueeze(ids, -1))`` reads the same rows of ``W`` (bit for bit), and the engine differentiates it with
``GatherNDGrad``, whose CPU kernel adds the rows in index order in one loop: repeatable at any thread count, and
faster than the locked loop (docs/reliability.md). This pass rewrites every ``Gather`` on
axis 0 whose data is a trained parameter, read directly or through ``Identity`` nodes (tied embeddings, exported
graphs); int32 ids are cast to int64 (GatherND reads only int64). Parameters, their names and every other node stay
as they were. :func:`restore_gathers` turns the rewrite back into the user's ``Gather`` for export.
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import Names, elem_types, int64_constant, node_label, opset_version, report_change

#: Name prefix and doc_string mark of the nodes this pass adds (restore_gathers finds them by both).
PREFIX = "embedding/"
MARK = "embedding: deterministic gather"

#: The first opset with GatherND's batch_dims attribute (the engine's gradient builder requires it).
MIN_OPSET = 12


def deterministic_gathers(
    model: onnx.ModelProto, trainable: set[str], report: list[dict] | None = None
) -> onnx.ModelProto:
    """Replace each axis-0 ``Gather`` of a trained parameter by ``GatherND`` on the unsqueezed ids.

    Args:
        model: The model (left unchanged); initializers need only name, type and dims.
        trainable: Names of the parameters the engine differentiates.
        report: When given, receives one entry listing the rewritten nodes.

    Returns:
        A new model; the Gather outputs keep their names, so readers are untouched.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    if opset_version(model) < MIN_OPSET:
        return model
    dims = {t.name: len(t.dims) for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    types = None
    names = Names(graph)
    changes, nodes = [], []
    for node in graph.node:
        param = _parameter(node.input[0], producer, trainable) if node.op_type == "Gather" else None
        if param is None or _axis(node, dims[param]) != 0:
            nodes.append(node)
            continue
        types = types if types is not None else elem_types(model)
        label = node_label(node)
        ids = node.input[1]
        if types.get(ids) != onnx.TensorProto.INT64:
            cast = names.new(f"{PREFIX}{label}/ids64")
            nodes.append(_marked("Cast", [ids], [cast], names, label, to=onnx.TensorProto.INT64))
            ids = cast
        axes_node, axes = int64_constant(names, f"{PREFIX}{label}/axes", [-1])
        axes_node.doc_string = MARK
        axes_node.name = names.new(f"{PREFIX}{label}/axes_const")
        unsqueezed = names.new(f"{PREFIX}{label}/ids_nd")
        nodes += [axes_node, _marked("Unsqueeze", [ids, axes], [unsqueezed], names, label)]
        nodes.append(_marked("GatherND", [node.input[0], unsqueezed], list(node.output), names, label, batch_dims=0))
        changes.append(f"Gather '{label}' of parameter '{param}' -> GatherND (repeatable CPU gradient)")
    if changes:
        del graph.node[:]
        graph.node.extend(nodes)
    report_change("deterministic_gathers", changes, report)
    return model


def restore_gathers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Undo :func:`deterministic_gathers` (also on the engine's eval graph): each marked GatherND back to a Gather.

    The Gather reads the original ids again and the added Cast, Constant and Unsqueeze nodes are dropped (nothing
    else reads them). A model without marked nodes comes back as an equal copy.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    marked = {out: node for node in graph.node if _is_marked(node) for out in node.output}
    kept = []
    for node in graph.node:
        if not _is_marked(node):
            kept.append(node)
        elif node.op_type == "GatherND":
            ids = node.input[1]
            while ids in marked and marked[ids].op_type in ("Unsqueeze", "Cast"):
                ids = marked[ids].input[0]
            name = node.name.removeprefix(PREFIX)
            kept.append(helper.make_node("Gather", [node.input[0], ids], list(node.output), name=name, axis=0))
    del graph.node[:]
    graph.node.extend(kept)
    return result


def _parameter(name: str, producer: dict[str, onnx.NodeProto], trainable: set[str]) -> str | None:
    """The trained parameter ``name`` is, directly or through a chain of Identity nodes; else None."""
    while name not in trainable:
        node = producer.get(name)
        if node is None or node.op_type != "Identity":
            return None
        name = node.input[0]
    return name


def _axis(node: onnx.NodeProto, rank: int) -> int:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return axis + rank if axis < 0 else axis


def _marked(op: str, inputs: list[str], outputs: list[str], names: Names, label: str, **attrs) -> onnx.NodeProto:
    """A node this pass adds: the GatherND is named after the Gather it replaces (restore_gathers gives it back)."""
    name = names.new(f"{PREFIX}{label}" if op == "GatherND" else f"{PREFIX}{label}/{op.lower()}")
    return helper.make_node(op, inputs, outputs, name=name, doc_string=MARK, **attrs)


def _is_marked(node: onnx.NodeProto) -> bool:
    return node.name.startswith(PREFIX) and node.doc_string == MARK
