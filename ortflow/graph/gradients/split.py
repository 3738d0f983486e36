"""Replace ``Split`` nodes that have unused outputs by one ``Slice`` per used output.

The engine's gradient for a Split with an output nothing reads is WRONG, with only a log warning (docs/engine.md):
the gradient of the unused part is not zero-filled in the right place. ``torch.onnx.export`` writes such Splits for
``q, k, v = x.split(...)`` when one part is dropped, and for ``chunk``. A Slice per used output computes the same
values and its gradient is right. Splits whose outputs are all used are left alone.

Where the split sizes are static (the ``split`` attribute or input is a constant, or the axis length is known),
the Slice bounds are constants; otherwise they are computed in the graph (Shape/CumSum arithmetic on int64, which
needs no gradient).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper

from ortflow.graph.onnx_tools import (
    GraphError,
    Names,
    attribute,
    constant_values,
    consumed_names,
    infer_shapes,
    int64_constant,
    node_label,
    opset_version,
    report_change,
)


def _static_sizes(graph: onnx.GraphProto, node: onnx.NodeProto, opset: int, axis_len: int | None) -> list[int] | None:
    """Sizes of each part when they are known before running, else None."""
    count = len(node.output)
    if opset < 13 and attribute(node, "split"):
        return [int(s) for s in attribute(node, "split")]
    if opset >= 13 and len(node.input) > 1 and node.input[1]:
        values = constant_values(graph, node.input[1])
        return None if values is None else [int(s) for s in values.reshape(-1)]
    if axis_len is None:
        return None
    # Equal split; opset 18's num_outputs allows a short last part (ceil-sized chunks).
    chunk = -(-axis_len // count)
    return [min(chunk, max(axis_len - chunk * i, 0)) for i in range(count)]


def _axis_length(shapes: dict[str, onnx.TypeProto], name: str, axis: int) -> int | None:
    type_proto = shapes.get(name)
    if type_proto is None or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = type_proto.tensor_type.shape.dim
    if not -len(dims) <= axis < len(dims):
        return None
    dim = dims[axis]
    return int(dim.dim_value) if dim.HasField("dim_value") else None


def _dynamic_bounds(
    node: onnx.NodeProto, opset: int, axis: int, wanted: list[int], names: Names, nodes: list
) -> dict[int, tuple[str, str]]:
    """(start, end) tensor names of the ``wanted`` parts, computed in the graph."""
    base = node_label(node)
    count = len(node.output)

    def op(op_type: str, inputs: list[str], tag: str, **attrs) -> str:
        out = names.new(f"{base}/{tag}")
        nodes.append(helper.make_node(op_type, inputs, [out], name=names.new(f"{base}/{tag}/node"), **attrs))
        return out

    def const(tag: str, values: list[int]) -> str:
        const_node, out = int64_constant(names, f"{base}/{tag}", values)
        nodes.append(const_node)
        return out

    if opset >= 13 and len(node.input) > 1 and node.input[1]:  # sizes given by a computed tensor
        zero_node, zero = int64_constant(names, f"{base}/axis0", 0)
        nodes.append(zero_node)
        ends = op("CumSum", [node.input[1], zero], "ends")
        bounds = {}
        for i in wanted:
            first, after = const(f"part{i}", [i]), const(f"part{i}_next", [i + 1])
            end = op("Slice", [ends, first, after], f"end{i}")
            size = op("Slice", [node.input[1], first, after], f"size{i}")
            bounds[i] = (op("Sub", [end, size], f"start{i}"), end)
        return bounds
    dim = op("Gather", [op("Shape", [node.input[0]], "shape"), const("axis", [axis])], "dim")
    chunk = op("Div", [op("Add", [dim, const("count_minus_1", [count - 1])], "dim_up"), const("count", [count])],
               "chunk")
    return {i: (op("Mul", [chunk, const(f"k{i}", [i])], f"start{i}"),
                op("Mul", [chunk, const(f"k{i + 1}", [i + 1])], f"end{i}")) for i in wanted}


def split_to_slices(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Replace every default-domain Split with an unused output by Slices of its used outputs.

    Args:
        model: The model (left unchanged).
        report: When given, receives one entry describing the change.

    Returns:
        A new model; each replaced Split's used outputs keep their names.

    Raises:
        GraphError: A Split's sizes do not match its number of outputs.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    used = consumed_names(graph)
    splits = [n for n in graph.node if n.op_type == "Split" and n.domain in ("", "ai.onnx")
              and any(o not in used for o in n.output)]
    if not splits:
        return model
    opset = opset_version(model)
    if opset < 10:
        raise GraphError(
            f"Split '{node_label(splits[0])}' has unused outputs, whose gradients the engine gets wrong, and opset "
            f"{opset} has no Slice with tensor bounds to replace it; re-export the model with opset 17"
        )
    try:
        inferred = infer_shapes(model)
        shapes = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.input]}
    except Exception:  # noqa: BLE001 - shapes only let the bounds be constants; without them they are computed
        shapes = {v.name: v.type for v in graph.input}
    names = Names(graph)
    changes, new_nodes = [], []
    for node in graph.node:
        if node not in splits:
            new_nodes.append(node)
            continue
        axis = int(attribute(node, "axis", 0))
        wanted = [i for i, output in enumerate(node.output) if output and output in used]
        sizes = _static_sizes(graph, node, opset, _axis_length(shapes, node.input[0], axis))
        if sizes is not None and len(sizes) != len(node.output):
            raise GraphError(
                f"Split '{node_label(node)}' has {len(node.output)} outputs but {len(sizes)} split sizes; "
                "re-export the model (it is not valid ONNX)"
            )
        if sizes is not None:
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
            bounds = {}
            for i in wanted:
                c1, start = int64_constant(names, f"{node_label(node)}/start{i}", [starts[i]])
                c2, end = int64_constant(names, f"{node_label(node)}/end{i}", [starts[i] + sizes[i]])
                new_nodes += [c1, c2]
                bounds[i] = (start, end)
        else:
            bounds = _dynamic_bounds(node, opset, axis, wanted, names, new_nodes)
        axes_node, axes = int64_constant(names, f"{node_label(node)}/axes", [axis])
        new_nodes.append(axes_node)
        for i in wanted:
            new_nodes.append(helper.make_node("Slice", [node.input[0], *bounds[i], axes], [node.output[i]],
                                              name=names.new(f"{node_label(node)}/slice{i}")))
        changes.append(f"Split '{node_label(node)}' -> Slice of outputs {wanted} (of {len(node.output)}; the rest "
                       "unused)")
    del graph.node[:]
    graph.node.extend(new_nodes)
    report_change("split_to_slices", changes, report)
    return model
