"""Rewrites for ops whose gradient the engine gets wrong or crashes on, found by the gradient audit
(tests/graph/test_gradient_audit.py; docs/engine.md, "Gradient audit").

- ``Where`` with a value input smaller than its output (broadcast): the engine's gradient for that input is WRONG,
  silently (measured: off by 1.0 and 0.29 of the largest gradient; it is not summed over the broadcast axes; a
  ``[N, 1]`` input crashes instead). Such an input
  is expanded to the output's shape first (``Expand``, whose gradient is right), so ``Where`` sees equal shapes.
  Inputs computed by ``Constant`` nodes (torch's ``masked_fill`` value) need no gradient and are left alone.
- ``ReduceSum`` / ``ReduceMean`` / ... with ``noop_with_empty_axes=1`` and no axes: the ONNX identity, but the
  engine's training session crashes in the forward kernel ("Reduction on all axes, output size should be 1"; ONNX
  Runtime's inference too).
  It becomes an ``Identity``.
- ``Slice`` with a negative step on the LAST axis (torch's ``x.flip(-1)``): the engine's ``SliceGrad`` crashes at
  the first training step ("narrowing_error"); negative steps on other axes are right. The slice is done between
  two ``Transpose`` nodes that swap the first and last axes.
- ``MatMul`` with a 1-D operand (torch's ``x @ v``): the engine cannot build its gradient (its ``FusedMatMul``
  fails shape inference). The vector becomes a matrix (``Unsqueeze``) and the product is squeezed back.
- ``Dropout`` without ``training_mode`` (or with a constant false one): ONNX's identity, and the engine's forward
  is the identity too, but its gradient is scaled by ``1 / (1 - ratio)`` as if every element were kept (measured:
  off by 0.43 of the largest gradient at ratio 0.3, 1.0 at 0.5), silently. It becomes an ``Identity`` when nothing
  reads its mask. (torch's training-mode export passes ``training_mode=True``: real dropout, left alone.)
- ``BatchNormalization(training_mode=1)`` (torch's export in training mode) whose running-statistics outputs
  nothing reads: the engine's eval model fails to load ("number of op outputs should be 1 when Training_mode =
  False"). It becomes the inference form (one output), which the engine trains with batch statistics and whose
  running statistics it updates itself (tests/graph/test_batchnorm.py).
- ``CastLike`` (the dynamo exporter's ``optimize=False`` export of ``scaled_dot_product_attention``, the default
  attention of Hugging Face models: the scale computed from a shape and cast like the query): the engine has no
  gradient for it ("gradient builder has not been registered: CastLike"), so every parameter before the query is
  refused. Where the type input's element type is known it becomes ``Cast(to=that type)``, the same values, with the
  engine's Cast gradient; the type input, which only lends its type, is no longer read.

Each is a pure ``ModelProto -> ModelProto`` pass that logs once; :func:`gradient_fixes` runs them all, on every
graph the engine gets (the whole model, pipeline stages, tensor-parallel pieces).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, shape_inference

from ortflow.graph.onnx_tools import (
    Names,
    attribute,
    constant_values,
    consumed_names,
    dims_only,
    elem_types,
    int64_constant,
    node_label,
    report_change,
)

_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})


def gradient_fixes(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Every pass of this module, in order."""
    model = expand_where_inputs(model, report)
    model = empty_axes_reductions(model, report)
    model = last_axis_slices(model, report)
    model = vector_matmuls(model, report)
    model = inference_dropouts(model, report)
    model = castlike_to_cast(model, report)
    return batchnorm_inference_form(model, report)


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Inferred dims (int, symbolic name or None) per tensor; inferred on a copy without initializer values."""
    light = dims_only(model)
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

    The target shape is ``Shape`` of a copy of the ``Where`` on the original inputs (an int64 path: it needs no
    gradient), never a constant: the batch dim may become symbolic after this pass (pipeline stages and
    tensor-parallel pieces are cut from the model file), and a tensor-parallel shard changes head counts.
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
            label = node_label(node)
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
    return _to_identity(model, found, "(noop_with_empty_axes=1, no axes)", "empty_axes_reductions", report)


def _to_identity(model: onnx.ModelProto, found: list[int], why: str, pass_name: str,
                 report: list[dict] | None) -> onnx.ModelProto:
    """A copy of ``model`` whose nodes at ``found`` are ``Identity(input 0) -> output 0``, each change logged."""
    def identity(node: onnx.NodeProto) -> tuple[onnx.NodeProto, str]:
        return (helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name),
                f"{node.op_type} '{node_label(node)}' {why} -> Identity")

    return _replace_nodes(model, found, identity, pass_name, report)


def _replace_nodes(model: onnx.ModelProto, found: list[int], make, pass_name: str,
                   report: list[dict] | None) -> onnx.ModelProto:
    """A copy of ``model`` whose nodes at ``found`` are replaced by ``make(node) -> (new node, change line)``, each
    change logged; ``model`` itself when ``found`` is empty."""
    if not found:
        return model
    model = copy.deepcopy(model)
    changes = []
    for i in found:
        node = model.graph.node[i]
        replacement, change = make(node)
        changes.append(change)
        node.CopyFrom(replacement)
    report_change(pass_name, changes, report)
    return model


def _noop(node: onnx.NodeProto) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    no_axes = not attrs.get("axes") and (len(node.input) < 2 or not node.input[1])
    return attrs.get("noop_with_empty_axes", 0) == 1 and no_axes


def last_axis_slices(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Wrap a ``Slice`` with a negative step on the last axis (constant inputs, rank >= 2 known) in two
    ``Transpose`` nodes that swap the first and last axes, so the step applies to the first axis."""
    graph = model.graph
    slices = {i: n for i, n in enumerate(graph.node) if n.op_type == "Slice" and n.domain in ("", "ai.onnx")
              and len(n.input) >= 5 and n.input[4]}
    if not slices:
        return model
    shapes, found = _shapes(model), {}
    for i, node in slices.items():
        rank = len(shapes.get(node.input[0]) or [])
        steps = constant_values(graph, node.input[4])
        axes = constant_values(graph, node.input[3]) if node.input[3] else None
        if rank < 2 or steps is None or (node.input[3] and axes is None):
            continue
        steps = steps.reshape(-1)
        axes = np.arange(len(steps)) if axes is None else axes.reshape(-1) % rank
        if any(a == rank - 1 and s < 0 for a, s in zip(axes, steps, strict=True)):
            found[i] = (rank, axes)
    if not found:
        return model
    model = copy.deepcopy(model)
    graph, names = model.graph, Names(model.graph)
    nodes, changes = [], []
    for i, node in enumerate(graph.node):
        if i not in found:
            nodes.append(node)
            continue
        (rank, axes), label = found[i], node_label(node)
        perm = [rank - 1, *range(1, rank - 1), 0]
        moved, sliced = names.new(f"{label}/last_axis_first"), names.new(f"{label}/sliced")
        const, new_axes = int64_constant(names, f"{label}/axes", [perm[int(a)] for a in axes])
        nodes.append(helper.make_node("Transpose", [node.input[0]], [moved], name=names.new(moved), perm=perm))
        nodes.append(const)
        nodes.append(helper.make_node("Slice", [moved, node.input[1], node.input[2], new_axes, node.input[4]],
                                      [sliced], name=node.name))
        nodes.append(helper.make_node("Transpose", [sliced], [node.output[0]], name=names.new(f"{label}/back"),
                                      perm=perm))
        changes.append(f"Slice '{label}' (negative step on the last axis) -> Transpose, Slice, Transpose")
    del graph.node[:]
    graph.node.extend(nodes)
    report_change("last_axis_slices", changes, report)
    return model


def vector_matmuls(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``MatMul`` with a 1-D operand -> the 2-D product between ``Unsqueeze`` and ``Squeeze`` (numpy's rule)."""
    found = [i for i, n in enumerate(model.graph.node) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    if not found:
        return model
    shapes = _shapes(model)
    ranks = {i: [len(shapes[x]) if x in shapes else None for x in model.graph.node[i].input] for i in found}
    found = [i for i in found if 1 in ranks[i]]
    if not found:
        return model
    model = copy.deepcopy(model)
    graph, names = model.graph, Names(model.graph)
    nodes, changes = [], []
    todo = set(found)
    for i, node in enumerate(graph.node):
        if i not in todo:
            nodes.append(node)
            continue
        label, inputs, squeeze = node_label(node), list(node.input), []
        for k, (axis, gone) in enumerate(((0, -2), (-1, -1))):
            if ranks[i][k] == 1:
                const, axes = int64_constant(names, f"{label}/unsqueeze{k}_axes", [axis])
                out = names.new(f"{label}/matrix{k}")
                nodes += [const, helper.make_node("Unsqueeze", [inputs[k], axes], [out], name=names.new(out))]
                inputs[k] = out
                squeeze.append(gone)
        product = names.new(f"{label}/product")
        nodes.append(helper.make_node("MatMul", inputs, [product], name=node.name))
        const, axes = int64_constant(names, f"{label}/squeeze_axes", sorted(squeeze))
        nodes += [const, helper.make_node("Squeeze", [product, axes], [node.output[0]], name=names.new(f"{label}/sq"))]
        changes.append(f"MatMul '{label}' with a 1-D operand -> Unsqueeze, MatMul, Squeeze")
    del graph.node[:]
    graph.node.extend(nodes)
    report_change("vector_matmuls", changes, report)
    return model


def batchnorm_inference_form(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``BatchNormalization(training_mode=1)`` whose extra outputs are unused -> the one-output inference form."""
    used = consumed_names(model.graph) | {o.name for o in model.graph.output}
    found = [i for i, n in enumerate(model.graph.node) if n.op_type == "BatchNormalization"
             and n.domain in ("", "ai.onnx") and attribute(n, "training_mode", 0) == 1
             and not any(o in used for o in n.output[1:] if o)]
    if not found:
        return model
    model = copy.deepcopy(model)
    changes = []
    for i in found:
        node = model.graph.node[i]
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
        del node.output[1:]
        changes.append(f"BatchNormalization '{node_label(node)}' training_mode=1 -> the inference form (the engine "
                       "trains it with batch statistics and updates the running ones)")
    report_change("batchnorm_inference_form", changes, report)
    return model


def inference_dropouts(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``Dropout`` in inference mode (``training_mode`` absent or a constant false), mask unread -> ``Identity``."""
    graph = model.graph
    used = consumed_names(graph) | {o.name for o in graph.output}
    found = []
    for i, node in enumerate(graph.node):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        mode = node.input[2] if len(node.input) > 2 else ""
        value = constant_values(graph, mode) if mode else np.asarray(False)
        if value is not None and not bool(value) and not (len(node.output) > 1 and node.output[1] in used):
            found.append(i)
    return _to_identity(model, found, "without training_mode (the identity)", "inference_dropouts", report)


def castlike_to_cast(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``CastLike(x, like)`` whose ``like`` has a known element type -> ``Cast(x, to=that type)``."""
    found = [i for i, n in enumerate(model.graph.node) if n.op_type == "CastLike" and n.domain in ("", "ai.onnx")]
    if not found:
        return model
    types = elem_types(model)
    found = [i for i in found if types.get(model.graph.node[i].input[1])]

    def cast(node: onnx.NodeProto) -> tuple[onnx.NodeProto, str]:
        to = types[node.input[1]]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name == "saturate"}
        return (helper.make_node("Cast", [node.input[0]], [node.output[0]], name=node.name, to=to, **attrs),
                f"CastLike '{node_label(node)}' -> Cast(to={onnx.TensorProto.DataType.Name(to)})")

    return _replace_nodes(model, found, cast, "castlike_to_cast", report)
