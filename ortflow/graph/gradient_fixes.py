"""Rewrites for ops whose gradient the engine gets wrong or crashes on, found by the gradient audit
(tests/graph/test_gradient_audit.py; docs/engine-kernels.md, "Gradient audit").

- ``Where`` with a value input smaller than its output (broadcast): the engine's gradient for that input is WRONG,
  silently (measured: off by 1.0 of the largest gradient; it is not summed over the broadcast axes). Such an input
  is expanded to the output's shape first (``Expand``, whose gradient is right), so ``Where`` sees equal shapes.
  Inputs computed by ``Constant`` nodes (torch's ``masked_fill`` value) need no gradient and are left alone.
- ``ReduceSum`` / ``ReduceMean`` / ... with ``noop_with_empty_axes=1`` and no axes: the ONNX identity, but the
  engine's training session crashes in the forward kernel ("Reduction on all axes, output size should be 1").
  It becomes an ``Identity``.

Each is a pure ``ModelProto -> ModelProto`` pass; :func:`gradient_fixes` runs both, on every graph the engine gets
(the whole model, pipeline stages, tensor-parallel pieces).
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper, shape_inference

from ortflow.graph.common import Names, int64_constant, node_label, report_change

_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})


def gradient_fixes(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """:func:`expand_where_inputs` then :func:`empty_axes_reductions`."""
    return empty_axes_reductions(expand_where_inputs(model, report), report)


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Inferred dims (int, symbolic name or None) per tensor; inferred on a copy without initializer values."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    for name in ("node", "input", "output", "value_info"):
        getattr(light.graph, name).extend(getattr(model.graph, name))
    for t in model.graph.initializer:
        light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    try:
        inferred = shape_inference.infer_shapes(light).graph
    except Exception:  # noqa: BLE001 - no shapes: every broadcast input is expanded dynamically
        inferred = light.graph
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    for value in [*inferred.input, *inferred.output, *inferred.value_info]:
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                  for d in tensor_type.shape.dim]
    return shapes


def _same(a: list | None, b: list | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x is not None and x == y for x, y in zip(a, b, strict=True))


def expand_where_inputs(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Expand each ``Where`` value input that may be broadcast to the output's shape (see the module docstring).

    The target shape is a constant when inference knows the output's dims, else ``Shape`` of a copy of the
    ``Where`` on the original inputs (an int64 path: it needs no gradient).
    """
    constants = {o for n in model.graph.node if n.op_type in ("Constant", "ConstantOfShape") for o in n.output}
    wheres = {i: n for i, n in enumerate(model.graph.node) if n.op_type == "Where" and n.domain in ("", "ai.onnx")
              and any(k not in constants for k in n.input[1:])}
    if not wheres:
        return model
    shapes = _shapes(model)
    todo = {i: [k for k in (1, 2) if n.input[k] not in constants and not _same(shapes.get(n.input[k]),
                                                                               shapes.get(n.output[0]))]
            for i, n in wheres.items()}
    if not any(todo.values()):
        return model
    model = copy.deepcopy(model)
    graph, names = model.graph, Names(model.graph)
    nodes, changes = [], []
    for i, node in enumerate(graph.node):
        slots = todo.get(i, [])
        if slots:
            label, out_shape = node_label(node), shapes.get(node.output[0])
            if out_shape is not None and all(isinstance(d, int) and d > 0 for d in out_shape):
                const, target = int64_constant(names, f"{label}/expand_shape", list(out_shape))
                nodes.append(const)
            else:
                copy_out, target = names.new(f"{label}/shape_source"), names.new(f"{label}/expand_shape")
                nodes.append(helper.make_node("Where", list(node.input), [copy_out], name=names.new(copy_out)))
                nodes.append(helper.make_node("Shape", [copy_out], [target], name=names.new(target)))
            for k in slots:
                expanded = names.new(f"{node.input[k]}/expanded")
                nodes.append(helper.make_node("Expand", [node.input[k], target], [expanded],
                                              name=names.new(f"{label}/Expand_{k}")))
                changes.append(f"Where '{label}' input {k} '{node.input[k]}' expanded to the output's shape")
                node.input[k] = expanded
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    report_change("expand_where_inputs", changes, report)
    return model


def empty_axes_reductions(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Replace reductions with ``noop_with_empty_axes=1`` and no axes (the identity) by ``Identity``."""
    found = [i for i, n in enumerate(model.graph.node) if n.op_type in _REDUCTIONS and n.domain in ("", "ai.onnx")
             and _noop(n)]
    if not found:
        return model
    model = copy.deepcopy(model)
    changes = []
    for i in found:
        node = model.graph.node[i]
        changes.append(f"{node.op_type} '{node_label(node)}' (noop_with_empty_axes=1, no axes) -> Identity")
        node.CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
    report_change("empty_axes_reductions", changes, report)
    return model


def _noop(node: onnx.NodeProto) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    no_axes = not attrs.get("axes") and (len(node.input) < 2 or not node.input[1])
    return attrs.get("noop_with_empty_axes", 0) == 1 and no_axes
