"""What the tensor-parallel split reads off a graph's shape arithmetic: which constant holds an entry of a computed
shape (so a head count or a width can be rewritten for the local size), and which trained weight a MatMul reads."""

from __future__ import annotations

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import constant_values

_CANNOT = "the new shape is computed in a way the split cannot follow"


def shape_entry(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], reader: int, pos: int,
                element: int, depth: int = 0):
    """The constant that holds element ``element`` of input ``pos`` of node ``reader``, followed back through the
    shape arithmetic exports write (Concat, Unsqueeze, Squeeze, Gather and Slice of 1-D int tensors, Cast):
    (the node reading the constant, its input, the element, the value), or why the split cannot follow it.

    Args:
        graph: The graph.
        shapes: Every tensor's dims (None where not fixed).
        producers: Tensor name -> index of the node that makes it.
        reader: The node reading the shape (a Reshape, or a node on the way back).
        pos: Which of its inputs.
        element: Which element of that input (flat).
        depth: How many nodes were followed back so far.
    """
    name = graph.node[reader].input[pos]
    values = constant_values(graph, name)
    if values is not None:
        flat = values.reshape(-1)
        if element >= flat.size:
            return _CANNOT
        return reader, pos, element, int(flat[element])
    producer = producers.get(name)
    if producer is None or depth > 12:
        return "the new shape's split entry is computed, not a Constant"
    node = graph.node[producer]
    if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        return shape_entry(graph, shapes, producers, producer, 0, element, depth + 1)
    if node.op_type == "Concat":
        at = 0
        for k, part in enumerate(node.input):
            dims = shapes.get(part)
            if dims is None or len(dims) > 1 or None in dims:
                return _CANNOT
            length = dims[0] if dims else 1
            if at <= element < at + length:
                return shape_entry(graph, shapes, producers, producer, k, element - at, depth + 1)
            at += length
        return _CANNOT
    if node.op_type in ("Gather", "Slice"):
        index = _index_in(graph, shapes, node, element)
        if isinstance(index, str):
            return index
        return shape_entry(graph, shapes, producers, producer, 0, index, depth + 1)
    return "the new shape's split entry is computed, not a Constant"


def _index_in(graph: onnx.GraphProto, shapes: dict[str, list], node: onnx.NodeProto, element: int) -> int | str:
    """For a Gather (axis 0, constant index) or Slice (constant start, axis 0, step 1) of a 1-D tensor: which element
    of its input its ``element`` is."""
    dims = shapes.get(node.input[0])
    if dims is None or len(dims) != 1 or dims[0] is None:
        return _CANNOT
    length = dims[0]
    if node.op_type == "Gather":
        index = constant_values(graph, node.input[1])
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if index is None or index.size != 1 or axis != 0:
            return _CANNOT
        return int(index.reshape(-1)[0]) % length
    start, _, axes, steps = [constant_values(graph, x) if x else None for x in [*node.input[1:5], "", "", ""][:4]]
    if (start is None or start.size != 1 or (axes is not None and axes.reshape(-1).tolist() not in ([0], [-1]))
            or (steps is not None and steps.reshape(-1).tolist() != [1])):
        return _CANNOT
    first = int(start.reshape(-1)[0])
    return (first + length if first < 0 else first) + element


def weight_of(graph: onnx.GraphProto, name: str, trainable: set[str]) -> tuple[str, bool] | None:
    """The trained 2-D weight a MatMul reads as ``name``: the initializer itself, or (torch's ``nn.Linear`` on 3-D
    inputs) ``Transpose(W)`` of a ``[out, in]`` weight ``W`` whose only reader is that Transpose, read once; with
    whether it is read transposed. None otherwise."""
    if name in trainable:
        return name, False
    maker = next((n for n in graph.node if name in n.output), None)
    if maker is None or maker.op_type != "Transpose" or maker.input[0] not in trainable:
        return None
    perm = next((list(a.ints) for a in maker.attribute if a.name == "perm"), [1, 0])
    readers = [n for n in graph.node if name in n.input or maker.input[0] in n.input]
    if perm != [1, 0] or len(readers) != 2:
        return None
    return maker.input[0], True
