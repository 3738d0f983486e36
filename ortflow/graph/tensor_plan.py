"""What a tensor-parallel split decides (:mod:`ortflow.graph.tensor_parallel` plans it, :mod:`.tensor_vocab` adds
the vocabulary splits, :mod:`.tensor_shard` applies it to one rank's model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ortflow.graph.tensor_gemm import weight_axes


class TensorSplitError(ValueError):
    """The tensor-parallel split is impossible at this size; the message names the tensors and the fix."""


@dataclass
class Region:
    """One split region (an attention block or an MLP): what each rank slices and what the ranks add up.

    Attributes:
        columns: Column-split weights (``[in, out]``: each rank keeps ``out / hp`` columns of every part).
        biases: Column-split biases (sliced like their weight's columns).
        rows: Row-split weights (each rank keeps ``in / hp`` rows).
        groups: Parts of a column-split weight (3 for a fused QKV projection whose output is Split in 3), by name.
        outputs: The row-split MatMuls' outputs: partial sums, all-reduced over the tensor-parallel ranks.
        inputs: Replicated activations the region reads (the backward all-reduce of their gradients happens here).
        nodes: Indices of the region's nodes in the graph, with the ``Transpose`` of a weight read as
            ``Transpose(W)``: the rank's piece reads its slice itself, so the slice's gradient is the rank's own.
        transposed: Weights stored ``[out, in]`` (a Gemm with ``transB=1``): their column/row axes swap.
        vocab: Vocabulary-split tables (:mod:`ortflow.graph.tensor_vocab`) -> the axis each rank keeps a block of.
        heads: A vocabulary-split LM head's output -> its rank (the local logits are padded back to the vocabulary).
        members: The tensors computed by the region in the rank's model (a vocabulary split adds nodes); when empty,
            the outputs of ``nodes``.
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


@dataclass
class TensorPlan:
    """The split of one model at one size: its regions, the shape rewrites, what was kept replicated and why."""

    size: int
    regions: list[Region]
    rewrites: list[tuple[int, int, int, int]]  # (node index, input index, element, full value) to divide by size
    kept: dict[str, str]  # candidate weight -> why it stays replicated

    def slicing(self) -> dict[str, tuple[int, int]]:
        """Sliced parameter -> (axis, parts): axis 1 (columns) or 0 (rows / a bias's only axis); swapped for a
        weight stored ``[out, in]``; a vocabulary-split table's vocabulary axis."""
        out = {}
        for r in self.regions:
            out.update({w: (weight_axes(w in r.transposed)[0], r.groups.get(w, 1)) for w in r.columns})
            out.update({b: (0, r.groups.get(b, 1)) for b in r.biases})
            out.update({w: (weight_axes(w in r.transposed)[1], 1) for w in r.rows})
            out.update({w: (axis, 1) for w, axis in r.vocab.items()})
        return out
