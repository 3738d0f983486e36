"""Fused projections in the tensor-parallel split: one weight product whose output columns hold several parts (GPT-2's
``c_attn`` and Phi-3's ``qkv_proj``: the query, key and value rows; Phi-3's ``gate_up_proj``: the gate and up rows).

Each rank keeps its block of every part, so a rank's parts are its share of each part's heads or units. The parts are
read either by a ``Split`` along the columns into equal parts (:func:`split_parts`; its sizes rewritten for the local
widths), or by ``Slice``s of any widths (:func:`slice_part`; Phi-3's key and value parts have fewer heads than its
query part under grouped-query attention). A Slice's bounds must be computed from constants (rewritten to the local
widths) or from the split tensor's own size (which is the local one on each rank), by arithmetic that gives each rank
its share (:meth:`ortflow.graph.tensor_parallel.tensor_shapes.Arithmetic.follows`). TorchScript's ``chunk(2, dim=-1)``
of Phi-3's ``gate_up_proj`` bounds the halves at ``(D + 1) / 2`` of its width ``D`` (read from its ``Shape``, or the
constant configure's passes write), half of the local width ``D / tp`` too where that is even; at an odd local width
the projection stays whole, with the reason. The Slices must cover the columns once each
(:meth:`FusedParts.cover`). The split's walk (:mod:`ortflow.graph.tensor_parallel.tensor_walk`) records the parts here
as it meets them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from ortflow.graph.onnx_tools import attribute, constant_values
from ortflow.graph.tensor_parallel.tensor_axes import slice_keeps_axis
from ortflow.graph.tensor_parallel.tensor_plan import Region
from ortflow.graph.tensor_parallel.tensor_shapes import Arithmetic, DimOf, shape_entry, static_ints

#: A constant to rewrite for the local size: (node, input, element, value).
Rewrite = tuple[int, int, int, int]


@dataclass
class FusedParts:
    """The parts of fused projections, keyed by the projection's (seed) node, as the split walk finds them."""

    groups: dict[int, int | tuple[int, ...]] = field(default_factory=dict)  # seed -> parts (a Split), or their widths
    bounds: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # seed -> (start, end) of each Slice
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # a Slice's output -> its (start, end)
    heads: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)  # seed -> (start, end) -> its heads

    def add(self, seed: int, out: str, start: int, end: int) -> None:
        self.bounds.setdefault(seed, []).append((start, end))
        self.ranges[out] = (start, end)

    def note_heads(self, seed: int, part: str, heads: int) -> None:
        """A part (a Slice's output) reshaped into ``heads`` heads."""
        if part in self.ranges:
            self.heads.setdefault(seed, {})[self.ranges[part]] = heads

    def cover(self, seed: int, width: int | None) -> str | None:
        """Record the parts of a projection of ``width`` columns read by Slices: their widths in column order, or their
        number when they are equal; or say why it stays whole: Slices that overlap or leave columns out (each rank's
        block of every part is only its share of the heads when the parts tile the columns), or a Split besides."""
        ranges = sorted(set(self.bounds[seed]))
        ends = [0, *(end for _, end in ranges)]
        if width is None or [start for start, _ in ranges] != ends[:-1] or ends[-1] != width or seed in self.groups:
            return f"the Slices {ranges} of the fused projection's {width} columns do not cover them once each in parts"
        widths = tuple(end - start for start, end in ranges)
        self.groups[seed] = len(widths) if len(set(widths)) == 1 else widths
        return None

    def mark(self, region: Region, seed: int, weight: str, bias: bool = False) -> None:
        """Note on ``region`` the parts of ``weight`` (the projection's weight, or with ``bias`` its bias), and for
        parts of their own widths the heads of each part reshaped into heads (in column order) and, when every part
        is, the most heads of one part."""
        widths = self.groups.get(seed, 1)
        if widths != 1:
            region.groups[weight] = widths
        if bias or not isinstance(widths, tuple) or seed not in self.heads:
            return
        heads = self.heads[seed]
        region.part_heads[weight] = tuple(heads[b] for b in sorted(heads))
        if len(heads) == len(widths):
            region.num_heads[weight] = max(heads.values())


def split_parts(graph: onnx.GraphProto, shapes: dict[str, list], i: int, axis: int) -> list[Rewrite] | str:
    """A ``Split`` (node ``i``) of a projection's output split on ``axis`` (< 0) into equal parts along its columns: the
    constants holding its sizes, to rewrite for the local widths; or why the split cannot follow it."""
    node = graph.node[i]
    rank = len(shapes[node.input[0]]) if shapes.get(node.input[0]) is not None else None
    if rank is None or (attribute(node, "axis", 0) % rank) != rank + axis:
        return "a Split of a split activation other than a projection's output, along its columns"
    sizes = constant_values(graph, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if sizes is not None and len(set(sizes.tolist())) != 1:
        return "a Split into unequal parts"
    return [] if sizes is None else [(i, 1, k, int(v)) for k, v in enumerate(sizes.tolist())]


def keeps_axis(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], node: onnx.NodeProto,
               axis: int) -> bool:
    """Whether a Slice leaves the split axis (< 0) whole: its bounds constant and covering it (or its rank unknown:
    the walk then says why it cannot follow it)."""
    dims = shapes.get(node.input[0])
    if dims is None:
        return True
    starts, ends, axes, steps = [static_ints(graph, producers, y) if y else None
                                 for y in [*node.input[1:5], "", "", ""][:4]]
    if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and axes is None):
        return False
    return slice_keeps_axis(len(dims), len(dims) + axis, starts, ends, axes, steps,
                            dims[axis] if -axis <= len(dims) else None)


def slice_part(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], split: dict[str, int],
               i: int, axis: int, size: int) -> tuple[int, int, list[Rewrite]] | str | None:
    """A Slice (node ``i``) of a fused projection's output split on ``axis`` (< 0), along its columns: one part (Phi-3's
    query, key or value rows of ``qkv_proj``; the gate or up rows of ``gate_up_proj``), as its (start, end) on the whole
    model and the constants holding its bounds to rewrite for the local widths; None when the Slice does not slice
    the split axis; or why the split cannot follow it. ``split``: tensor -> its split axis; ``size``: the ranks."""
    node = graph.node[i]
    dims = shapes.get(node.input[0])
    rank, width = (None, None) if dims is None else (len(dims), dims[axis] if -axis <= len(dims) else None)
    axes = static_ints(graph, producers, node.input[3]) if len(node.input) > 3 and node.input[3] else None
    steps = static_ints(graph, producers, node.input[4]) if len(node.input) > 4 and node.input[4] else None
    starts = static_ints(graph, producers, node.input[1]) if axes is None else None
    if rank is None or width is None or (axes is None and (len(node.input) > 3 and node.input[3])):
        return "a Slice of the split axis whose axes or width are not known"
    listed = ([int(a) % rank for a in axes.reshape(-1)] if axes is not None
              else list(range(starts.size if starts is not None else rank)))
    if rank + axis not in listed:
        return None
    k = listed.index(rank + axis)
    if steps is not None and int(steps.reshape(-1)[k]) != 1:
        return "a Slice of a fused projection's columns with a step"
    bounds, rewrites = [], []
    for pos in (1, 2):
        spec = shape_entry(graph, shapes, producers, i, pos, k)
        if isinstance(spec, DimOf):  # computed from a split tensor's size: from the local one on each rank
            t = spec.tensor
            if t not in split or len(shapes.get(t) or []) + split[t] != spec.axis:
                return "a Slice of a fused projection's columns at the size of an axis that is not split"
            full = shapes[t][split[t]]
            if full is None:
                return "a Slice of a fused projection's columns at an unknown size"
            if not spec.arithmetic.follows(full, size):
                return _not_shared(spec.arithmetic, full, size)
            bounds.append(spec.arithmetic.of(full))
            continue
        if isinstance(spec, str):
            return f"a Slice of a fused projection's columns whose bounds the split cannot follow ({spec})"
        if not spec[4].follows(spec[3], size):  # a constant (the width) rewritten to the local one
            return _not_shared(spec[4], spec[3], size)
        value = spec[4].of(spec[3])
        if value < 0 or (pos == 1 and value >= width):
            return "a Slice of a fused projection's columns from its end (negative bounds)"
        if value >= width:  # "to the end" (torch writes INT64_MAX): the local end too
            bounds.append(width)
            continue
        bounds.append(value)
        if value:
            rewrites.append(spec[:4])
    return bounds[0], bounds[1], rewrites


def _not_shared(math: Arithmetic, full: int, size: int) -> str:
    return (f"a Slice of a fused projection's columns at {math.formula()}, {math.of(full)} for D = {full} but "
            f"{math.of(full // size)} for each rank's D = {full // size}, not its share")
