"""Where a split axis goes through the ops between a column-split projection and its row-split one that move axes
around: Reshape (merging or splitting dims), Unsqueeze, Squeeze, Slice and Concat (RoPE's ``rotate_half``), and
Expand (grouped-query attention's ``repeat_kv``). Pure functions of dims and attribute values; each returns the
new axis or why the split cannot follow."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

_BIG = 1 << 62  # torch writes "to the end" as INT64_MAX


def reshape_groups(dims_in: list, dims_out: list):
    """The axes of a Reshape's input and output in groups of equal products, in order: ``(input axes, output axes)``
    for each group (axes of size 1 belong to none), or a string saying why the dims cannot be matched, where the
    matching stops.

    Dims are ints or names (a dynamic axis is named alike on both sides when the Reshape keeps it). The dims are
    matched in groups of equal products (``[B, T, 64] -> [B, T, 4, 16]``: ``64 <-> 4 x 16``; ``repeat_kv``'s
    ``[B, 2, 2, T, 16] -> [B, 4, T, 16]``: ``2 x 2 <-> 4``).
    """
    a = [k for k, d in enumerate(dims_in) if d != 1]
    b = [k for k, d in enumerate(dims_out) if d != 1]
    if any(d is None for d in dims_in + dims_out):
        yield "shapes around the Reshape are not known (export with fixed sizes)"
        return
    i = j = 0
    while i < len(a) and j < len(b):
        i0, j0 = i, j
        x, y = dims_in[a[i]], dims_out[b[j]]
        i, j = i + 1, j + 1
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                yield f"the Reshape does not keep the dynamic axis {x} as {y}"
                return
        else:
            while x != y:
                nxt = (dims_in[a[i]] if i < len(a) else None) if x < y else (dims_out[b[j]] if j < len(b) else None)
                if not isinstance(nxt, int):
                    yield "the Reshape mixes the split axis with a dynamic axis"
                    return
                if x < y:
                    x, i = x * nxt, i + 1
                else:
                    y, j = y * nxt, j + 1
        yield a[i0:i], b[j0:j]


def reshape_axis(dims_in: list, dims_out: list, axis: int) -> int | str:
    """The output axis that carries input axis ``axis`` (>= 0) of a Reshape, or why none does.

    The dims are matched in groups (:func:`reshape_groups`). A block of rows along ``axis`` is a block of the
    output's first axis of the group only when ``axis`` is the first (outermost) axis of its own group.
    """
    for group in reshape_groups(dims_in, dims_out):
        if isinstance(group, str):
            return group
        ins, outs = group
        if ins[0] <= axis <= ins[-1]:
            if ins[0] != axis:
                return "the Reshape merges the split axis with an axis before it"
            return outs[0]
    return "the split axis does not map onto one axis of the new shape"


def unsqueeze_axis(rank_in: int, axes: list[int], axis: int) -> int:
    """Where input axis ``axis`` (>= 0) goes when ``axes`` (of the output) are inserted."""
    rank_out = rank_in + len(axes)
    inserted = sorted(a % rank_out for a in axes)
    kept = [k for k in range(rank_out) if k not in inserted]
    return kept[axis]


def squeeze_axis(rank_in: int, axes: list[int], axis: int) -> int | str:
    """Where input axis ``axis`` (>= 0) goes when ``axes`` (of the input) are removed."""
    removed = {a % rank_in for a in axes}
    if axis in removed:
        return "a Squeeze of the split axis"
    return axis - sum(1 for a in removed if a < axis)


def slice_keeps_axis(rank: int, axis: int, starts, ends, axes, steps, dim) -> bool:
    """Whether a Slice leaves axis ``axis`` (>= 0, of size ``dim``) whole: it does not slice it, or slices all of it."""
    axes = list(range(len(starts))) if axes is None else [int(x) % rank for x in np.asarray(axes).reshape(-1)]
    if axis not in axes:
        return True
    k = axes.index(axis)
    start, end = int(np.asarray(starts).reshape(-1)[k]), int(np.asarray(ends).reshape(-1)[k])
    step = 1 if steps is None else int(np.asarray(steps).reshape(-1)[k])
    return step == 1 and start == 0 and (end >= _BIG or (dim is not None and end >= dim))


def moved_axis(node: onnx.NodeProto, rank: int, at: int, static: list, dim) -> int | str:
    """The split axis (negative) of the output of an Unsqueeze, Squeeze, Slice or Concat whose (first) input is split
    on axis ``at`` (>= 0) of ``rank``, or why the split cannot follow. ``static``: the values of the node's other
    inputs where they are constants (None where computed); ``dim``: the split axis's size.

    Unsqueeze and Squeeze move the axis; Slice and Concat along another axis keep it (RoPE's ``rotate_half`` slices
    and concatenates the halves of the head dim).
    """
    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "Concat":
        return "a Concat along the split axis" if attrs["axis"] % rank == at else at - rank
    if op in ("Unsqueeze", "Squeeze"):
        axes = static[0] if static else attrs.get("axes")
        if axes is None:
            return f"a {op} whose axes are computed"
        axes = np.asarray(axes).reshape(-1).tolist()
        if op == "Unsqueeze":
            return unsqueeze_axis(rank, axes, at) - rank - len(axes)
        moved = squeeze_axis(rank, axes, at)
        return moved if isinstance(moved, str) else moved - rank + len(axes)
    starts, ends, axes, steps = [*static, None, None, None, None][:4]
    given = len(node.input) > 3 and node.input[3]
    if (given and axes is None) or (not given and starts is None):
        return "a Slice whose axes are computed"
    sliced = [a % rank for a in axes.reshape(-1).tolist()] if given else list(range(starts.size))
    if at in sliced and (starts is None or ends is None or not slice_keeps_axis(rank, at, starts, ends, sliced, steps,
                                                                                  dim)):
        return "a Slice of the split axis"
    return at - rank
