"""Route a parameter that one node reads twice (``MatMul(W, W)``, ``Mul(w, w)``) through an ``Identity``.

The engine's gradient builder names the gradient of each input after the input; a float initializer read twice by
one node (and nowhere else) makes two definitions of the same gradient name and the build fails with "Duplicate
definition of name" (measured with onnxruntime-training 1.19.2). Reading the second occurrence through an Identity
gives it its own name; the Identity's gradient passes through, and the engine sums both contributions into the
parameter's gradient. Values are unchanged.
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import Names, node_label, report_change


def separate_repeated_inputs(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Read every repeated initializer input of a node, after its first occurrence, through a new Identity node.

    Args:
        model: The model (left unchanged).
        report: When given, receives one entry describing the change.

    Returns:
        A new model; initializers are untouched.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    names = Names(graph)
    changes, new_nodes = [], []
    for node in graph.node:
        seen: set[str] = set()
        for i, name in enumerate(node.input):
            if name not in initializers:
                continue
            if name in seen:
                copy_name = names.new(f"{name}.read{i}")
                new_nodes.append(helper.make_node("Identity", [name], [copy_name], name=names.new(f"{copy_name}/id")))
                node.input[i] = copy_name
                changes.append(f"{node.op_type} '{node_label(node)}' reads '{name}' twice: input {i} via Identity")
            seen.add(name)
        new_nodes.append(node)
    if changes:
        del graph.node[:]
        graph.node.extend(new_nodes)
    report_change("separate_repeated_inputs", changes, report)
    return model
