"""The tanh GELU with a fast CPU gradient: ``x * sigmoid(x * (A + B * x^2))``, standard ONNX ops.

The engine's CPU kernel for the gradient of ``FastGelu`` (``FastGeluGrad``, which it also reaches by fusing
Hugging Face's ``gelu_new`` on its own when it builds a training graph) costs about 20 ns per element at one thread,
30-60 times its forward; the erf form's ``GeluGrad`` costs about 5. The tanh GELU is exactly a sigmoid GELU::

    0.5 * x * (1 + tanh(z)) = x * sigmoid(2 z),   z = sqrt(2/pi) * (x + 0.044715 x^3)

so it is written as ``x * Sigmoid(x * (A + B * (x * x)))`` with ``A = 2 sqrt(2/pi)`` and ``B = A * 0.044715``: six
vectorised elementwise kernels forward, and the engine's gradients of them (``SigmoidGrad``, a few ``Mul``s, one
``Sum``) backward, which the engine does not fuse back. Forward and backward together cost about 0.4 of ``FastGelu``
+ ``FastGeluGrad`` (docs/engine.md); the function is the same within float32
rounding. ortflow applies it on the CPU only: the CUDA engine's fused kernels are one memory pass each way.

:func:`restore_tanh_gelus` turns the form back into ``FastGelu`` (for the export, which writes the standard form
ONNX Runtime's inference optimizer fuses).
"""

from __future__ import annotations

import copy
import math

import onnx
from onnx import TensorProto, helper

from ortflow.graph.onnx_tools import Names, constant_values, node_label, report_change

MS_DOMAIN = "com.microsoft"
_TANH_C = math.sqrt(2.0 / math.pi)
SIGMOID_A = 2.0 * _TANH_C
SIGMOID_B = 2.0 * _TANH_C * 0.044715
_RTOL = 1e-6


def fast_gelu_nodes(x: str, y: str, names: Names, elem_type: int = TensorProto.FLOAT) -> list[onnx.NodeProto]:
    """Nodes computing ``y = x * sigmoid(x * (A + B * x^2))`` (the tanh GELU), constants of ``elem_type``."""
    nodes: list[onnx.NodeProto] = []
    base = y

    def const(label: str, value: float) -> str:
        out = names.new(f"{base}/gelu_{label}")
        nodes.append(helper.make_node("Constant", [], [out], name=names.new(f"{out}/const"),
                                      value=helper.make_tensor(out, elem_type, [], [value])))
        return out

    def op(op_type: str, inputs: list[str], out: str | None = None) -> str:
        out = out or names.new(f"{base}/gelu_{op_type.lower()}")
        nodes.append(helper.make_node(op_type, inputs, [out], name=names.new(f"{base}/gelu_{op_type}")))
        return out

    square = op("Mul", [x, x])
    slope = op("Add", [op("Mul", [square, const("b", SIGMOID_B)]), const("a", SIGMOID_A)])
    op("Mul", [x, op("Sigmoid", [op("Mul", [x, slope])])], y)
    return nodes


def sigmoid_gelus(model: onnx.ModelProto, elem_types: dict[str, int],
                  report: list[dict] | None = None) -> onnx.ModelProto:  # fmt: skip
    """Replace every ``com.microsoft`` ``FastGelu`` (with or without its bias input) by :func:`fast_gelu_nodes`.

    Args:
        model: The model (left unchanged).
        elem_types: Element type of tensors by name (the constants take the input's; float when unknown).
        report: When given, receives one entry describing the change.
    """
    def is_fast_gelu(node: onnx.NodeProto) -> bool:
        return node.domain == MS_DOMAIN and node.op_type == "FastGelu"

    if not any(is_fast_gelu(n) for n in model.graph.node):
        return model
    model = copy.deepcopy(model)
    graph = model.graph
    names = Names(graph)
    nodes, changes = [], []
    for node in graph.node:
        if not is_fast_gelu(node):
            nodes.append(node)
            continue
        x, label = node.input[0], node_label(node)
        elem = elem_types.get(x, TensorProto.FLOAT)
        if len(node.input) > 1 and node.input[1]:  # FastGelu(X, bias) = GELU(X + bias)
            biased = names.new(f"{node.output[0]}/gelu_biased")
            nodes.append(helper.make_node("Add", [x, node.input[1]], [biased], name=names.new(f"{label}/bias")))
            x = biased
        nodes.extend(fast_gelu_nodes(x, node.output[0], names, elem))
        changes.append(f"FastGelu '{label}' -> x * Sigmoid(x * (A + B x^2)) (the engine's FastGeluGrad is slow on CPU)")
    del graph.node[:]
    graph.node.extend(nodes)
    report_change("sigmoid_gelus", changes, report)
    return model


class _Graph:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        private = name not in self.outputs and len(self.readers.get(name, ())) == 1
        ok = node is not None and private and node.op_type == op_type and node.domain in ("", "ai.onnx")
        return node if ok and len(node.input) == (1 if op_type == "Sigmoid" else 2) else None

    def is_const(self, name: str, value: float) -> bool:
        values = constant_values(self.graph, name)
        return values is not None and values.size == 1 and math.isclose(float(values.reshape(-1)[0]), value,
                                                                        rel_tol=_RTOL)  # fmt: skip


def _sigmoid_gelu_input(g: _Graph, mul: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]] | None:
    """x when ``mul`` is ``Mul(x, Sigmoid(Mul(x, Add(Mul(Mul(x, x), B), A))))`` in the order written, else None."""
    if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.input) != 2:
        return None
    x = mul.input[0]
    sig = g.made_by(mul.input[1], "Sigmoid")
    z = g.made_by(sig.input[0], "Mul") if sig else None
    slope = g.made_by(z.input[1], "Add") if z is not None and z.input[0] == x else None
    if slope is None or not g.is_const(slope.input[1], SIGMOID_A):
        return None
    scaled = g.made_by(slope.input[0], "Mul")
    if scaled is None or not g.is_const(scaled.input[1], SIGMOID_B):
        return None
    square = g.made_by(scaled.input[0], "Mul")
    if square is None or list(square.input) != [x, x]:
        return None
    consts = [g.producer[n] for n in (scaled.input[1], slope.input[1])
              if n in g.producer and g.producer[n].op_type == "Constant" and len(g.readers[n]) == 1]
    return x, [*consts, square, scaled, slope, z, sig, mul]


def restore_tanh_gelus(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every GELU written by :func:`fast_gelu_nodes` as one ``com.microsoft`` ``FastGelu``."""
    if not any(n.op_type == "Sigmoid" for n in model.graph.node):
        return model
    g = _Graph(model.graph)
    found = {}
    for node in model.graph.node:
        match = _sigmoid_gelu_input(g, node)
        if match is not None:
            found[node.output[0]] = match
    if not found:
        return model
    model = copy.deepcopy(model)
    drop = {id_ for _, nodes in found.values() for id_ in (n.output[0] for n in nodes[:-1])}
    kept = []
    for node in model.graph.node:
        if node.output and node.output[0] in found:
            kept.append(helper.make_node("FastGelu", [found[node.output[0]][0]], [node.output[0]],
                                         name=node.name or None, domain=MS_DOMAIN))
        elif not (node.output and node.output[0] in drop):
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return model
