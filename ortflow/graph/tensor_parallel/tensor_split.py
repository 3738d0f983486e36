"""Tensor-parallel split, Megatron-LM style: find the wide layers, and each rank's slice of the model.

A **region** starts at column-split MatMuls (``x @ W`` with ``W`` a 2-D trainable initializer; each rank keeps a
block of ``W``'s columns and of the bias added right after) and ends at row-split MatMuls (the region's activation,
split on its last axis, times a 2-D trainable weight; each rank keeps the matching block of rows, so the product is a
partial sum that the ranks add: the forward all-reduce). In between the activation stays split on one axis through
element-wise ops, Reshape/Transpose (Q/K/V by heads), Unsqueeze/Squeeze, Slice and Concat along another axis (RoPE's
``rotate_half`` of the head dim), Expand over another axis (grouped-query attention's ``repeat_kv``: each rank's
key/value heads are those its query heads read), Softmax over another axis, MatMul of two split tensors over a batch
axis (scores and context), the head axis merged with the batch axis before it for such products (``[B * H, T,
D]``: :mod:`ortflow.graph.tensor_parallel.tensor_merged`), the parts of a fused projection (QKV, gate and up) read by
a ``Split`` or by ``Slice``s of its columns (each rank keeps its block of every part:
:mod:`ortflow.graph.tensor_parallel.tensor_fused`), and Expand of a replicated tensor to a split tensor's ``Shape``
(the Where gradient fix on a causal mask's fill), and a bias as long as the heads added to the scores (T5's relative
position bias, each rank computing it from its heads' columns of the table; a bias without parameters, each rank
reading its heads' block: :mod:`ortflow.graph.tensor_parallel.tensor_bias`). The bias after a
row-split MatMul is added once, after the all-reduce; it and everything outside a region stay replicated.

Shape entries that carry a head count or width are rewritten for the local size where they are constants
(:mod:`ortflow.graph.tensor_parallel.tensor_shapes` follows the exporters' shape arithmetic); sizes read from a split
tensor's ``Shape`` follow by themselves. A candidate whose activation reaches something else (a graph output, an unknown
op, a parameter that would need slicing) stays replicated, with the reason (a WARNING); one whose input only kept
layers compute (the output projection of an attention kept whole) names them as the reason. Key/value projections
whose heads ``tp`` does not divide (multi-query attention) stay whole on every rank, before the region, whose attention
products read each rank's block of their heads (:mod:`ortflow.graph.tensor_parallel.tensor_kv`). A size ``tp`` that
does not divide a width or the query heads (of each part of a fused QKV projection) is refused, naming the projections
and the sizes that fit.

A bias-free ``Gemm`` (:mod:`ortflow.graph.tensor_parallel.tensor_gemm`) is a weight product like ``MatMul``; its ``[out,
in]`` weight swaps the axes, as does a weight read as ``Transpose(W)`` (torch's ``nn.Linear`` on 3-D inputs), whose
``Transpose`` is a node of the region: each rank transposes its own slice in its piece, so the slice's gradient stays
its own. Embeddings and LM heads are split by vocabulary in regions of their own
(:mod:`ortflow.graph.tensor_parallel.tensor_vocab`).
"""

from __future__ import annotations

import onnx

from ortflow.graph.onnx_tools import Names
from ortflow.graph.tensor_parallel.tensor_gemm import is_plain_gemm, transposed
from ortflow.graph.tensor_parallel.tensor_kv import replicated_kv, tp_note
from ortflow.graph.tensor_parallel.tensor_plan import (
    Region,
    TensorParallelError,  # noqa: F401 - raised by plan_tensor_parallel_split; callers import it from here
    TensorParallelPlan,
    check_rewrites_private,
    check_sizes,
    describe,
    log_plan,
)
from ortflow.graph.tensor_parallel.tensor_shapes import tensor_dims, weight_of
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_vocab import plan_vocab
from ortflow.graph.tensor_parallel.tensor_walk import SplitWalk


def plan_tensor_parallel_split(model: onnx.ModelProto, trainable: list[str] | set[str], size: int,
                               embedded: frozenset[str] = frozenset(), unsplit: bool = False) -> TensorParallelPlan:
    """Find the regions to split over ``size`` ranks (pure; nothing is changed). ``embedded``: tables the whole model
    splits by vocabulary, when ``model`` is one pipeline stage of it (the last stage's LM head, whose embedding is in
    the first stage; an LM head tied to another stage's embedding).
    ``unsplit``: a plan with no region is returned (a pipeline stage its tensor-parallel ranks run whole) rather than
    refused.

    Raises:
        TensorParallelError: ``size`` does not divide a split width or head count (names them and the fix), or no
            region was found (without ``unsplit``).
    """
    trainable = set(trainable)
    dims = tensor_dims(model)
    candidates = _candidates(model.graph, trainable, dims[0])
    kv, products = replicated_kv(model.graph, dims[0], set(candidates), size)
    seeds, kept = set(candidates) - set(kv), {}
    for n in model.graph.node:  # a layer the pass could split once its bias is taken out (configure does)
        if n.op_type == "Gemm" and not is_plain_gemm(n) and n.input[1] in trainable:
            kept[n.input[1]] = "a Gemm with transA, alpha or a bias input (separate_gemm_biases takes biases out first)"
    while True:
        walk = SplitWalk(model, trainable, seeds, size, dims, products)
        downstream = {s for s in seeds if model.graph.node[s].input[0] in walk.split}
        if downstream:  # fed by another seed's activation: a row-split MatMul, not a seed
            seeds -= downstream
            continue
        _refuse_tables(model.graph, walk)
        failed = {s for s in seeds if walk.find(s) in walk.failed}
        ends = {walk.find(walk.node_comp[r]) for r in walk.rows}
        unended = {s for s in seeds if walk.find(s) not in ends} - failed
        for s in failed | unended:
            kept[candidates[s]] = walk.failed.get(walk.find(s), "its activation never reaches a row-split MatMul")
        if not (failed | unended):
            break
        seeds -= failed | unended
    regions = _regions(model.graph, walk, seeds, candidates, kv, products)
    for r in walk.rows.values():
        kept.pop(r, None)
    held = {s for s, w in candidates.items() if w in kept}
    for s in sorted(held):  # an output projection after its attention was kept whole: say so, not where it stopped
        before = _follow_on(model.graph, trainable, walk.producers, candidates, held - {s}, s)
        if before:
            kept[candidates[s]] = f"its input is not split: the layer before it ({', '.join(before)}) is kept whole"
    read = {w for r in regions for w in r.replicated_kv}
    kept.update({candidates[s]: f"key/value heads {tp_note(kv[s], size)}, and no split attention reads them"
                 for s in kv if candidates[s] not in read})
    split_so_far = set(TensorParallelPlan(size, regions, [], {}).slicing())
    regions += plan_vocab(model, trainable, size, walk.shapes, split_so_far, kept, embedded)
    plan = TensorParallelPlan(size, regions, [w[:4] for w in walk.rewrites], kept,
                              [x[:4] for x in walk.slices if walk.find(x[4]) not in walk.failed],
                              *_bias_copies(model.graph, walk, regions))
    check_sizes(model, plan, walk.shapes, walk.head_counts, unsplit)
    check_rewrites_private(model, plan, walk.readers)
    return plan


def _candidates(graph: onnx.GraphProto, trainable: set[str], shapes: dict[str, list]) -> dict[int, str]:
    """MatMul (or bias-free Gemm) nodes whose second input is a 2-D trainable weight read only there: node index ->
    weight."""
    readers: dict[str, list[int]] = {}
    producers: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        for x in n.input:
            readers.setdefault(x, []).append(i)
        producers.update(dict.fromkeys(n.output, i))
    found = {}
    for i, n in enumerate(graph.node):
        if n.op_type == "MatMul" or is_plain_gemm(n):
            weight = weight_of(graph, n.input[1], trainable, producers, readers)
            if weight is not None and len(shapes.get(weight[0], [])) == 2 and len(readers[weight[0]]) == 1:
                found[i] = weight[0]
    return found


def _follow_on(graph: onnx.GraphProto, trainable: set[str], producers: dict[str, int], candidates: dict[int, str],
               kept: set[int], node: int) -> list[str]:
    """The kept candidates (``kept``: their nodes) whose outputs alone compute candidate ``node``'s input, with their
    biases, constants and the model's inputs (an attention's output projection after the attention was kept whole:
    its input is not split because of them); empty when another parameter or a split layer feeds it too."""
    found, seen, todo = set(), set(), [graph.node[node].input[0]]
    while todo:
        x = todo.pop()
        if x in seen or not x:
            continue
        seen.add(x)
        i = producers.get(x)
        if x in trainable or (i in candidates and i not in kept):
            return []
        if i is None or graph.node[i].op_type in ("Shape", "Size"):  # a size: the same whatever the values
            continue
        if i in candidates:
            found.add(i)
            continue
        n = graph.node[i]
        after = any(producers.get(y) in kept for y in n.input) and n.op_type == "Add"  # a bias added to its output
        todo += [y for y in n.input if not (after and y in trainable)]
    return sorted(candidates[i] for i in found)


def _regions(graph, walk: SplitWalk, seeds: set[int], candidates: dict[int, str],
             kv: dict[int, tuple[int, int]], products: dict[int, set[int]]) -> list[Region]:
    by_root: dict[int, Region] = {}
    for s in sorted(seeds):
        r = by_root.setdefault(walk.find(s), Region())
        r.columns.append(candidates[s])
        if transposed(graph.node[s]) or graph.node[s].input[1] != candidates[s]:  # Gemm transB=1, or Transpose(W)
            r.transposed.append(candidates[s])
        if graph.node[s].input[1] != candidates[s]:
            r.nodes.append(walk.producers[graph.node[s].input[1]])
        if s in walk.seed_heads:
            r.num_heads[candidates[s]] = walk.seed_heads[s]
        walk.parts.mark(r, s, candidates[s])
        x = graph.node[s].input[0]
        if x not in r.inputs:
            r.inputs.append(x)
    for i, c in sorted(walk.node_comp.items()):
        r = by_root[walk.find(c)]
        r.nodes.append(i)
        if i in walk.rows:
            r.rows.append(walk.rows[i])
            if transposed(graph.node[i]) or walk.rows[i] in walk.via_transpose:
                r.transposed.append(walk.rows[i])
            if walk.rows[i] in walk.via_transpose:
                r.nodes.append(walk.producers[graph.node[i].input[1]])
            r.outputs.append(graph.node[i].output[0])
        if i in walk.biases:
            r.biases.append(walk.biases[i])
            walk.parts.mark(r, walk.bias_of[graph.node[i].output[0]], walk.biases[i], bias=True)
    for i, pos, _, _, c in walk.slices:  # the replicated key/value projections whose heads the product reads
        if i in products:
            by_root[walk.find(c)].replicated_kv.update({candidates[s]: kv[s] for s in sorted(products[i])})
        elif graph.node[i].input[pos] not in by_root[walk.find(c)].head_slices:  # a bias without parameters
            by_root[walk.find(c)].head_slices.append(graph.node[i].input[pos])
    for _, x, c in walk.bias_reads:  # a relative position bias: the table's columns of the region's heads
        by_root[walk.find(c)].position_bias[walk.bias.table[x]] = 1
    for r in by_root.values():
        r.nodes.sort()
    return [by_root[k] for k in sorted(by_root)]


def _refuse_tables(graph: onnx.GraphProto, walk: SplitWalk) -> None:
    """Keep whole every attention that adds the bias of a relative position bias table that cannot be split by its
    columns (:mod:`ortflow.graph.tensor_parallel.tensor_bias`: a tensor of its path read by anything but the path and
    the scores of attentions split by heads), until every table read is splittable or kept whole."""
    outputs = {o.name for o in graph.output}
    while True:
        accepted: dict[str, set[tuple[int, str]]] = {}
        for i, x, c in walk.bias_reads:
            if walk.find(c) not in walk.failed:
                accepted.setdefault(walk.bias.table[x], set()).add((i, x))
        refused = {t: walk.bias.problem(t, accepted[t], outputs, graph) for t in sorted(accepted)}
        failing = [(c, t) for _, x, c in walk.bias_reads
                   if refused.get(t := walk.bias.table[x]) and walk.find(c) not in walk.failed]
        if not failing:
            return
        for c, t in failing:
            walk.fail(c, f"the relative position bias table '{t}' cannot be split by its heads' columns: {refused[t]}")


def _bias_copies(graph: onnx.GraphProto, walk: SplitWalk, regions: list[Region]) -> tuple[list, list[int]]:
    """Each split attention's own copy of the bias path it reads (the names of the copies' outputs, which join the
    region's members), and the nodes of the split tables' paths, which the ranks' models leave out."""
    tables = {t for r in regions for t in r.position_bias}
    if not tables:
        return [], []
    names, copies = Names(graph), []
    by_root = {}
    for r in regions:  # the region of each bias read: the one holding its Add
        by_root.update(dict.fromkeys(r.nodes, r))
    for i, x, _ in walk.bias_reads:
        nodes = walk.bias.nodes[x]
        outs = tuple(names.new(f"{graph.node[k].output[0]}.tp_bias") for k in nodes)
        copies.append((i, x, nodes, outs))
        r = by_root[i]
        r.members = r.members or [graph.node[k].output[0] for k in r.nodes]
        r.members += outs
    dropped = sorted({walk.producers[x] for t in tables for x in walk.bias.outputs[t]})
    return copies, dropped


def split_for_rank(model: onnx.ModelProto, trainable, size: int, rank: int,
                   report: list[dict] | None = None) -> tuple[onnx.ModelProto, TensorParallelPlan]:
    """Plan (logging what it split and kept) and shard for ``rank``: the pass of configure."""
    plan = plan_tensor_parallel_split(model, trainable, size)
    lines = describe(plan)
    if rank == 0:
        log_plan(plan)
        if report is not None:
            report.append({"pass": "tensor_parallel", "changes": lines})
    return shard_model(model, plan, rank), plan
