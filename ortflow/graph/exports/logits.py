"""Flatten ``[B, T, V]`` logits (and ``[B, T]`` labels) for the engine's cross-entropy loss, inside the graph.

The engine's ``SoftmaxCrossEntropyLoss`` takes scores ``[N, C]`` (classes on axis 1), so an LM's ``[B, T, V]``
logits would be read as T classes. This pass adds, beside the model's own output (which keeps its name and shape,
so the eval graph and the exported model still have it):

* ``Reshape(logits, [-1, V])`` -> ``<logits>.flat``, a new graph output the loss reads;
* the label input ``[B, T]`` int64 (the logits' shape without the class axis; the data stage batches [T]-rows into
  it), and ``Reshape(labels, [-1])`` -> ``<labels>.flat``.

The loss is the mean over all B*T positions, the same number as on pre-flattened logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import GraphError, Names, infer_shapes, int64_constant, report_change


@dataclass(frozen=True)
class FlatNames:
    """The tensors the loss reads after :func:`flatten_logits`."""

    scores: str
    labels: str


def output_rank(model: onnx.ModelProto, output: str) -> int | None:
    """The rank of a graph output: declared, else from shape inference; None when unknown."""
    declared = next((o for o in model.graph.output if o.name == output), None)
    if declared is not None and declared.type.tensor_type.HasField("shape"):
        return len(declared.type.tensor_type.shape.dim)
    try:
        inferred = infer_shapes(model)
    except Exception:  # noqa: BLE001 - onnx raises several types; an unknown rank is handled by the caller
        return None
    found = next((o for o in [*inferred.graph.output, *inferred.graph.value_info] if o.name == output), None)
    if found is None or not found.type.tensor_type.HasField("shape"):
        return None
    return len(found.type.tensor_type.shape.dim)


def _scores_type(model: onnx.ModelProto, output: str) -> onnx.TypeProto | None:
    declared = next((o for o in model.graph.output if o.name == output), None)
    if declared is not None and declared.type.tensor_type.HasField("shape"):
        return declared.type
    try:
        inferred = infer_shapes(model)
    except Exception:  # noqa: BLE001
        return None
    found = next((o for o in [*inferred.graph.output, *inferred.graph.value_info] if o.name == output), None)
    return None if found is None else found.type


def flatten_logits(
    model: onnx.ModelProto, output: str, label: str, report: list[dict] | None = None
) -> tuple[onnx.ModelProto, FlatNames]:
    """Add the flattened scores and labels for a cross-entropy loss on an output of rank 3 or more.

    Args:
        model: The model (left unchanged).
        output: The logits output, ``[B, T, ..., V]``.
        label: Name of the label input; declared ``[B, T, ...]`` int64 when the model lacks it.
        report: When given, receives one entry describing the change.

    Returns:
        The new model and the names the loss must read; for an output of rank 2 or less (or unknown rank), the
        model unchanged and the names given.

    Raises:
        GraphError: The model already has a label input whose rank does not match the logits.
    """
    type_proto = _scores_type(model, output)
    if type_proto is None or len(type_proto.tensor_type.shape.dim) < 3:
        return model, FlatNames(output, label)
    model = copy.deepcopy(model)
    graph = model.graph
    dims = list(type_proto.tensor_type.shape.dim)
    existing = next((i for i in graph.input if i.name == label), None)
    if existing is not None:
        rank = len(existing.type.tensor_type.shape.dim)
        if existing.type.tensor_type.HasField("shape") and rank not in (1, len(dims) - 1):
            raise GraphError(
                f"model.label_input: the model's input '{label}' has {rank} dims but the logits '{output}' have "
                f"{len(dims)}: labels must be the logits' shape without the class axis ({len(dims) - 1} dims)"
            )
    else:
        label_info = helper.make_tensor_value_info(label, onnx.TensorProto.INT64, None)
        for dim in dims[:-1]:
            label_info.type.tensor_type.shape.dim.add().CopyFrom(dim)
        graph.input.append(label_info)
    names = Names(graph)
    classes = dims[-1].dim_value if dims[-1].HasField("dim_value") else None
    nodes = []
    if classes:
        shape_node, shape = int64_constant(names, f"{output}.flat_shape", [-1, classes])
        nodes.append(shape_node)
    else:  # V only known at run time: [-1] ++ Shape(logits)[-1:]
        lead_node, lead = int64_constant(names, f"{output}.flat_lead", [-1])
        start_node, start = int64_constant(names, f"{output}.last_axis", [-1])
        end_node, end = int64_constant(names, f"{output}.last_axis_end", [2**62])
        shape_of, classes_dim = names.new(f"{output}.shape"), names.new(f"{output}.classes")
        shape = names.new(f"{output}.flat_shape")
        nodes += [lead_node, start_node, end_node,
                  helper.make_node("Shape", [output], [shape_of], name=names.new(f"{shape_of}/node")),
                  helper.make_node("Slice", [shape_of, start, end], [classes_dim],
                                   name=names.new(f"{classes_dim}/node")),
                  helper.make_node("Concat", [lead, classes_dim], [shape], name=names.new(f"{shape}/node"), axis=0)]
    flat = FlatNames(names.new(f"{output}.flat"), names.new(f"{label}.flat"))
    label_shape_node, label_shape = int64_constant(names, f"{label}.flat_shape", [-1])
    nodes += [
        helper.make_node("Reshape", [output, shape], [flat.scores], name=names.new(f"{flat.scores}/reshape")),
        label_shape_node,
        helper.make_node("Reshape", [label, label_shape], [flat.labels], name=names.new(f"{flat.labels}/reshape")),
    ]
    graph.node.extend(nodes)
    flat_info = helper.make_tensor_value_info(flat.scores, type_proto.tensor_type.elem_type, None)
    flat_info.type.tensor_type.shape.dim.add()
    flat_info.type.tensor_type.shape.dim.add().CopyFrom(dims[-1])
    graph.output.append(flat_info)
    shape_text = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
    report_change("flatten_logits", [
        f"cross_entropy on '{output}' {shape_text}: the loss reads Reshape -> '{flat.scores}' [N, {shape_text[-1]}] "
        f"and labels '{label}' {shape_text[:-1]} -> '{flat.labels}' [N]; '{output}' itself is kept"
    ], report)
    return model, flat
