"""Attention biases with a head axis in the tensor-parallel split: T5's relative position bias and a constant bias
(T5's cross-attention adds zeros ``[1, H, Tq, Tk]`` plus the mask).

T5 computes one bias per stack, in its first layer: ``Gather(table, buckets)`` from a trained ``[num_buckets, H]``
table, transposed to ``[1, H, Tq, Tk]`` (Transpose, Unsqueeze, Slice along the other axes), the mask added, and adds
it to every layer's scores ``[B, H, Tq, Tk]``. That path from the table is a **bias path** (:func:`bias_paths`):
its head axis is the table's columns. An attention split by heads that adds a tensor of a bias path to its scores
reads its heads' block of it; rank ``r`` keeps columns ``[r H/tp, (r+1) H/tp)`` of the table (the same heads as its
query, key and value columns), and each split attention computes its own copy of the path from the rank's columns
(:func:`clone_path`, in the rank's model; the whole path is dropped there). So no split tensor crosses from one layer
to another, and the table's gradient on each rank is the sum of every layer's over its own columns, as torch's on
those columns. A table is split only when every tensor of its path is read by the path itself or added to the
scores of an attention split by heads; otherwise every attention that reads it is kept whole, with the reason.

A bias that no trained parameter computes (a constant, a mask) and that is as long as the heads on the split axis is
read the way replicated keys and values are (:mod:`ortflow.graph.tensor_parallel.tensor_kv`): each rank slices its
heads' block of it.
"""

from __future__ import annotations

import onnx

from ortflow.graph.onnx_tools import Names, attribute, node_label
from ortflow.graph.tensor_parallel.tensor_axes import moved_axis
from ortflow.graph.tensor_parallel.tensor_shapes import static_ints

#: Ops a bias path goes through with its head axis: moved, or unchanged with the others broadcast along it (the mask).
_MOVES = {"Transpose", "Unsqueeze", "Squeeze", "Slice"}
_SAME = {"Cast", "Identity", "Add", "Sub", "Mul", "Div", "Where"}


class BiasPaths:
    """The bias paths of a graph: for each tensor on one, its table, its head axis (negative) and the nodes of the
    path that compute it (in graph order); for each table, every node outside its path that reads it."""

    def __init__(self, graph: onnx.GraphProto, trainable: set[str], shapes: dict[str, list],
                 producers: dict[str, int], readers: dict[str, list[int]], inputs: set[str]):
        self.axis: dict[str, int] = {}
        self.table: dict[str, str] = {}
        self.nodes: dict[str, tuple[int, ...]] = {}
        self.exits: dict[str, set[tuple[int, str]]] = {}  # table -> (node, path tensor) read outside the path
        self.outputs: dict[str, set[str]] = {}  # table -> its path's tensors
        for table in sorted(trainable):
            gathers = readers.get(table, [])
            if len(shapes.get(table) or []) != 2 or not gathers or not all(
                    _is_lookup(graph, producers, inputs, graph.node[i], table) for i in gathers):
                continue
            for i in gathers:
                self._mark(table, graph.node[i].output[0], -1, (i,))
            self._follow(graph, shapes, producers, readers, table, min(gathers))

    def _mark(self, table: str, name: str, axis: int, nodes: tuple[int, ...]) -> None:
        self.axis[name], self.table[name], self.nodes[name] = axis, table, nodes
        self.outputs.setdefault(table, set()).add(name)

    def _follow(self, graph, shapes, producers, readers, table: str, start: int) -> None:
        for i in range(start + 1, len(graph.node)):  # in graph order: a node's inputs are marked before it
            node = graph.node[i]
            on = [x for x in node.input if x in self.outputs.get(table, ())]
            if not on:
                continue
            axis = self._through(graph, shapes, producers, node, on)
            if axis is None:
                self.exits.setdefault(table, set()).update((i, x) for x in on)
                continue
            nodes = tuple(sorted({k for x in on for k in self.nodes[x]} | {i}))
            self._mark(table, node.output[0], axis, nodes)

    def _through(self, graph, shapes, producers, node, on: list[str]) -> int | None:
        """The head axis of ``node``'s output when it carries the path's head axis, else None (it reads the path)."""
        x = on[0]
        axis, rank = self.axis[x], len(shapes.get(x) or [])
        if len(node.output) != 1 or not rank or any(self.axis[y] != axis for y in on):
            return None
        if node.op_type == "Transpose":
            perm = attribute(node, "perm") or list(range(rank))[::-1]
            return perm.index(rank + axis) - rank
        if node.op_type in _MOVES and node.input[0] == x and len(on) == 1:
            static = [static_ints(graph, producers, y) if y else None for y in node.input[1:]]
            moved = moved_axis(node, rank, rank + axis, static, (shapes.get(x) or [None])[axis])
            return None if isinstance(moved, str) else moved
        if node.op_type in _SAME and not (node.op_type == "Where" and node.input[0] in on):
            for y in node.input:  # the others broadcast along the head axis (the mask) or on the path alike
                dims = shapes.get(y)
                if y in on or dims is None or -axis > len(dims) or dims[axis] in (1, None):
                    continue
                return None
            out = shapes.get(node.output[0])
            return axis if out is not None and len(out) >= -axis else None
        return None

    def problem(self, table: str, accepted: set[tuple[int, str]], outputs: set[str],
                graph: onnx.GraphProto) -> str | None:
        """Why ``table`` cannot be split by its columns, given the reads the split attentions ``accepted`` (node, path
        tensor), or None."""
        for name in sorted(self.outputs[table] & outputs):
            return f"its bias path's '{name}' is a graph output"
        for i, x in sorted(self.exits.get(table, set()) - accepted):
            node = graph.node[i]
            return f"its bias '{x}' is also read by {node.op_type} '{node_label(node)}', which is not split by heads"
        return None


def _is_lookup(graph: onnx.GraphProto, producers: dict[str, int], inputs: set[str], node: onnx.NodeProto,
               table: str) -> bool:
    """``Gather(table, ids)`` along the rows with ids computed in the graph (buckets, positions), not read from the
    model's inputs (a token embedding: :mod:`ortflow.graph.tensor_parallel.tensor_vocab` splits those)."""
    if node.op_type != "Gather" or node.input[0] != table or attribute(node, "axis", 0) != 0:
        return False
    ids = node.input[1]
    while ids in producers and graph.node[producers[ids]].op_type in ("Cast", "Reshape", "Identity", "Unsqueeze",
                                                                       "Squeeze", "Flatten"):
        ids = graph.node[producers[ids]].input[0]
    return ids not in inputs and ids in producers


def parameter_free(graph: onnx.GraphProto, trainable: set[str], producers: dict[str, int], name: str,
                   memo: dict[str, bool]) -> bool:
    """Whether no trained parameter is among the ancestors of ``name`` (a constant, a mask, shape arithmetic)."""
    todo = [name]
    while todo:
        x = todo[-1]
        if x in memo:
            todo.pop()
            continue
        if x in trainable:
            memo[x] = False
            todo.pop()
            continue
        i = producers.get(x)
        ins = [y for y in graph.node[i].input if y] if i is not None else []
        pending = [y for y in ins if y not in memo]
        if pending:
            todo += pending
            continue
        memo[x] = all(memo[y] for y in ins)
        todo.pop()
    return memo[name]


def clone_path(graph: onnx.GraphProto, names: Names, nodes: tuple[int, ...], outputs: tuple[str, ...],
               suffix: str) -> list[onnx.NodeProto]:
    """Copies of the bias path's ``nodes`` computing into ``outputs`` (the plan's names, one per node), each reading
    the copies before it: one split attention's own bias from the rank's columns of the table."""
    renamed, made = {}, []
    for i, out in zip(nodes, outputs, strict=True):
        node = onnx.NodeProto()
        node.CopyFrom(graph.node[i])
        for k, x in enumerate(node.input):
            node.input[k] = renamed.get(x, x)
        renamed[node.output[0]] = out
        node.output[0] = out
        node.name = names.new(f"{node.name or node.op_type}.{suffix}")
        made.append(node)
    return made
