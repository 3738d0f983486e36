"""Vocabulary split of the embedding and the LM head (Megatron-LM's ``VocabParallelEmbedding`` and a column-parallel
LM head with its output gathered).

A table ``W`` (``[V, C]``, trained) read by ``Gather(W, ids)`` with ``ids`` a graph input is an **embedding**; ``W``
read by ``MatMul(x, W)`` (``[C, V]``), ``MatMul(x, Transpose(W))`` (tied: the embedding's ``[V, C]`` table) or a
bias-free ``Gemm(x, W)`` whose output reaches a graph output through reshapes (or whose table is also an embedding)
is an **LM head** when the model embeds a vocabulary of that size (a classifier's last layer is not one). Every use
of a table must read the vocabulary along the same axis (tied weights: both uses slice the same rows), and ``tp``
must divide ``V``; otherwise the table stays replicated and the reason is logged.

Rank ``r`` keeps rows ``[r V/tp, (r+1) V/tp)`` of the vocabulary:

* embedding: ids outside its rows are masked (read as local row 0, then zeroed), so each rank's output holds the
  rows it owns and zeros elsewhere; the all-reduce after the region adds them (adding zeros is exact: the sum is the
  unsplit Gather bit for bit). The gradient of the table's rows is the unsplit one restricted to the rank's rows.
* LM head: each rank computes the logits of its vocabulary columns and pads them with zeros to ``[..., V]``; the
  all-reduce then concatenates them (the all-gather of Megatron's ``gather_output``), so the graph's ``[B, T, V]``
  logits, the loss and everything after stay as the user wrote them. The input gradient ``dx`` is a partial sum,
  added over the ranks like any split region's. This moves ``tp`` times the logits' bytes where an all-gather would
  move them once; a vocabulary-parallel cross entropy (which never forms whole logits) is not done here.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.onnx_tools import Names, node_label, opset_version
from ortflow.graph.tensor_parallel.tensor_gemm import is_plain_gemm, transposed
from ortflow.graph.tensor_parallel.tensor_plan import Region

#: Ops that pass logits on unchanged but for their shape (an LM head's output reaches the graph output through them).
_RESHAPES = {"Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze"}

#: Pad with ``pads`` as an input (11) and Unsqueeze with ``axes`` as an input (13).
MIN_OPSET = 13


class _Graph:
    def __init__(self, model: onnx.ModelProto, shapes: dict[str, list]):
        self.g, self.shapes = model.graph, shapes
        self.readers: dict[str, list[int]] = {}
        self.producer: dict[str, int] = {}
        for i, n in enumerate(self.g.node):
            for x in n.input:
                self.readers.setdefault(x, []).append(i)
            self.producer.update(dict.fromkeys(n.output, i))
        self.inputs = {i.name for i in self.g.input}
        self.outputs = {o.name for o in self.g.output}

    def reaches_output(self, name: str) -> bool:
        """Whether ``name`` is a graph output or becomes one through reshapes only."""
        if name in self.outputs:
            return True
        return any(self.g.node[i].op_type in _RESHAPES and self.reaches_output(self.g.node[i].output[0])
                   for i in self.readers.get(name, []))

    def use(self, i: int, table: str):
        """How node ``i`` reads ``table``: ("embedding" | "head", vocabulary axis, nodes), or why it cannot split."""
        n = self.g.node[i]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Gather" and n.input[0] == table and attrs.get("axis", 0) == 0:
            ids = n.input[1]
            # ids are a graph input, maybe cast or reshaped (HF's input_ids.view(-1, seq))
            while ids in self.producer and self.g.node[self.producer[ids]].op_type in {"Cast", *_RESHAPES}:
                ids = self.g.node[self.producer[ids]].input[0]
            if ids not in self.inputs:
                return f"Gather '{node_label(n)}' reads ids computed in the graph, not a graph input (positions?)"
            return "embedding", 0, [i]
        if n.op_type == "Transpose" and list(attrs.get("perm", [1, 0])) == [1, 0]:
            rs = self.readers.get(n.output[0], [])
            if len(rs) == 1 and self.g.node[rs[0]].op_type == "MatMul" and self.g.node[rs[0]].input[1] == n.output[0]:
                return "head", 0, [i, rs[0]]
        if n.op_type == "MatMul" and n.input[1] == table:
            return "head", 1, [i]
        if is_plain_gemm(n) and n.input[1] == table:
            return "head", 0 if transposed(n) else 1, [i]
        return f"{n.op_type} '{node_label(n)}' reads it"


def plan_vocab(model: onnx.ModelProto, trainable, size: int, shapes: dict[str, list], sliced: set[str],
               kept: dict[str, str], embedded: frozenset[str] = frozenset()) -> list[Region]:
    """The vocabulary-split regions of ``model`` (one per embedding Gather and per LM head); records in ``kept`` why
    a table that looks like an embedding or LM head stays replicated (and drops the tables it splits from it).
    ``embedded``: tables the whole model splits by vocabulary, for a pipeline stage's graph: its embedding or LM head
    (the last stage's LM head, whose embedding is in the first stage; an LM head tied to another stage's embedding)."""
    if opset_version(model) < MIN_OPSET:
        return []
    graph, names, regions = _Graph(model, shapes), Names(model.graph), []
    tables = [t for t in sorted(set(trainable) - sliced) if len(shapes.get(t, [])) == 2]
    uses = {t: [graph.use(i, t) for i in graph.readers.get(t, [])] for t in tables}
    vocabularies = {shapes[t][u[1]] for t in tables for u in uses[t]
                    if isinstance(u, tuple) and (u[0] == "embedding" or t in embedded)}
    for table in tables:
        # an LM head is the output layer of a model that embeds a vocabulary of its width (not a classifier's head)
        found = [u for u in uses[table] if isinstance(u, tuple) and (u[0] == "embedding"
                                                                      or shapes[table][u[1]] in vocabularies)]
        if not found:
            continue
        why = next((u for u in uses[table] if isinstance(u, str)), None)
        axes = {u[1] for u in found}
        embedding = table in embedded or any(u[0] == "embedding" for u in found)
        if why is None and len(axes) > 1:
            why = "its uses read the vocabulary along different axes"
        for kind, _, nodes in found:
            y = graph.g.node[nodes[-1]].output[0]
            if why is None and kind == "head" and not (embedding or graph.reaches_output(y)):
                why = f"'{y}' is neither a model output nor tied to an embedding (not an LM head)"
            if why is None and kind == "head" and shapes.get(y) is None:
                why = f"the rank of '{y}' is not known"
        vocab = shapes[table][min(axes)]
        if why is None and vocab % size:
            why = f"horizontal_parallel_size {size} does not divide the vocabulary {vocab}"
        if why is not None:
            kept[table] = f"vocabulary split: {why}"
            continue
        kept.pop(table, None)
        for kind, axis, nodes in found:
            regions.append(_region(graph, names, table, kind, axis, nodes))
    return regions


def _region(graph: _Graph, names: Names, table: str, kind: str, axis: int, nodes: list[int]) -> Region:
    last = graph.g.node[nodes[-1]]
    y = last.output[0]
    if kind == "embedding":
        return Region(vocab={table: axis}, outputs=[y], nodes=nodes, members=[names.new(f"{y}.tp_vocab_rows"), y])
    local, padded = names.new(f"{y}.tp_vocab_local"), names.new(f"{y}.tp_vocab_padded")
    before = [graph.g.node[i].output[0] for i in nodes[:-1]]  # the tied table's Transpose
    return Region(vocab={table: axis}, outputs=[padded], inputs=[last.input[0]], nodes=nodes,
                  heads={y: len(graph.shapes[y])}, members=[*before, local, padded])


def shard_vocab(graph: onnx.GraphProto, region: Region, size: int, rank: int, names: Names,
                dims: dict[str, list[int]]) -> dict[int, list[onnx.NodeProto]]:
    """Rank ``rank``'s nodes for one vocabulary region (``dims``: the initializers' shapes after slicing): node index
    -> the nodes that replace it."""
    ((table, axis),) = region.vocab.items()
    rows = dims[table][axis]  # this rank's share of the vocabulary
    out: dict[int, list[onnx.NodeProto]] = {}
    for i in region.nodes:
        node = graph.node[i]
        if node.op_type == "Gather":
            out[i] = _embedding_nodes(node, region.members[0], rank * rows, rows, names)
        elif node.op_type in ("MatMul", "Gemm"):
            y = node.output[0]
            local, padded = region.members[-2], region.members[-1]
            product = onnx.NodeProto()
            product.CopyFrom(node)
            product.output[0] = local
            r = region.heads[y]
            pads = [0] * (2 * r)
            pads[r - 1], pads[2 * r - 1] = rank * rows, (size - 1 - rank) * rows
            pad_const = _const(names, f"{y}.tp_vocab_pads", np.asarray(pads, np.int64))
            out[i] = [product, pad_const[0],
                      helper.make_node("Pad", [local, pad_const[1]], [padded], name=names.new(f"{y}.tp_vocab_pad")),
                      helper.make_node("Identity", [padded], [y], name=names.new(f"{y}.tp_vocab_gathered"))]
    return out


def _const(names: Names, base: str, value: np.ndarray) -> tuple[onnx.NodeProto, str]:
    name = names.new(base)
    return helper.make_node("Constant", [], [name], name=names.new(f"{base}/const"),
                            value=numpy_helper.from_array(value, name)), name


def _embedding_nodes(node: onnx.NodeProto, rows_name: str, start: int, rows: int,
                     names: Names) -> list[onnx.NodeProto]:
    """``Gather(W_r, ids - start)`` where ``start <= ids < start + rows``, zeros elsewhere (Megatron's masking)."""
    table, ids, y = node.input[0], node.input[1], node.output[0]
    label = node_label(node)
    consts = {k: _const(names, f"{y}.tp_vocab_{k}", v) for k, v in (
        ("start", np.asarray(start, np.int64)), ("rows", np.asarray(rows, np.int64)),
        ("zero", np.asarray(0, np.int64)), ("zerof", np.asarray(0, np.float32)), ("axes", np.asarray([-1], np.int64)))}
    c = {k: v[1] for k, v in consts.items()}

    def t(suffix: str) -> str:
        return names.new(f"{y}.tp_vocab_{suffix}")

    def make(op: str, inputs: list[str], output: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=names.new(f"{label}/tp_vocab_{op.lower()}"), **attrs)

    ids64, local, below, above, inside, safe, mask = (t(s) for s in ("ids", "local", "below", "not_below", "inside",
                                                                      "safe", "mask"))
    inside_lt = t("lt")
    return [*(v[0] for v in consts.values()),
            make("Cast", [ids], ids64, to=onnx.TensorProto.INT64),
            make("Sub", [ids64, c["start"]], local),
            make("Less", [local, c["zero"]], below),
            make("Not", [below], above),
            make("Less", [local, c["rows"]], inside_lt),
            make("And", [above, inside_lt], inside),
            make("Where", [inside, local, c["zero"]], safe),  # ids of other ranks read local row 0 ...
            helper.make_node("Gather", [table, safe], [rows_name], name=node.name or names.new(label), axis=0),
            make("Unsqueeze", [inside, c["axes"]], mask),
            make("Where", [mask, rows_name, c["zerof"]], y)]  # ... and are zeroed here
