"""The embedding tables a model's integer inputs index: how many token ids each input can take.

A token id at or past the rows of the table it indexes is not checked by the engine: the CPU ``Gather`` kernel fails
the step with an index error (mid-training, after the data is prepared), and a read through the repeatable-gradient
``GatherND`` rewrite or on a GPU can read memory past the table. The data stage therefore compares its tokenizer's
vocabulary with the rows found here (``ortflow validate`` and ``prepare-data``).

An input's ids reach the ``Gather`` directly (the dynamo exporter) or through nodes that keep the values (a
TorchScript export of a Hugging Face model reshapes them to ``[-1, seq]`` first; a cast to int32 or int64). The
table is an initializer read directly or through ``Identity`` nodes (tied weights); its rows are its dims along the
Gather's axis, read from the proto, so the weights need not be loaded.
"""

from __future__ import annotations

import onnx

#: Ops whose first output holds the values of their first input, reordered or reshaped but unchanged.
_VALUE_KEEPING = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}


def token_tables(model: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """Each graph input -> the ``(table, rows)`` of every embedding table its values index, in graph order.

    Args:
        model: The model; initializers need only their dims (``onnx.load(..., load_external_data=False)`` suffices).

    Returns:
        Only inputs that index at least one table appear.
    """
    graph = model.graph
    dims = {t.name: list(t.dims) for t in graph.initializer}
    identity = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity" and n.input and n.output}
    source = {i.name: i.name for i in graph.input if i.name not in dims}  # tensor -> the graph input it carries
    found: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:  # nodes are in topological order (an ONNX requirement)
        if node.op_type in _VALUE_KEEPING and node.input and node.input[0] in source and node.output:
            source[node.output[0]] = source[node.input[0]]
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in source:
            continue
        table = node.input[0]
        while table in identity and table not in dims:
            table = identity[table]
        if table not in dims or not dims[table]:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        rows = dims[table][axis if axis >= 0 else axis + len(dims[table])]
        entry = (table, int(rows))
        tables = found.setdefault(source[node.input[1]], [])
        if entry not in tables:
            tables.append(entry)
    return found
