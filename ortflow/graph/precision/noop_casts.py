"""Casts to the type their input already has (TorchScript exports of Hugging Face models write one at the start of
every RMSNorm, ``hidden_states.to(torch.float32)`` on a float32 model) are dropped before a graph is cut: a piece that
only passes such a Cast on (a received tensor sent on under the Cast's name) is a graph the engine's training graph
builder rejects ("Graph output ... does not exist in the graph": its Cast elimination removes the node between a graph
input and a graph output). Readers read the Cast's input instead; values are unchanged."""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import elem_types, node_label, report_change, subgraph_reads


def drop_noop_casts(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``model`` without its Casts to their input's own type (but those whose output is a graph output or read inside
    a subgraph)."""
    types = elem_types(model)
    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:  # names read inside If/Loop bodies keep their Cast
        outputs |= subgraph_reads(node)
    rename, changes = {}, []
    for node in model.graph.node:
        if node.op_type != "Cast" or node.output[0] in outputs:
            continue
        to = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "to"), None)
        source = rename.get(node.input[0], node.input[0])
        if to is not None and types.get(node.input[0]) == to:
            rename[node.output[0]] = source
            changes.append(f"Cast '{node_label(node)}' to its input's own type dropped")
    if not rename:
        return model
    model = copy.deepcopy(model)
    kept = [n for n in model.graph.node if not (n.op_type == "Cast" and n.output[0] in rename)]
    for node in kept:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    report_change("drop_noop_casts", changes, report)
    return model
