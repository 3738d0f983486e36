"""Replace the sequence ops the dynamo exporter writes by tensor ops the engine differentiates.

``torch.onnx.export(..., dynamo=True, optimize=False)`` writes ``q, k, v = x.split(n, dim)`` (GPT-2's attention) as
``SplitToSequence`` followed by one ``SequenceAt`` per part, and ``torch.cat`` of a list as ``SequenceConstruct`` +
``ConcatFromSequence``. The engine has no gradient for sequences: every parameter before them is "unreachable from
the output". Each ``SequenceAt`` of a ``SplitToSequence`` with constant split sizes and a constant position becomes a
``Slice`` of the split axis (not a ``Split``: a Split with an unused output gets a wrong gradient in the engine), or,
where the parts read cover the axis exactly once each, all of them one ``Split`` (every output used); a
``ConcatFromSequence`` of a ``SequenceConstruct`` becomes a ``Concat`` (after ``Unsqueeze`` for ``new_axis=1``).
Sequences used any other way are left as they are (``check_differentiable`` then names them).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper

from ortflow.graph.onnx_tools import Names, attribute, constant_values, consumed_names, int64_constant, report_change
from ortflow.graph.shapes import symbolic_shapes


def _bounds(graph: onnx.GraphProto, split: onnx.NodeProto, position: int) -> tuple[int, int] | None:
    """(start, end) of part ``position`` of a SplitToSequence, when its sizes and the position say it statically."""
    sizes = constant_values(graph, split.input[1]) if len(split.input) > 1 and split.input[1] else np.asarray(1)
    if sizes is None:
        return None
    if sizes.ndim == 0:  # equal chunks of this size (the last may be shorter: its end past the axis, as Slice allows)
        if position < 0:
            return None
        size = int(sizes)
        return position * size, (position + 1) * size
    offsets = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))])
    count = len(sizes)
    if not -count <= position < count:
        return None
    position %= count
    return int(offsets[position]), int(offsets[position + 1])


def _whole(bounds: list[tuple[int, int]], length: int | None) -> bool:
    """Whether the parts read cover ``length`` exactly, each once, without gaps."""
    spans = sorted(bounds)
    return (length is not None and spans[0][0] == 0 and spans[-1][1] == length
            and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)))


def _axis_lengths(shapes: dict[str, list] | None):
    """A function (tensor, axis) -> the axis's fixed length in ``shapes`` (symbolic inference), or None."""
    def length(name: str, axis: int) -> int | None:
        dims = (shapes or {}).get(name)
        if dims is None or not -len(dims) <= axis < len(dims) or not isinstance(dims[axis], int):
            return None
        return dims[axis]
    return length


def _split_parts(graph: onnx.GraphProto, all_nodes: list, names: Names, placed: dict, report: list[str],
                 axis_length) -> set[int]:
    """Slices for the SequenceAt reads of each rewritable SplitToSequence (``placed``: at the split's place); ids
    of the nodes they replace."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in all_nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    replaced: set[int] = set()
    for split in [n for n in all_nodes if n.op_type == "SplitToSequence"]:
        seq = split.output[0]
        reads = readers.get(seq, [])
        if seq in outputs or not reads or any(r.op_type != "SequenceAt" for r in reads):
            continue
        positions = [constant_values(graph, r.input[1]) for r in reads]
        bounds = [None if p is None else _bounds(graph, split, int(p)) for p in positions]
        if any(b is None for b in bounds):
            continue
        axis = int(attribute(split, "axis", 0))
        squeeze = len(split.input) < 2 or not split.input[1]
        squeeze = squeeze and not attribute(split, "keepdims", 1)
        nodes = placed.setdefault(id(split), [])
        replaced.add(id(split))
        if not squeeze and _whole(bounds, axis_length(split.input[0], axis)):
            # Every part read once: one Split (its gradient is right when every output is used), which the
            # tensor-parallel split follows like a TorchScript export's fused-QKV Split.
            order = sorted(range(len(reads)), key=lambda k: bounds[k][0])
            sizes, sizes_name = int64_constant(names, f"{seq}/sizes", [bounds[k][1] - bounds[k][0] for k in order])
            nodes += [sizes, helper.make_node("Split", [split.input[0], sizes_name],
                                              [reads[k].output[0] for k in order], name=names.new(f"{seq}/Split"),
                                              axis=axis)]
            replaced.update(id(r) for r in reads)
            report.append(f"{split.name or seq}: SplitToSequence + {len(reads)} SequenceAt -> Split")
            continue
        for read, (start, end) in zip(reads, bounds, strict=True):
            made = [int64_constant(names, f"{read.output[0]}/{tag}", [v]) for tag, v in
                    (("start", start), ("end", end), ("axis", axis))]
            nodes.extend(node for node, _ in made)
            sliced = names.new(f"{read.output[0]}/slice") if squeeze else read.output[0]
            nodes.append(helper.make_node("Slice", [split.input[0], *(out for _, out in made)], [sliced],
                                          name=names.new(f"{read.name or read.output[0]}/Slice")))
            if squeeze:
                _, axes = made[2]
                nodes.append(helper.make_node("Squeeze", [sliced, axes], [read.output[0]],
                                              name=names.new(f"{read.output[0]}/Squeeze")))
            replaced.add(id(read))
        report.append(f"{split.name or seq}: SplitToSequence + {len(reads)} SequenceAt -> {len(reads)} Slice")
    return replaced


def _concats(graph: onnx.GraphProto, all_nodes: list, names: Names, placed: dict, report: list[str]) -> set[int]:
    """A Concat for each ConcatFromSequence of a SequenceConstruct read by nothing else (``placed``: at the
    ConcatFromSequence's place); ids of the replaced nodes."""
    producers = {n.output[0]: n for n in all_nodes if n.op_type == "SequenceConstruct"}
    uses: dict[str, int] = {}
    for node in all_nodes:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    replaced: set[int] = set()
    for concat in [n for n in all_nodes if n.op_type == "ConcatFromSequence"]:
        build = producers.get(concat.input[0])
        if build is None or uses.get(build.output[0], 0) != 1 or build.output[0] in outputs:
            continue
        axis = int(attribute(concat, "axis", 0))
        parts = list(build.input)
        nodes = placed.setdefault(id(concat), [])
        if attribute(concat, "new_axis", 0):
            node, axes = int64_constant(names, f"{concat.output[0]}/axes", [axis])
            nodes.append(node)
            unsqueezed = []
            for part in parts:
                out = names.new(f"{part}/unsqueezed")
                nodes.append(helper.make_node("Unsqueeze", [part, axes], [out], name=names.new(f"{out}/node")))
                unsqueezed.append(out)
            parts = unsqueezed
        nodes.append(helper.make_node("Concat", parts, [concat.output[0]], name=names.new(f"{concat.name}/Concat"),
                                      axis=axis))
        replaced |= {id(concat), id(build)}
        report.append(f"{concat.name or concat.output[0]}: SequenceConstruct + ConcatFromSequence -> Concat")
    return replaced


def sequences_to_tensors(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """``model`` with the exporter's split and concat sequences as Slice and Concat (a new proto).

    Args:
        model: The model (left unchanged).
        report: Receives ``{"pass": "sequences_to_tensors", "changes": [...]}`` when something changed.

    Returns:
        The rewritten model (a copy even when nothing changed).
    """
    if not any(n.op_type in ("SplitToSequence", "ConcatFromSequence") for n in model.graph.node):
        return copy.deepcopy(model)
    # Slices first: the symbolic shape inference cannot read sequences; with them gone it tells which splits are
    # read whole, and those become one Split.
    sliced = _rewrite(model, _axis_lengths(None), [])
    lines: list[str] = []
    out = _rewrite(model, _axis_lengths(symbolic_shapes(sliced)), lines)
    report_change("sequences_to_tensors", lines, report)
    return out


def _rewrite(model: onnx.ModelProto, axis_length, lines: list[str]) -> onnx.ModelProto:
    """One rewrite of the sequences (Split where ``axis_length`` tells a split is read whole, else Slices)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = Names(graph)
    placed: dict[int, list[onnx.NodeProto]] = {}
    all_nodes = list(graph.node)  # held, so that the ids the helpers key on stay those of these nodes
    replaced = (_split_parts(graph, all_nodes, names, placed, lines, axis_length)
                | _concats(graph, all_nodes, names, placed, lines))
    if not replaced:
        return out
    kept = []
    for node in all_nodes:  # each replacement where the node it replaces was: its inputs exist there
        kept.extend(placed.get(id(node), []))
        if id(node) not in replaced:
            kept.append(onnx.NodeProto.FromString(node.SerializeToString()))
    del graph.node[:]
    graph.node.extend(kept)
    used = consumed_names(graph)
    stale = [v for v in graph.value_info if v.name not in used and v.type.HasField("sequence_type")]
    for value in stale:
        graph.value_info.remove(value)
    return out
