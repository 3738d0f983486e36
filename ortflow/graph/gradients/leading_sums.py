"""Sums over leading axes as a MatMul with a ones vector: the same sums, deterministic and fast on CUDA.

The engine's gradient builder differentiates a broadcasting ``Add``/``Sub``/``Mul`` (a bias added to ``[B, T, C]``
activations) and ``Gemm``'s ``C`` input with a ``ReduceSum`` over the leading axes (``HandleBroadcasting`` in
``orttraining/core/graph/gradient_builder_base.cc``: constant axes, ``keepdims`` 0 or 1, often followed by a Reshape).
onnxruntime 1.19.2's CUDA ``ReduceSum`` (``core/providers/cuda/reduction/reduction_ops.cc``) takes its fast
row-reduction path only when ``SessionOptions.use_deterministic_compute`` is off
(``fast_reduction_ && !ctx->GetUseDeterministicCompute()``); otherwise it calls cuDNN's ``cudnnReduceTensor``, which
on the 97.8M bench GPT costs 10.9 ms per forward+backward in fp16 instead of 2.7 ms
(measured on an H200).

This pass rewrites each such reduction of a tensor ``X`` of shape ``[d0 .. dk-1, c0 .. cm-1]`` over axes
``0 .. k-1`` (trailing dims known) into::

    X2 = Reshape(X, [-1, C])            # C = c0 x .. x cm-1; N = d0 x .. x dk-1
    Y2 = MatMul(ones[1, N], X2)         # [1, C]: one GEMM (cuBLAS: the same bits every run)
    Y  = Reshape(Y2, Y's shape)         # under the ReduceSum's own output name

in the reduction's element type (fp32, fp16 or bf16: cuBLAS accumulates fp16/bf16 in fp32, as the reduction did).
``ones`` is a Constant when N is known, else ``Expand`` of a one to ``[1, N]`` read from ``Shape(X2)``; reductions
with the same leading dims and type share one. Output names, types and shapes stay exactly as they were, so the
engine's parameter and gradient names are untouched. Left alone, with the reason logged: reductions over other axes
(not a leading run, or every axis), axes known only at run time (``ReduceSumTraining`` after
``BroadcastGradientArgs``), inputs of unknown rank, unknown trailing dims, and non-float types.

Applied by configure to the engine's *training* models (the whole model's, each pipeline stage's and each
tensor-parallel piece's: :mod:`ortflow.configure.training_graph`) on ``device: cuda`` with
``distributed.deterministic_compute`` and ``distributed.reduce_sum_as_matmul`` (default on), and by a stage's or
piece's rank to the gradient graph of its forward-once calls (:mod:`ortflow.trainer.parallel.kept_activations`). That
graph may declare fewer shapes than a training model: onnx's shape inference fills in what it can, and a sum whose
input's rank or kept dims stay unknown is left as it is (the reasons above).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortflow.graph.onnx_tools import (
    Names,
    constant_values,
    infer_shapes,
    int64_constant,
    log,
    node_label,
    opset_version,
    report_change,
    subgraph_reads,
)  # fmt: skip

#: Name prefix and doc_string of the nodes this pass adds.
PREFIX = "leading_sum/"
MARK = "leading_sum: ReduceSum over leading axes as MatMul with ones"
_TYPES = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}

Shape = tuple  # dims: int (known), str (symbolic) or None (unknown)


@dataclass
class LeadingSumReport:
    """What :func:`sums_as_matmul` did: the rewritten reductions and, for each one left alone, why."""

    rewritten: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """What the pass did, in the words of configure's and the ranks' logs."""
        total = len(self.rewritten) + len(self.kept)
        return (f"{len(self.rewritten)} of {total} ReduceSum node(s) rewritten as MatMul with ones "
                f"(distributed.reduce_sum_as_matmul; {len(self.kept)} kept)")


@dataclass(frozen=True)
class _Plan:
    node: onnx.NodeProto
    dtype: int
    lead: Shape  # the summed dims
    trail: tuple[int, ...]  # the kept dims, all known
    keepdims: bool


def sums_as_matmul(
    model: onnx.ModelProto, report: list[dict] | None = None, details: LeadingSumReport | None = None
) -> onnx.ModelProto:
    """Replace every ``ReduceSum`` over a leading run of axes by a MatMul with a ones vector (module docstring).

    Args:
        model: The engine's training model (left unchanged).
        report: When given, receives one ``{"pass", "changes"}`` entry (as the other passes).
        details: When given, filled with the rewritten node names and the reason each other reduction was kept.

    Returns:
        A new model computing the same outputs under the same names.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    details = details if details is not None else LeadingSumReport()
    shapes, types = _shapes(model)
    names, opset = Names(graph), opset_version(model)
    ones: dict[tuple, str] = {}
    nodes, changes, replaced_axes = [], [], []
    for node in graph.node:
        plan = _plan(graph, node, opset, shapes, types, details) if _is_sum(node) else None
        if plan is None:
            nodes.append(node)
            continue
        label = node_label(node)
        nodes += _rewrite(plan, names, ones, label)
        replaced_axes.append(node.input[1] if len(node.input) > 1 else "")
        details.rewritten.append(label)
        changes.append(f"{node.op_type} '{label}' over axes 0..{len(plan.lead) - 1} of "
                       f"{list(plan.lead) + list(plan.trail)} ({_TYPES[plan.dtype]}) -> MatMul with ones")  # fmt: skip
    if changes:
        del graph.node[:]
        graph.node.extend(nodes)
        _drop_unread_axes(graph, {p for p in replaced_axes if p})
    report_change("sums_as_matmul", changes, report)
    for label, why in details.kept.items():
        log.info("sums_as_matmul: kept '%s': %s", label, why)
    return model


def _drop_unread_axes(graph: onnx.GraphProto, axes: set[str]) -> None:
    """Remove the axes tensors (initializers or Constant nodes) that only the replaced reductions read."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    read |= {name for node in graph.node for name in subgraph_reads(node)}
    unread = axes - read
    kept_nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in unread)]
    kept_inits = [t for t in graph.initializer if t.name not in unread]
    if len(kept_nodes) < len(graph.node):
        del graph.node[:]
        graph.node.extend(kept_nodes)
    if len(kept_inits) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)


def _is_sum(node: onnx.NodeProto) -> bool:
    return node.op_type == "ReduceSum" or (node.op_type == "ReduceSumTraining" and node.domain == "com.microsoft")


def _shapes(model: onnx.ModelProto) -> tuple[dict[str, Shape], dict[str, int]]:
    """Shape and element type of every tensor the graph or onnx's shape inference declares."""
    graph = model.graph
    values = [*graph.value_info, *graph.input, *graph.output]
    try:  # the engine's graph declares most value_info itself; inference fills in what it can (unknown ops skipped)
        values += list(infer_shapes(model).graph.value_info)
    except Exception:  # noqa: BLE001 - onnx raises several types; unknown shapes only mean fewer rewrites
        pass
    shapes: dict[str, Shape] = {}
    types: dict[str, int] = {}
    for v in values:
        t = v.type.tensor_type
        if t.elem_type:
            types.setdefault(v.name, t.elem_type)
        if t.HasField("shape") and v.name not in shapes:
            shapes[v.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim
            )
    for t in graph.initializer:
        shapes[t.name], types[t.name] = tuple(t.dims), t.data_type
    return shapes, types


def _axes(graph: onnx.GraphProto, node: onnx.NodeProto, opset: int) -> list[int] | None:
    """The reduction's axes when fixed in the graph (attribute or constant input); [] for none; None if run-time."""
    attr = next((a for a in node.attribute if a.name == "axes"), None)
    if node.op_type == "ReduceSum" and opset < 13:
        return list(attr.ints) if attr is not None else []
    if len(node.input) < 2 or not node.input[1]:
        return []
    value = constant_values(graph, node.input[1])
    return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _plan(graph, node, opset, shapes, types, details: LeadingSumReport) -> _Plan | None:
    """The rewrite of ``node``, or None with the reason recorded in ``details.kept``."""
    label, x = node_label(node), node.input[0]
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    axes, shape, dtype = _axes(graph, node, opset), shapes.get(x), types.get(x)
    why = None
    if dtype not in _TYPES:
        why = f"element type {onnx.TensorProto.DataType.Name(dtype) if dtype else 'unknown'} (fp32/fp16/bf16 only)"
    elif axes is None:
        why = "axes known only at run time"
    elif shape is None:
        why = "input rank unknown"
    elif not axes:
        why = "no axes (a copy with noop_with_empty_axes, else a sum of every element)"
    if why is None:
        rank = len(shape)
        normal = sorted(a + rank if a < 0 else a for a in axes)
        k = len(normal)
        if normal != list(range(k)) or k >= rank:
            why = f"axes {axes} of a rank-{rank} input are not a leading run that keeps a dim"
        elif any(not isinstance(d, int) or d <= 0 for d in shape[k:]):
            why = f"kept dims {list(shape[k:])} not all known"
    if why is not None:
        details.kept[label] = why
        return None
    return _Plan(node, dtype, tuple(shape[:k]), tuple(shape[k:]), bool(attrs.get("keepdims", 1)))


def _one(dtype: int, dims: list[int], name: str) -> onnx.TensorProto:
    count = int(np.prod(dims, dtype=np.int64))
    return helper.make_tensor(name, dtype, dims, [1.0] * count)


def _ones(plan: _Plan, x2: str, names: Names, ones: dict[tuple, str], label: str) -> tuple[list, str]:
    """The ``[1, N]`` ones of ``plan`` (made once per leading dims and type), with the nodes that make it."""
    known = all(isinstance(d, int) for d in plan.lead)
    key = (plan.lead, plan.dtype) if all(d is not None for d in plan.lead) else (label, plan.dtype)
    if key in ones:
        return [], ones[key]
    out = names.new(f"{PREFIX}ones_{_TYPES[plan.dtype]}")
    if known:
        n = int(np.prod(plan.lead, dtype=np.int64))
        nodes = [helper.make_node("Constant", [], [out], name=names.new(f"{out}/const"), doc_string=MARK,
                                  value=_one(plan.dtype, [1, n], out))]  # fmt: skip
    else:  # N from the reshaped gradient's shape at run time: Expand(1, [1, N])
        base = f"{PREFIX}{label}"
        shape, n = names.new(f"{base}/shape"), names.new(f"{base}/n")
        start, s_name = int64_constant(names, f"{base}/start", [0])
        stop, e_name = int64_constant(names, f"{base}/stop", [1])
        one_dim, o_name = int64_constant(names, f"{base}/one", [1])
        target, scalar = names.new(f"{base}/ones_shape"), names.new(f"{base}/one_value")
        nodes = [start, stop, one_dim,
                 helper.make_node("Shape", [x2], [shape], name=names.new(f"{base}/shape_op"), doc_string=MARK),
                 helper.make_node("Slice", [shape, s_name, e_name], [n], name=names.new(f"{base}/slice"),
                                  doc_string=MARK),
                 helper.make_node("Concat", [o_name, n], [target], name=names.new(f"{base}/concat"), axis=0,
                                  doc_string=MARK),
                 helper.make_node("Constant", [], [scalar], name=names.new(f"{base}/one_const"), doc_string=MARK,
                                  value=_one(plan.dtype, [1, 1], scalar)),
                 helper.make_node("Expand", [scalar, target], [out], name=names.new(f"{base}/expand"),
                                  doc_string=MARK)]  # fmt: skip
        for const in nodes[:3]:
            const.doc_string = MARK
    ones[key] = out
    return nodes, out


def _rewrite(plan: _Plan, names: Names, ones: dict[tuple, str], label: str) -> list[onnx.NodeProto]:
    """Reshape -> MatMul(ones, .) -> Reshape, the last under the reduction's output name."""
    base = f"{PREFIX}{label}"
    width = int(np.prod(plan.trail, dtype=np.int64))
    flat_shape, flat_name = int64_constant(names, f"{base}/flat_shape", [-1, width])
    out_dims = [1] * len(plan.lead) + list(plan.trail) if plan.keepdims else list(plan.trail)
    out_shape, out_name = int64_constant(names, f"{base}/out_shape", out_dims)
    for const in (flat_shape, out_shape):
        const.doc_string = MARK
    x2, y2 = names.new(f"{base}/rows"), names.new(f"{base}/sum")
    nodes = [flat_shape, out_shape,
             helper.make_node("Reshape", [plan.node.input[0], flat_name], [x2], name=names.new(f"{base}/flatten"),
                              doc_string=MARK)]  # fmt: skip
    made, ones_name = _ones(plan, x2, names, ones, label)
    nodes += made
    nodes.append(helper.make_node("MatMul", [ones_name, x2], [y2], name=names.new(f"{base}/matmul"), doc_string=MARK))
    nodes.append(helper.make_node("Reshape", [y2, out_name], [plan.node.output[0]], name=names.new(base),
                                  doc_string=MARK))  # fmt: skip
    return nodes
