"""Key/value heads a tensor-parallel size does not divide, replicated as Megatron-LM does: multi-query attention (one
key/value head: Falcon, GPT-BigCode) at any size, grouped-query attention with fewer key/value heads than ranks.

The key/value projections are not split: every rank computes them whole, with their RoPE and ``repeat_kv``'s expansion
to one key/value head per query head, as replicated nodes before the attention region. Where an attention product
(``q @ k^T``, ``p @ v``) of the region meets the expanded keys or values, each rank reads the block of their head axis
that its query heads read (a ``Slice`` in the rank's model, :func:`slice_heads`). The keys and values are then
replicated activations the region reads: what flows back into them from one rank's query heads is that rank's part of
their gradient, and the sum over the ranks of a parallel piece's replicated side
(:mod:`ortflow.graph.tensor_parallel.tensor_pieces`) gives every rank the whole gradient of the key/value weights, the
same bits on every rank.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.onnx_tools import Names


def _reach(graph: onnx.GraphProto, seeds: set[int]) -> dict[int, set[str]]:
    """Seed node -> every tensor computed from its output."""
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(graph.node):
        for x in n.input:
            readers.setdefault(x, []).append(i)
    found = {}
    for s in seeds:
        seen, todo = set(graph.node[s].output), list(graph.node[s].output)
        while todo:
            for k in readers.get(todo.pop(), []):
                for out in graph.node[k].output:
                    if out not in seen:
                        seen.add(out)
                        todo.append(out)
        found[s] = seen
    return found


def replicated_kv(graph: onnx.GraphProto, shapes: dict[str, list], seeds: set[int],
                  size: int) -> tuple[dict[int, tuple[int, int]], dict[int, set[int]]]:
    """The key/value projections to replicate at ``size``, and the attention products that read them.

    An attention product is a MatMul of two activations over a head axis (``[..., H, T, x]``) whose second input is
    computed from projections its first is not (the keys of ``q @ k^T``, the values of ``p @ v``). Such a projection
    has ``width * H / query width`` heads (the query: the projections its first input is computed from that feed no
    other such projection); it is replicated when ``size`` divides the ``H`` query heads but not its
    heads (with ``size`` dividing both, the split keeps whole key/value heads with the query heads that read them).

    Returns:
        (projection node -> (its key/value heads, the query heads)), and the attention products whose second input
        each rank slices to its query heads' block -> the replicated projections that input is computed from.
    """
    reach = _reach(graph, seeds)
    kv: dict[int, tuple[int, int]] = {}
    products: dict[int, set[int]] = {}
    for i, n in enumerate(graph.node):
        if n.op_type != "MatMul":
            continue
        a, b = n.input[:2]
        da, db = shapes.get(a), shapes.get(b)
        if not da or not db or len(da) < 3 or len(da) != len(db):
            continue
        heads = da[-3]
        if not isinstance(heads, int) or heads % size or db[-3] != heads:
            continue
        first, second = ({s for s in seeds if x in reach[s]} for x in (a, b))
        first, second = first - second - set(kv), second - first  # the earlier layers' projections reach both
        # the query projections, not the layers that feed them (a cross-attention's keys come from another stack, so
        # the earlier layers of the query's stack reach its queries alone: T5's decoder MLPs)
        first = {s for s in first if not any(graph.node[t].input[0] in reach[s] for t in first if t != s)}
        widths = [(shapes.get(graph.node[s].output[0]) or [None])[-1] for s in first]
        query = max((w for w in widths if isinstance(w, int)), default=None)
        if not second or query is None:
            continue
        for s in second:
            width = (shapes.get(graph.node[s].output[0]) or [None])[-1]
            if not isinstance(width, int) or (width * heads) % query:
                continue
            count = width * heads // query
            if count < heads and count % size and heads % count == 0:
                kv[s] = (count, heads)
                products.setdefault(i, set()).add(s)
    return kv, products


def tp_note(counts: tuple[int, int], size: int) -> str:
    """``(1 for 4 query heads, tensor-parallel size 2)``: the counts that make a key/value projection replicated."""
    return f"({counts[0]} for {counts[1]} query heads, tensor-parallel size {size})"


def reads_note(kv_heads: int, heads: int, size: int) -> str:
    """Which key/value heads each rank's query heads read (``rank 0's query heads 0-1 read key/value head 0, ...``)."""
    per, rep = heads // size, heads // kv_heads
    parts = []
    for r in range(size):
        q0, q1 = r * per, (r + 1) * per - 1
        k0, k1 = q0 // rep, q1 // rep
        query = f"query head {q0} reads" if q0 == q1 else f"query heads {q0}-{q1} read"
        parts.append(f"rank {r}'s {query} key/value head{'' if k0 == k1 else 's'} "
                     + (f"{k0}" if k0 == k1 else f"{k0}-{k1}"))
    return ", ".join(parts)


def slice_heads(graph: onnx.GraphProto, names: Names, node: onnx.NodeProto, pos: int, axis: int, full: int,
                size: int, rank: int) -> list[onnx.NodeProto]:
    """The nodes that give ``node``'s input ``pos`` (replicated, ``full`` long on ``axis``) as rank ``rank``'s block of
    ``full / size`` along ``axis``; ``node`` reads the block."""
    x, n = node.input[pos], full // size
    out = names.new(f"{x}.tp{size}.heads")  # the same name on every rank: a piece may send it
    made = []
    inputs = [x]
    for what, value in (("starts", rank * n), ("ends", (rank + 1) * n), ("axes", axis)):
        name = names.new(f"{out}.{what}")
        made.append(helper.make_node("Constant", [], [name], name=names.new(name),
                                     value=numpy_helper.from_array(np.array([value], np.int64), name)))
        inputs.append(name)
    made.append(helper.make_node("Slice", inputs, [out], name=names.new(f"{out}.slice")))
    node.input[pos] = out
    return made
