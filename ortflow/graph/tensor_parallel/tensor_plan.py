"""What a tensor-parallel split decides (:mod:`ortflow.graph.tensor_parallel.tensor_split` plans it,
:mod:`.tensor_vocab` adds the vocabulary splits, :mod:`.tensor_shard` applies it to one rank's model)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx

from ortflow.graph.onnx_tools import node_label
from ortflow.graph.tensor_parallel.tensor_gemm import weight_axes
from ortflow.graph.tensor_parallel.tensor_kv import reads_note
from ortflow.tensor_slices import part_widths

log = logging.getLogger("ortflow.graph.tensor_parallel.tensor_split")


class TensorParallelError(ValueError):
    """The tensor-parallel split is impossible at this size; the message names the tensors and the fix."""


@dataclass
class Region:
    """One split region (an attention block or an MLP): what each rank slices and what the ranks add up.

    Attributes:
        columns: Column-split weights (``[in, out]``: each rank keeps ``out / tp`` columns of every part).
        biases: Column-split biases (sliced like their weight's columns).
        rows: Row-split weights (each rank keeps ``in / tp`` rows).
        groups: Parts of a column-split weight, by name: their number when equal (3 for a fused QKV projection
            whose output is Split in 3), else their widths in column order (Phi-3's ``qkv_proj`` under grouped-query
            attention: the query part wider than the key and value parts); each rank keeps its block of every part.
        outputs: The row-split MatMuls' outputs: partial sums, all-reduced over the tensor-parallel ranks.
        inputs: Replicated activations the region reads (the backward all-reduce of their gradients happens here).
        nodes: Indices of the region's nodes in the graph, with the ``Transpose`` of a weight read as
            ``Transpose(W)``: the rank's piece reads its slice itself, so the slice's gradient is the rank's own.
        transposed: Weights stored ``[out, in]`` (a Gemm with ``transB=1``): their column/row axes swap.
        vocab: Vocabulary-split tables (:mod:`ortflow.graph.tensor_parallel.tensor_vocab`) -> the axis each rank
            keeps a block of.
        heads: A vocabulary-split LM head's output -> its rank (the local logits are padded back to the vocabulary).
        members: The tensors computed by the region in the rank's model (a vocabulary split adds nodes); when empty,
            the outputs of ``nodes``.
        num_heads: Column-split weight -> the number of attention heads its output is reshaped into, or each part
            of it for a fused projection (GPT-2's ``c_attn``: q, k and v of that many heads each; the query part's
            for parts of their own widths, whose heads ``part_heads`` lists); each rank keeps
            ``num_heads / tp`` whole heads (of every part); under grouped-query attention the key/value projections
            have fewer heads than the query's, and each rank's key/value heads are those its query heads read.
        replicated_kv: Key/value projections left whole on every rank because ``tp`` does not divide their heads
            (:mod:`ortflow.graph.tensor_parallel.tensor_kv`) -> (their key/value heads, the query heads): replicated
            nodes before the region, whose keys and values each rank's query heads read a block of.
        position_bias: Relative position bias tables whose bias the region adds to its scores
            (:mod:`ortflow.graph.tensor_parallel.tensor_bias`) -> the axis of their heads (1: each rank keeps its
            heads' columns and computes the region's bias from them).
        head_slices: Replicated biases computed from no trained parameter that the region adds to its scores: each
            rank reads its heads' block (T5's cross-attention's zeros plus the mask).
    """

    columns: list[str] = field(default_factory=list)
    biases: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    groups: dict[str, int] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    transposed: list[str] = field(default_factory=list)
    vocab: dict[str, int] = field(default_factory=dict)
    heads: dict[str, int] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    num_heads: dict[str, int] = field(default_factory=dict)
    replicated_kv: dict[str, tuple[int, int]] = field(default_factory=dict)
    part_heads: dict[str, tuple[int, ...]] = field(default_factory=dict)  # fused parts of their own widths -> heads
    position_bias: dict[str, int] = field(default_factory=dict)
    head_slices: list[str] = field(default_factory=list)


@dataclass
class TensorParallelPlan:
    """The split of one model at one size: its regions, the shape rewrites, what was kept replicated and why."""

    size: int
    regions: list[Region]
    rewrites: list[tuple[int, int, int, int]]  # (node index, input index, element, full value) to divide by size
    kept: dict[str, str]  # candidate weight -> why it stays replicated
    # (node index, input index, axis, full length) of replicated keys/values each rank slices to its query heads' block
    slices: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (Add of a region's scores, the bias path tensor it reads, the path's nodes, their outputs in the rank's copy)
    bias_paths: list[tuple[int, str, tuple[int, ...], tuple[str, ...]]] = field(default_factory=list)
    bias_nodes: list[int] = field(default_factory=list)  # the split tables' whole paths: not in the rank's model

    def slicing(self) -> dict[str, tuple[int, int]]:
        """Sliced parameter -> (axis, parts): axis 1 (columns) or 0 (rows / a bias's only axis); swapped for a
        weight stored ``[out, in]``; a vocabulary-split table's vocabulary axis."""
        out = {}
        for r in self.regions:
            out.update({w: (weight_axes(w in r.transposed)[0], r.groups.get(w, 1)) for w in r.columns})
            out.update({b: (0, r.groups.get(b, 1)) for b in r.biases})
            out.update({w: (weight_axes(w in r.transposed)[1], 1) for w in r.rows})
            out.update({w: (axis, 1) for w, axis in r.vocab.items()})
            out.update({w: (axis, 1) for w, axis in r.position_bias.items()})
        return out


def num_parts(parts: int | tuple[int, ...] | list[int]) -> int:
    """How many fused parts a weight has (:attr:`Region.groups`: their number, or their widths)."""
    return parts if isinstance(parts, int) else len(parts)


def _heads_note(r: Region, size: int) -> str:
    if not r.num_heads:
        return ""
    most = max(r.num_heads.values())
    parts = [_part_heads_note(r, w, size) if w in r.part_heads else
             f"{w} {n} -> {n // size} per rank" + _in_parts(r, w, "in each of its {} fused parts")
             + (f" (key/value heads, each read by {most // n} query heads)" if n < most else "")
             for w, n in r.num_heads.items()]
    note = "; heads: " + ", ".join(parts)
    if r.replicated_kv:
        kv_heads, heads = next(iter(r.replicated_kv.values()))
        note += (f"; key/value heads replicated: {list(r.replicated_kv)} whole on every rank ({kv_heads} key/value "
                 f"head(s), tensor-parallel size {size}; their gradients summed over the ranks): "
                 + reads_note(kv_heads, heads, size))
    if r.position_bias:
        note += (f"; relative position bias tables by their heads' columns {list(r.position_bias)} (each rank "
                 "computes this region's bias from its columns)")
    if r.head_slices:
        note += f"; biases without parameters, each rank its heads' block: {r.head_slices}"
    return note


def _part_heads_note(r: Region, weight: str, size: int) -> str:
    """The heads of each part of a fused projection whose parts have their own widths (Phi-3's ``qkv_proj``)."""
    heads, widths = r.part_heads[weight], r.groups[weight]
    most = max(heads)
    return f"{weight} in {len(widths)} fused parts of widths {list(widths)}: " + ", ".join(
        f"{n} -> {n // size} per rank" + (f" (key/value heads, each read by {most // n} query heads)"
                                          if 0 < n < most else "") for n in heads)


def _in_parts(r: Region, weight: str, words: str) -> str:
    """``words`` with the number of fused parts of ``weight`` (a fused QKV projection's 3), after a space; "" for a
    weight that is one projection."""
    parts = num_parts(r.groups.get(weight, 1))
    return " " + words.format(parts) if parts > 1 else ""


def describe(plan: TensorParallelPlan) -> list[str]:
    """The split plan: one line per region (what is split how, where the ranks add up), or a line saying the graph
    runs whole (a pipeline stage with nothing to split), and one per weight that stays replicated, with the reason
    (configure logs these, configure.json and ``ortflow validate`` show them)."""
    lines = [] if plan.regions else ["no layer to split: each tensor-parallel rank runs the whole graph"]
    for k, r in enumerate(plan.regions):
        if r.vocab:
            where = "the LM head " + str(list(r.heads)) if r.heads else "the embedding " + str(r.outputs)
            lines.append(f"region {k}: vocabulary split of {list(r.vocab)} (axis {list(r.vocab.values())[0]}) in "
                         f"{where}; all-reduce after {r.outputs}")
            continue
        lines.append(f"region {k}: columns {r.columns} (+ biases {r.biases}), rows {r.rows}; all-reduce after "
                     f"{r.outputs}" + (f"; fused parts {r.groups}" if r.groups else "")
                     + (f"; [out, in] {r.transposed}" if r.transposed else "") + _heads_note(r, plan.size))
    lines += [f"kept replicated: {w} ({why})" for w, why in sorted(plan.kept.items())]
    return lines


def log_plan(plan: TensorParallelPlan, where: str = "") -> list[str]:
    """Log the split plan: the regions at INFO, each weight kept replicated at WARNING (every rank computes it whole,
    which costs memory and time the user asked tensor parallelism to save); returns :func:`describe`'s lines."""
    lines = describe(plan)
    for line in lines:
        level = logging.WARNING if line.startswith("kept replicated") else logging.INFO
        log.log(level, "tensor_parallel %d%s: %s", plan.size, where, line)
    return lines


def check_sizes(model: onnx.ModelProto, plan: TensorParallelPlan, shapes: dict[str, list],
                head_counts: list[tuple[int, int]], unsplit: bool = False) -> None:
    """Refuse a plan whose size does not divide a sliced weight, a rewritten shape entry or a head count
    (``head_counts``: (node, heads) of the head reshapes in split regions), naming them and the sizes that fit; and a
    plan that splits nothing, unless ``unsplit`` (a pipeline stage the ranks of its tensor-parallel group run whole)."""
    if not plan.regions and not unsplit:
        raise TensorParallelError(
            "distributed.horizontal_parallel_size > 1 found no layer to split (a MatMul by a 2-D weight whose output "
            f"reaches a second weight MatMul through element-wise ops and head reshapes); kept: {plan.kept}; use 1"
        )
    heads = _head_problems(model, plan, head_counts)
    bad = []
    for name, (axis, parts) in plan.slicing().items():
        dim = shapes[name][axis if len(shapes[name]) > 1 else 0]
        if any(w % plan.size for w in part_widths(dim, parts)) or sum(part_widths(dim, parts)) != dim:
            bad.append(f"{name} {shapes[name]} (axis {axis}{f', parts {parts}' if num_parts(parts) > 1 else ''})")
    for i, _, _, value in plan.rewrites:
        if value % plan.size and not heads:
            bad.append(f"{model.graph.node[i].op_type} '{node_label(model.graph.node[i])}' size {value} (heads?)")
    if heads:
        # key/value heads a size does not divide are replicated (tensor_kv): the sizes that fit divide the query heads
        kv = {w: n for r in plan.regions for w, n in r.num_heads.items() if n < max(r.num_heads.values())}
        for r in plan.regions:  # and their biases, as wide as their columns
            widths = {shapes[w][plan.slicing()[w][0]] for w in kv if w in r.columns}
            kv.update({b: 0 for b in r.biases if shapes[b][0] in widths})
        counts = sorted({max(r.num_heads.values()) for r in plan.regions if r.num_heads}
                        | {n for _, n in head_counts if n not in kv.values()})
        tables = {w for r in plan.regions for w in r.vocab}  # a size that does not divide a vocabulary keeps it whole
        widths = [(shapes[name][axis if len(shapes[name]) > 1 else 0], parts)
                  for name, (axis, parts) in plan.slicing().items() if name not in tables and name not in kv]
        fits = [k for k in range(1, min(counts) + 1)
                if all(n % k == 0 for n in counts) and all(w % k == 0 for dim, parts in widths
                                                           for w in part_widths(dim, parts))]
        more = f"; and {len(heads) - 3} more head count(s) like them" if len(heads) > 3 else ""
        named = "; ".join(heads[:3]) + more
        # A fused projection's key/value part is split with its query part: it cannot stay whole on every rank.
        fused = any("fused parts of" in h and "key/value" in h for h in heads)
        raise TensorParallelError(
            f"distributed.horizontal_parallel_size {plan.size} does not divide {named}: tensor parallelism gives each "
            "rank whole attention heads, so the size must divide the number of query heads (under grouped-query or "
            "multi-query attention each rank keeps the key/value heads its query heads read, whole on every rank "
            "where the size does not divide them"
            + ("; not those of a projection that fuses them with the query heads, split with them, so there the size "
               "must divide the key/value heads too" if fused else "")
            + f"); use one of {fits} (the sizes that divide every head count and the split layers' widths)")
    if bad:
        raise TensorParallelError(
            f"distributed.horizontal_parallel_size {plan.size} does not divide {bad}: choose a size that divides "
            "the number of heads and the widths, or 1"
        )


def _head_problems(model, plan: TensorParallelPlan, head_counts: list[tuple[int, int]]) -> list[str]:
    """Head counts ``plan.size`` does not divide: the projections' heads (query, key/value, or each part of a fused
    QKV projection), then any other head reshape in a split region (``repeat_kv``'s)."""
    found = []
    for r in plan.regions:
        most = max(r.num_heads.values(), default=0)
        for w, counts in r.part_heads.items():  # fused parts of their own widths: each part's heads
            found += [f"the {n} {'key/value heads' if n < most else 'heads'} in part {k} of the {len(counts)} fused "
                      f"parts of {w}" for k, n in enumerate(counts) if n % plan.size]
        for w, n in r.num_heads.items():
            if w in r.part_heads:
                continue
            if n % plan.size:
                found.append(f"the {n} {'key/value heads' if n < most else 'heads'}"
                             f"{_in_parts(r, w, 'in each of the {} fused parts')} of {w}")
    if not found:
        found = [f"the {n} heads made by {model.graph.node[i].op_type} '{node_label(model.graph.node[i])}'"
                 for i, n in head_counts if n % plan.size]
    return found


# Integer shape arithmetic between a rewritten constant and the Reshape or Expand that reads the shape.
_SHAPE_OPS = {"Add", "Concat", "Unsqueeze", "Squeeze", "Cast", "Identity", "Reshape", "Where", "Mul", "Div", "Gather",
              "Slice", "Equal", "ConstantOfShape", "Shape"}


def check_rewrites_private(model: onnx.ModelProto, plan: TensorParallelPlan, readers: dict[str, list[int]]) -> None:
    """Refuse a plan that rewrites a shape also read outside the split regions (an exporter shares one shape
    constant between layers: a layer kept replicated would be reshaped to the local head count)."""
    inside = {i for r in plan.regions for i in r.nodes}
    graph = model.graph
    for i, *_ in plan.rewrites:
        todo, seen = list(graph.node[i].output), set()
        while todo:
            for k in readers.get(todo.pop(), []):
                node = graph.node[k]
                if k in inside or k in seen:
                    continue
                if node.op_type not in _SHAPE_OPS:
                    raise TensorParallelError(
                        f"the shape computed by {graph.node[i].op_type} '{node_label(graph.node[i])}' holds a head "
                        f"count or width the split rewrites, and {node.op_type} '{node_label(node)}' outside the "
                        "split layers also reads it; export the model without shared shape constants (torch: "
                        "optimize=False) or use distributed.horizontal_parallel_size 1")
                seen.add(k)
                todo += list(node.output)
