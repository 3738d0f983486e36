"""``Gemm`` layers in the tensor-parallel split: torch exports ``nn.Linear`` on a 2-D input as ``Gemm(x, W, b)``.

torch writes ``transB=1`` (``W`` stored ``[out, in]``, as ``nn.Linear`` holds it), so a column split keeps a block of
``W``'s rows and a row split a block of its columns; :func:`weight_axes` says which. Before the split the bias is
taken out of every such Gemm (:func:`separate_gemm_biases`: ``Gemm(x, W) + b``, the same parameters under the same
names), so the split sees the pattern it follows for ``MatMul`` + ``Add``: a column-split layer's bias is sliced with
its columns, and a row-split layer's bias is added once, after the all-reduce of the partial products (adding it inside
the Gemm on every rank would add it ``tp`` times).
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import Names, attribute, node_label, report_change


def is_plain_gemm(node: onnx.NodeProto) -> bool:
    """A Gemm the split can slice: ``x @ op(W)`` with no ``transA``, ``alpha`` 1 and no bias input."""
    return (node.op_type == "Gemm" and attribute(node, "transA", 0) == 0 and attribute(node, "alpha", 1.0) == 1.0
            and (len(node.input) < 3 or not node.input[2]))


def transposed(node: onnx.NodeProto) -> bool:
    """Whether the node's weight is stored ``[out, in]`` (a Gemm with ``transB=1``, torch's ``nn.Linear``)."""
    return node.op_type == "Gemm" and attribute(node, "transB", 0) == 1


def weight_axes(is_transposed: bool) -> tuple[int, int]:
    """(column-split axis, row-split axis) of a weight: ``[in, out]`` -> (1, 0); ``[out, in]`` -> (0, 1)."""
    return (0, 1) if is_transposed else (1, 0)


def separate_gemm_biases(model: onnx.ModelProto, trainable, report: list[dict] | None = None) -> onnx.ModelProto:
    """``Gemm(x, W, C)`` with ``W`` a trained 2-D parameter -> ``Add(Gemm(x, W), C)`` (``beta`` folded into a Mul).

    The Add writes the Gemm's output name, so readers are untouched; parameters keep their names and shapes (a
    checkpoint of the split run is a checkpoint of the user's model).
    """
    model = copy.deepcopy(model)
    graph, trainable = model.graph, set(trainable)
    names = Names(graph)
    nodes, changes = [], []
    for node in graph.node:
        if (node.op_type != "Gemm" or len(node.input) < 3 or not node.input[2] or node.input[1] not in trainable
                or attribute(node, "transA", 0) != 0 or attribute(node, "alpha", 1.0) != 1.0):
            nodes.append(node)
            continue
        label, bias, out = node_label(node), node.input[2], node.output[0]
        product = names.new(f"{out}.gemm")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "beta"}
        nodes.append(helper.make_node("Gemm", list(node.input[:2]), [product], name=node.name, **attrs))
        beta = attribute(node, "beta", 1.0)
        if beta != 1.0:
            scale = names.new(f"{out}.beta")
            scaled = names.new(f"{out}.bias_scaled")
            tensor = helper.make_tensor(scale, onnx.TensorProto.FLOAT, [], [beta])
            nodes.append(helper.make_node("Constant", [], [scale], name=names.new(scale), value=tensor))
            nodes.append(helper.make_node("Mul", [bias, scale], [scaled], name=names.new(f"{label}.beta")))
            bias = scaled
        nodes.append(helper.make_node("Add", [product, bias], [out], name=names.new(f"{label}.bias")))
        changes.append(f"Gemm '{label}': bias '{node.input[2]}' added after the product (tensor-parallel split)")
    del graph.node[:]
    graph.node.extend(nodes)
    report_change("separate_gemm_biases", changes, report)
    return model
