"""What every pass shares: the error type, name bookkeeping, small node builders and the one-line change log."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger("ortflow.graph")


class GraphError(ValueError):
    """The model holds something the engine cannot train; the message names the node, the op and a fix."""


FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                         onnx.TensorProto.BFLOAT16})


#: Initializer bytes held in a proto from which shape inference runs on a copy without them: protobuf serialises at
#: most 2 GiB, and a tensor-parallel rank's model of a model past 2 GB holds its slices of every split weight.
INFERENCE_HELD_BYTES = 2**30
#: Initializers of at most this many values keep them in that copy (shape constants the inference may read).
_INFERENCE_CONSTANTS = 64


def infer_shapes(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    """onnx's shape inference (``kwargs`` as onnx's), for reading the inferred types and shapes: a model whose
    initializers hold ``INFERENCE_HELD_BYTES`` or more is inferred on a copy whose larger initializers keep their name,
    type and dims but no values, so the result may hold no weight values."""
    if _held_bytes(model) < INFERENCE_HELD_BYTES:
        return onnx.shape_inference.infer_shapes(model, **kwargs)
    return onnx.shape_inference.infer_shapes(dims_only(model, _INFERENCE_CONSTANTS), **kwargs)


def dims_only(model: onnx.ModelProto, keep_elements: int = 0) -> onnx.ModelProto:
    """A copy for shape inference: the graph, and initializers of more than ``keep_elements`` values as their name,
    type and dims only (no values copied)."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    for field in ("node", "input", "output", "value_info"):
        getattr(light.graph, field).extend(getattr(model.graph, field))
    for tensor in model.graph.initializer:
        if int(np.prod(tensor.dims, dtype=np.int64)) <= keep_elements:
            light.graph.initializer.append(tensor)
        else:
            light.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    return light


def _held_bytes(model: onnx.ModelProto) -> int:
    """Bytes of initializer values held in the proto (not in external data)."""
    return sum(len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data)
               + len(t.double_data) + len(t.uint64_data)) for t in model.graph.initializer)


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor shape inference can tell (initializers included); others are absent."""
    try:
        graph = infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - onnx raises several types; callers treat unknown types conservatively
        graph = model.graph
    values = [*graph.value_info, *graph.input, *graph.output]
    types = {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name``, or ``default`` where the node has none."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def node_label(node: onnx.NodeProto) -> str:
    """How errors and logs name a node: its name, else its first output."""
    return node.name or (node.output[0] if node.output else node.op_type)


def opset_version(model: onnx.ModelProto) -> int:
    """The model's version of the default ONNX domain."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Every name read inside a node's subgraphs (If/Loop/Scan bodies may read outer-scope tensors)."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for graph in graphs:
            for inner in graph.node:
                names.update(inner.input)
                names |= subgraph_reads(inner)
    return names


def upstream(graph: onnx.GraphProto, outputs: list[str]) -> tuple[set[str], list[int]]:
    """What ``outputs`` are computed from: every tensor name they read (graph inputs and initializers included) and the
    indices of the nodes that compute them, in the graph's order; one walk back, linear in the graph's size."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    needed: set[str] = set()
    keep: set[int] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        index = producer.get(name)
        if index is not None and index not in keep:
            keep.add(index)
            node = graph.node[index]
            stack.extend([n for n in node.input if n] + sorted(subgraph_reads(node)))
    return needed, sorted(keep)


def consumed_names(graph: onnx.GraphProto) -> set[str]:
    """Tensors that some node reads (subgraphs included) or that the graph outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(n for n in node.input if n)
        used |= subgraph_reads(node)
    return used


class Names:
    """Hands out tensor and node names that the graph does not use yet."""

    def __init__(self, graph: onnx.GraphProto):
        self._taken = {i.name for i in graph.input} | {o.name for o in graph.output}
        self._taken |= {t.name for t in graph.initializer} | {v.name for v in graph.value_info}
        for node in graph.node:
            self._taken.update(node.input)
            self._taken.update(node.output)
            self._taken.add(node.name)

    def new(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``, ... whichever is free; the name is then taken."""
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name


def int64_constant(names: Names, base: str, values: list[int] | int) -> tuple[onnx.NodeProto, str]:
    """A Constant node holding int64 ``values`` (a list: 1-D, an int: a scalar); not an initializer, so nothing new
    can become a parameter."""
    out = names.new(base)
    tensor = numpy_helper.from_array(np.asarray(values, dtype=np.int64), out)
    return helper.make_node("Constant", [], [out], name=names.new(f"{base}/const"), value=tensor), out


def holds_values(tensor: onnx.TensorProto) -> bool:
    """Whether a tensor carries its values in the proto (not external data, not a skeleton's name-and-dims stub)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    size = int(np.prod(tensor.dims, dtype=np.int64))
    stored = (tensor.raw_data, tensor.float_data, tensor.int32_data, tensor.int64_data, tensor.double_data,
              tensor.uint64_data, tensor.string_data)
    return size == 0 or any(len(x) for x in stored)


def constant_values(graph: onnx.GraphProto, name: str, producers: dict[str, int] | None = None) -> np.ndarray | None:
    """The value of ``name`` when it is an initializer or a Constant node's ``value``, else None (also for an
    initializer whose values are not in the proto: external data, or a weight of the passes' skeleton).

    ``producers`` (tensor -> index of the node that makes it), where the caller holds them, answers for a tensor a
    node makes without a scan of the graph: in a graph in single static assignment form (as onnx and the engine require)
    a tensor is made by one node or is an initializer, never both.
    """
    if producers is not None and name in producers:
        return _constant_node_values(graph.node[producers[name]])
    for tensor in graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor) if holds_values(tensor) else None
    if producers is not None:  # made by no node
        return None
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            return _constant_node_values(node)
    return None


def _constant_node_values(node: onnx.NodeProto) -> np.ndarray | None:
    """A Constant node's ``value`` (``value_ints``, ``value_int``); None for any other node."""
    if node.op_type != "Constant":
        return None
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_ints":
            return np.asarray(list(attr.ints), dtype=np.int64)
        if attr.name == "value_int":
            return np.asarray(attr.i, dtype=np.int64)
    return None


def report_change(pass_name: str, lines: list[str], report: list[dict] | None) -> None:
    """Log once what a pass changed (one summary line, details at debug); add ``{"pass", "changes"}`` to ``report``."""
    if not lines:
        return
    shown = "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")
    summary = f"{pass_name}: {len(lines)} change(s): {shown}"
    log.info("%s", summary)
    for line in lines:
        log.debug("%s: %s", pass_name, line)
    if report is not None:
        report.append({"pass": pass_name, "changes": list(lines)})
