"""The head axis merged with the axes before it in the tensor-parallel split: attention written as batched products of
``[B * H, T, D]`` tensors (torch's ``sdpa`` decomposition as the dynamo exporter writes it, ``k.transpose(-2, -1)``
done on ``[B * H, T, D]``; Hugging Face's eager GPT-NeoX, BLOOM and OPT-style attention with ``bmm``).

A Reshape ``[B, H, T, D] -> [B * H, T, D]`` of a tensor split by heads merges the head axis, as the innermost factor,
with the axes before it (the batch, any axis of size 1). On each rank the merged axis is ``B * H / tp`` long: for each
batch row, the rank's block of heads, so it stays split, as a *merged* axis whose inner factor is the head count. The
batched products, Softmax, masks broadcast along it, Transposes that keep it and Reshapes that keep it whole carry it
(:mod:`ortflow.graph.tensor_parallel.tensor_walk`); a Reshape that splits it back into ``[B, H, ...]`` (its last
factor the head count) gives a head axis again, its head-count entry rewritten to the local ``H / tp`` or computed
from a split tensor's own head axis, and its batch entries neither computed from a split size nor copying one. A
merged axis's entry must be -1, its whole constant ``B * H`` (rewritten to ``B * H / tp``) or the runtime size of
another tensor's merged axis. Anything else (the merged axis merged again with other axes, split into other factors,
read by a weight product, an input merged and one not) keeps the attention whole, with the reason.
"""

from __future__ import annotations

import onnx

from ortflow.graph.tensor_parallel.tensor_axes import reshape_groups
from ortflow.graph.tensor_parallel.tensor_shapes import DimOf, shape_entry


def merged_reshape(dims_in: list, dims_out: list, axis: int,
                   inner: int | None) -> tuple[int, int | None, list[int]] | str:
    """Where the split axis ``axis`` (>= 0) of a Reshape's input goes: (the output axis, the head count when that axis
    is merged with axes before it, else None, the output axes before it that a merged input axis is split back into,
    the batch axes); or why the split cannot follow. ``inner``: the head count when the input's axis is merged."""
    for group in reshape_groups(dims_in, dims_out):
        if isinstance(group, str):
            return group
        ins, outs = group
        if not ins[0] <= axis <= ins[-1]:
            continue
        if inner is None:
            if ins[0] == axis:
                return outs[0], None, []
            if ins[-1] != axis:
                return "the Reshape merges the split axis with an axis before it and one after it"
            if len(outs) > 1:
                return "the Reshape merges the split axis with an axis before it into more than one axis"
            return outs[0], dims_in[axis], []  # [B, H, ...] -> [B * H, ...]: the heads the innermost factor
        if ins != [axis]:
            return "the Reshape merges the merged batch and head axis with another axis"
        if len(outs) == 1:
            return outs[0], inner, []
        if dims_out[outs[-1]] != inner:
            return f"the Reshape splits the merged batch and head axis into {[dims_out[k] for k in outs]}, not " \
                   f"into the batch and the {inner} heads"
        return outs[-1], None, outs[:-1]  # [B * H, ...] -> [B, H, ...]
    return "the split axis does not map onto one axis of the new shape"


def batch_entries(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], split: dict[str, int],
                  i: int, elements: list[int], axis: int) -> str | None:
    """Why the entries ``elements`` of Reshape ``i``'s new shape (the batch axes a merged axis is split back into;
    its input split on ``axis`` >= 0) would not be the same on every rank, or None: each must be a constant (-1
    included) other than a copy (0) of the split axis, or the runtime size of an axis that is not split."""
    for e in elements:
        spec = shape_entry(graph, shapes, producers, i, 1, e)
        if isinstance(spec, str):
            return f"the new shape's batch entry {e} cannot be followed ({spec})"
        if isinstance(spec, DimOf):
            t = spec.tensor
            if t in split and len(shapes.get(t) or []) + split[t] == spec.axis:
                return f"the new shape's batch entry {e} is the size of the split axis of '{t}'"
        elif spec[4].plain and spec[3] == 0 and e == axis:
            return f"the new shape's batch entry {e} copies (0) the split axis"
    return None
