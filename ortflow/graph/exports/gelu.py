"""Fuse the GELU that exporters write as elementwise ops into one ``com.microsoft`` ``Gelu`` / ``FastGelu`` node.

``torch.onnx.export`` (opset < 20) writes ``nn.GELU()`` as ``Div(x, 1.4142135) -> Erf -> Add 1 -> Mul x -> Mul 0.5``,
and Hugging Face's tanh GELU (GPT-2's ``gelu_new``) as eight nodes around a ``Tanh``. The engine differentiates each
of them: the forward keeps their intermediates and the backward runs the Erf's gradient (Exp, Neg, Mul, ...) over
the whole ``[B, T, 4d]`` activation several times. The engine's own GELU ops (``Gelu``: the erf form;
``FastGelu``: the tanh form) compute the same function in one kernel each way (``GeluGrad`` / ``FastGeluGrad``).
The engine's own graph optimizer fuses some forms when it builds the training graph (torch's
``nn.GELU()`` export, Hugging Face's erf GELU and ``gelu_new``), not the others; measured: docs/engine.md.

Recognised (Mul and Add operands in either order; constants are initializers or Constant nodes holding one float,
equal to the named value within 1e-5 relative; every intermediate read by nothing else):

* erf form: ``Erf(x / sqrt(2))`` or ``Erf(x * (1 / sqrt(2)))``, then ``+ 1``, then ``0.5 * x * (.)`` in any
  association: ``(x * a) * 0.5``, ``x * (a * 0.5)``, ``(x * 0.5) * a``;
* tanh form: ``Tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))`` with ``x^3`` as ``Pow(x, 3)`` or ``(x * x) * x``, then
  ``+ 1`` and the same product.

Only float32 activations are fused (the dtype the CPU kernels take; autocast lowers the fused node afterwards like
any other). :func:`decompose_gelu` writes the fused nodes back as standard ONNX ops, so an exported inference model
needs no ``com.microsoft`` domain.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import onnx
from onnx import helper

from ortflow.graph.gradients.gelu_grad import restore_tanh_gelus, sigmoid_gelus
from ortflow.graph.onnx_tools import Names, constant_values, elem_types, infer_shapes, node_label, report_change

MS_DOMAIN = "com.microsoft"
_RTOL = 1e-5
_SQRT2 = math.sqrt(2.0)
_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_K = 0.044715


@dataclass(frozen=True)
class _Match:
    op_type: str  # Gelu or FastGelu
    x: str
    y: str
    nodes: tuple[int, ...]  # indices of the nodes the fused one replaces (the last computes y)
    type_proto: onnx.TypeProto  # x's, and so y's


class _View:
    """Producers, consumers and scalar constants of one graph, for the matcher."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = {}
        for i, node in enumerate(graph.node):
            for name in node.output:
                self.producer[name] = i
            for name in node.input:
                self.readers.setdefault(name, []).append(i)
        self.outputs = {o.name for o in graph.output}
        self._scalars: dict[str, float | None] = {}

    def scalar(self, name: str) -> float | None:
        if name not in self._scalars:
            values = constant_values(self.graph, name)
            ok = values is not None and values.size == 1 and values.dtype.kind in "fiu"
            self._scalars[name] = float(values.reshape(-1)[0]) if ok else None
        return self._scalars[name]

    def is_const(self, name: str, value: float) -> bool:
        found = self.scalar(name)
        return found is not None and math.isclose(found, value, rel_tol=_RTOL)

    def node(self, name: str, op_type: str) -> tuple[int, onnx.NodeProto] | None:
        """The node of ``op_type`` (default domain) that produces ``name``, else None."""
        i = self.producer.get(name)
        if i is None:
            return None
        node = self.graph.node[i]
        return (i, node) if node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def private(self, name: str) -> bool:
        """Whether ``name`` is read by exactly one node and is not a graph output (an intermediate to remove)."""
        return name not in self.outputs and len(self.readers.get(name, ())) == 1

    def other(self, node: onnx.NodeProto, name: str) -> str | None:
        """The other input of a two-input node that reads ``name`` once."""
        ins = list(node.input)
        if len(ins) != 2 or ins.count(name) != 1:
            return None
        return ins[1] if ins[0] == name else ins[0]

    def sole_reader(self, name: str, op_type: str) -> tuple[int, onnx.NodeProto] | None:
        if not self.private(name):
            return None
        i = self.readers[name][0]
        node = self.graph.node[i]
        return (i, node) if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _erf_input(view: _View, erf: onnx.NodeProto) -> tuple[str, list[int]] | None:
    """x for ``Erf(x / sqrt2)`` or ``Erf(x * (1/sqrt2))`` (the scaling node's index), else None."""
    for op_type, value in (("Div", _SQRT2), ("Mul", 1.0 / _SQRT2)):
        found = view.node(erf.input[0], op_type)
        if found is None or not view.private(erf.input[0]):
            continue
        i, scale = found
        for pos in ((1,) if op_type == "Div" else (0, 1)):
            if len(scale.input) == 2 and view.is_const(scale.input[pos], value):
                return scale.input[1 - pos], [i]
    return None


def _cube_of(view: _View, name: str, x: str) -> list[int] | None:
    """Indices of the nodes computing ``x^3`` as ``Pow(x, 3)`` or ``(x * x) * x``, else None."""
    pow_node = view.node(name, "Pow")
    if pow_node is not None and pow_node[1].input[0] == x and view.is_const(pow_node[1].input[1], 3.0):
        return [pow_node[0]]
    mul = view.node(name, "Mul")
    if mul is None or x not in mul[1].input:
        return None
    square = view.other(mul[1], x) if list(mul[1].input).count(x) == 1 else None
    inner = view.node(square, "Mul") if square else None
    if inner is not None and view.private(square) and list(inner[1].input) == [x, x]:
        return [inner[0], mul[0]]
    return None


def _tanh_input(view: _View, tanh: onnx.NodeProto) -> tuple[str, list[int]] | None:
    """x for ``Tanh(sqrt(2/pi) * (x + 0.044715 * x^3))``, with the indices of the nodes inside, else None."""
    outer = view.node(tanh.input[0], "Mul")
    if outer is None or not view.private(tanh.input[0]):
        return None
    inner = next((n for n in outer[1].input if view.is_const(n, _TANH_C)), None)
    inner = view.other(outer[1], inner) if inner is not None else None
    add = view.node(inner, "Add") if inner else None
    if add is None or not view.private(inner) or len(add[1].input) != 2:
        return None
    for x, term in (tuple(add[1].input), tuple(reversed(add[1].input))):
        mul = view.node(term, "Mul")
        if mul is None or not view.private(term):
            continue
        const = next((n for n in mul[1].input if view.is_const(n, _TANH_K)), None)
        cube = view.other(mul[1], const) if const is not None else None
        nodes = _cube_of(view, cube, x) if cube and view.private(cube) else None
        if nodes is not None:
            return x, [*nodes, mul[0], add[0], outer[0]]
    return None


def _product(view: _View, a: str, x: str) -> tuple[str, list[int]] | None:
    """The output of ``0.5 * x * a`` (any association; ``a`` = 1 + erf/tanh) and its nodes' indices, else None."""
    first = view.sole_reader(a, "Mul")
    if first is None:
        return None
    i, mul = first
    other = view.other(mul, a)
    if other is None:
        return None
    if other == x or view.is_const(other, 0.5):  # (x * a) * 0.5  or  (a * 0.5) * x
        want_half = other == x
        second = view.sole_reader(mul.output[0], "Mul")
        if second is None:
            return None
        j, last = second
        rest = view.other(last, mul.output[0])
        if rest is not None and (view.is_const(rest, 0.5) if want_half else rest == x):
            return last.output[0], [i, j]
        return None
    half = view.node(other, "Mul")  # (x * 0.5) * a
    if half is not None and view.private(other) and x in half[1].input:
        rest = view.other(half[1], x)
        if rest is not None and view.is_const(rest, 0.5):
            return mul.output[0], [half[0], i]
    return None


def _matches(model: onnx.ModelProto, keep: set[str]) -> list[_Match]:
    graph = model.graph
    if not any(n.op_type in ("Erf", "Tanh") for n in graph.node):
        return []
    view = _View(graph)
    types = value_types(model)
    found, used = [], set()
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Erf", "Tanh") or node.domain not in ("", "ai.onnx"):
            continue
        start = _erf_input(view, node) if node.op_type == "Erf" else _tanh_input(view, node)
        one = view.sole_reader(node.output[0], "Add")
        if start is None or one is None or not view.is_const(view.other(one[1], node.output[0]) or "", 1.0):
            continue
        x, before = start
        end = _product(view, one[1].output[0], x)
        if end is None or x not in types or types[x].tensor_type.elem_type != onnx.TensorProto.FLOAT:
            continue
        y, after = end
        nodes = (*before, index, one[0], *after)
        removed = {name for i in nodes for name in graph.node[i].output} - {y}
        if used.isdisjoint(nodes) and removed.isdisjoint(keep):
            used.update(nodes)
            found.append(_Match("Gelu" if node.op_type == "Erf" else "FastGelu", x, y, nodes, types[x]))
    return found


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The type (element type and shape, as far as shape inference tells) of every tensor it can tell."""
    try:
        graph = infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - onnx raises several types; unknown types just mean no fusion
        graph = model.graph
    types = {v.name: v.type for v in [*graph.value_info, *graph.input, *graph.output] if v.type.tensor_type.elem_type}
    for tensor in model.graph.initializer:
        types.setdefault(tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
    return types


def declare_fused_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """Declare (in place) the output type of every ``com.microsoft`` Gelu / FastGelu as its input's, as inferred now.

    For passes that drop value_info and let shape inference recompute it (the tensor-parallel shards change widths):
    onnx's inference knows no com.microsoft op, so without this a fused GELU's output, and everything after it, would
    have no type."""
    fused = [n for n in model.graph.node if n.domain == MS_DOMAIN and n.op_type in ("Gelu", "FastGelu")]
    def shaped(types: dict, name: str) -> bool:
        return name in types and types[name].tensor_type.HasField("shape")

    for _ in range(len(fused)):  # a fused GELU after another needs the earlier one declared first
        types = value_types(model)
        missing = [n for n in fused if not shaped(types, n.output[0]) and shaped(types, n.input[0])]
        for node in missing:
            _declare(model.graph, node.output[0], types[node.input[0]])
        if not missing:
            break
    return model


def _declare(graph: onnx.GraphProto, name: str, type_proto: onnx.TypeProto) -> None:
    """Record ``name``'s type in value_info: onnx's shape inference knows no com.microsoft op, and autocast and the
    batch pass need every tensor's type."""
    if name in {o.name for o in graph.output}:
        return
    kept = [v for v in graph.value_info if v.name != name]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    info = graph.value_info.add()
    info.name = name
    info.type.CopyFrom(type_proto)


def gelu_rewrites(
    model: onnx.ModelProto, fuse: bool | str, report: list[dict] | None = None, keep: set[str] = frozenset()
) -> onnx.ModelProto:
    """The GELU passes as every training graph gets them (the whole model, pipeline stages, tensor-parallel pieces).

    :func:`tanh_gelu_gradients` always; then by ``fuse``: ``"as_exported"`` (or False) nothing more; ``"engine"``
    (or True) :func:`fuse_gelu`; ``"cpu"`` :func:`fuse_gelu`, then every tanh GELU in the sigmoid form of
    :mod:`ortflow.graph.gradients.gelu_grad` (the engine's CPU ``FastGeluGrad`` is slow; its erf ``GeluGrad`` is not).
    """
    mode = {True: "engine", False: "as_exported"}.get(fuse, fuse) if isinstance(fuse, bool) else fuse
    if mode not in ("as_exported", "engine", "cpu"):
        raise ValueError(f"GELU mode {fuse!r}: use 'as_exported', 'engine' or 'cpu'")
    model = tanh_gelu_gradients(model, report)
    if mode == "as_exported":
        return model
    model = fuse_gelu(model, report, keep=keep)
    if mode == "cpu":
        model = sigmoid_gelus(model, elem_types(model), report)
    return model


def fuse_gelu(
    model: onnx.ModelProto, report: list[dict] | None = None, keep: set[str] = frozenset()
) -> onnx.ModelProto:
    """Replace every recognised elementwise GELU by one ``com.microsoft`` ``Gelu`` (erf) or ``FastGelu`` (tanh).

    Args:
        model: The model (left unchanged).
        report: When given, receives one entry describing the change.
        keep: Tensor names that must stay (pipeline cuts): a GELU whose intermediates include one is left alone.

    Returns:
        A new model (the same one when nothing matched); initializers are untouched.
    """
    matches = _matches(model, set(keep))
    if not matches:
        return model
    model = copy.deepcopy(model)
    graph = model.graph
    names = Names(graph)
    replace = {m.nodes[-1]: m for m in matches}  # the fused node takes the place of the node computing y
    drop = {i for m in matches for i in m.nodes}
    nodes, changes = [], []
    for i, node in enumerate(graph.node):
        match = replace.get(i)
        if match is not None:
            label = node_label(graph.node[match.nodes[0]])
            nodes.append(helper.make_node(match.op_type, [match.x], [match.y], name=names.new(f"{label}/fused"),
                                          domain=MS_DOMAIN))
            changes.append(f"{len(match.nodes)} nodes computing GELU of '{match.x}' -> {match.op_type}")
            _declare(graph, match.y, match.type_proto)
        elif i not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    report_change("fuse_gelu", changes, report)
    return model


def tanh_gelu_gradients(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Replace ONNX's ``Gelu(approximate="tanh")`` (opset 20) by ``com.microsoft`` ``FastGelu``.

    The engine differentiates the standard ``Gelu`` with ``GeluGrad``, the derivative of the erf form, whatever its
    ``approximate`` attribute says: the forward computes the tanh form, the gradient belongs to another function
    (measured: 2.3e-4 of the largest gradient off, against 1e-7 for the erf form; tests/graph/test_gelu.py).
    ``FastGelu`` computes the same tanh form and has its own gradient. A correctness fix, so it runs whatever
    model.fuse_gelu says.
    """
    def is_tanh_gelu(node: onnx.NodeProto) -> bool:
        return node.op_type == "Gelu" and node.domain in ("", "ai.onnx") and any(
            a.name == "approximate" and helper.get_attribute_value(a) == b"tanh" for a in node.attribute)

    if not any(is_tanh_gelu(n) for n in model.graph.node):
        return model
    types = value_types(model)
    model = copy.deepcopy(model)
    changes = []
    for node in model.graph.node:
        if is_tanh_gelu(node) and node.output[0] in types:
            _declare(model.graph, node.output[0], types[node.output[0]])
        if is_tanh_gelu(node):
            node.domain, node.op_type = MS_DOMAIN, "FastGelu"
            del node.attribute[:]
            changes.append(f"Gelu(approximate=tanh) '{node_label(node)}' -> FastGelu (the engine's gradient of Gelu is "
                           "the erf form's)")
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    report_change("tanh_gelu_gradients", changes, report)
    return model


def _decomposed(node: onnx.NodeProto, names: Names, elem_type: int) -> list[onnx.NodeProto]:
    """Standard ops computing ``node`` (a Gelu or FastGelu without bias) into the same output name, with constants
    of the input's element type."""
    x, y, base = node.input[0], node.output[0], node_label(node)
    ops: list[onnx.NodeProto] = []

    def op(op_type: str, inputs: list[str], out: str | None = None) -> str:
        out = out or names.new(f"{base}/{op_type.lower()}")
        ops.append(helper.make_node(op_type, inputs, [out], name=names.new(f"{base}/{op_type}")))
        return out

    def const(label: str, value: float) -> str:
        out = names.new(f"{base}/{label}")
        tensor = helper.make_tensor(out, elem_type, [], [value])
        ops.append(helper.make_node("Constant", [], [out], name=names.new(f"{out}/const"), value=tensor))
        return out

    if node.op_type == "Gelu":
        inner = op("Erf", [op("Div", [x, const("sqrt2", _SQRT2)])])
    else:
        cube = op("Pow", [x, const("three", 3.0)])
        inner = op("Tanh", [op("Mul", [const("c", _TANH_C), op("Add", [x, op("Mul", [const("k", _TANH_K), cube])])])])
    gate = op("Add", [inner, const("one", 1.0)])
    op("Mul", [op("Mul", [x, gate]), const("half", 0.5)], y)
    return ops


def decompose_gelu(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every ``com.microsoft`` ``Gelu`` / ``FastGelu`` of one input, and every sigmoid-form GELU of
    :mod:`ortflow.graph.gradients.gelu_grad`, written as standard ops (the form :func:`fuse_gelu` recognises); the
    ``com.microsoft`` opset import is dropped when nothing else uses it."""
    model = restore_tanh_gelus(model)
    fused = [n for n in model.graph.node if n.domain == MS_DOMAIN and n.op_type in ("Gelu", "FastGelu")
             and len(n.input) == 1]  # fmt: skip
    if not fused:
        return model
    model = copy.deepcopy(model)
    graph = model.graph
    names, types = Names(graph), elem_types(model)
    nodes = []
    for node in graph.node:
        one_input = node.domain == MS_DOMAIN and node.op_type in ("Gelu", "FastGelu") and len(node.input) == 1
        nodes.extend(_decomposed(node, names, types.get(node.input[0], onnx.TensorProto.FLOAT)) if one_input
                     else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(n.domain == MS_DOMAIN for n in graph.node):
        kept = [o for o in model.opset_import if o.domain != MS_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return model
