"""Cut a rank's tensor-parallel model into pieces at its all-reduce points, for the pipeline's VJP machinery.

The rank's nodes fall into levels that alternate: replicated (even levels: embeddings, residual adds, LayerNorms and
RMSNorms, the LM head's un-padding and the loss; every rank computes the same) and parallel (odd levels: the split
regions of :mod:`ortflow.graph.tensor_parallel.tensor_split`). Each replicated level but the first is folded into the
parallel level that follows it, so a piece is parallel (a replicated prefix, possibly empty, then a split region) or
replicated: the first level (a model's embeddings, when its vocabulary is not split: their gradients are the same on
every rank and need no sum) and a replicated level with no parallel level after it (the loss tail). A Llama layer is
two pieces (norm + attention, residual + norm + MLP), not four; every piece is two engine sessions per rank.

A parallel piece sends two kinds of tensors. Its split region's only outputs are its row-split MatMuls' partial
sums (``partial_sends``); the runtime sums them over the ranks before any later piece reads them (Megatron's ``g``:
all-reduce forward, identity backward). Its replicated prefix may send replicated tensors (the residual stream read
by later pieces), the same on every rank and not summed. Backward, the gradients flowing from the region into the
prefix are partial (each rank's slices contribute their part), so what the piece returns for what it read and the
gradients of the prefix's parameters (``replicated_parameters``: every parameter of a parallel piece that is not
sliced) mix full and partial parts. The runtime feeds the arriving gradients of the replicated sends divided by
``tp`` and sums both over the ranks (Megatron's ``f``: identity forward, all-reduce backward; exact for ``tp`` a power
of two): ``sum_r (A_r g + B g' / tp) = (sum_r A_r) g + B g'``, where ``A_r`` is rank ``r``'s path through its slices
and ``B`` the prefix's own path, the same on every rank. A piece may read tensors of any earlier piece (the residual
stream skips pieces), so the runtime keeps every piece's outputs until the last reader ran.

Free nodes (Constants, shape arithmetic not computed from parameters) are copied into every piece that reads them,
as the pipeline split does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx

from ortflow.graph.onnx_tools import node_label
from ortflow.graph.pipeline_parallel.pipeline_cuts import FLOAT_TYPES, Analysis, Stage, check_random_ops, stage_model
from ortflow.graph.tensor_parallel.tensor_split import TensorParallelError, TensorParallelPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """One piece of a rank's model.

    Attributes:
        stage: The piece as a pipeline stage (its model, receives, sends, data inputs, parameters).
        parallel: True for a split region and its replicated prefix (its input gradients partial).
        float_receives: The received tensors that carry a gradient (float activations), in ``receives`` order.
        partial_sends: The sends that are partial sums (a parallel piece's region outputs, summed over the ranks).
        replicated_parameters: A parallel piece's parameters that are not sliced (its prefix's: their gradients are
            summed over the ranks).
    """

    stage: Stage
    parallel: bool
    float_receives: tuple[str, ...]
    partial_sends: tuple[str, ...] = ()
    replicated_parameters: tuple[str, ...] = ()

    @property
    def index(self) -> int:
        return self.stage.index


def _region_members(a: Analysis, plan: TensorParallelPlan, original: onnx.GraphProto) -> dict[int, int]:
    """Node index (in the rank's model) -> region, for region nodes and the shape arithmetic computed from them."""
    region_by_output = {o: k for k, r in enumerate(plan.regions)
                        for o in (r.members or [original.node[i].output[0] for i in r.nodes])}
    partial = {o for r in plan.regions for o in r.outputs}
    member = {}
    for i, node in enumerate(a.graph.node):
        if i in a.free:
            continue
        if node.output[0] in region_by_output:
            member[i] = region_by_output[node.output[0]]
            continue
        for x in node.input:
            p = a.producer.get(x)
            if p in member and x not in partial:  # Shape of a split tensor and what is computed from it
                member[i] = member[p]
    return member


def _levels(a: Analysis, member: dict[int, int]) -> dict[int, int]:
    """Level of every non-free node: replicated nodes even, region nodes odd, never below what they read."""
    block = dict.fromkeys(set(member.values()), 1)
    while True:
        level, changed = {}, False
        for i in a.order:
            need = 0
            for x in a.graph.node[i].input:
                p = a.producer.get(x)
                if p is None or p in a.free:
                    continue
                lp = level[p]
                if i in member and member.get(p) == member[i]:
                    need = max(need, lp)
                elif i in member:
                    need = max(need, lp + 1 if lp % 2 == 0 else lp + 2)
                else:
                    need = max(need, lp + lp % 2)
            if i in member:
                if need > block[member[i]]:
                    block[member[i]], changed = need, True
                level[i] = block[member[i]]
            else:
                level[i] = need
        if not changed:
            return level


def _check_slices_stay_in_regions(a: Analysis, member: dict[int, int], plan: TensorParallelPlan) -> None:
    """A sliced parameter is read only inside its region: a replicated node reading it would compute with one
    rank's slice, and the gradient of what it sends would be summed over the ranks as if it were partial."""
    sliced = set(plan.slicing())
    for i in a.order:
        node = a.graph.node[i]
        bad = [x for x in node.input if x in sliced]
        if bad and i not in member:
            raise TensorParallelError(
                f"{node.op_type} '{node_label(node)}' reads the tensor-parallel slices {bad} outside their split "
                "region; this model's layers cannot be split: use distributed.horizontal_parallel_size 1"
            )


def _fold(levels: list[int]) -> list[list[int]]:
    """The levels of each piece, in order: a replicated level but the first joins the parallel level right after it."""
    groups: list[list[int]] = []
    for lv in levels:
        if lv % 2 == 1 and lv > 1 and groups and groups[-1] == [lv - 1]:
            groups[-1].append(lv)
        else:
            groups.append([lv])
    return groups


def cut_pieces(model: onnx.ModelProto, plan: TensorParallelPlan, original: onnx.ModelProto,
               trainable: list[str] | set[str]) -> list[Piece]:
    """Cut a rank's model (:func:`ortflow.graph.tensor_parallel.tensor_shard.shard_model`) into pieces, in the order
    they run: each replicated level folded into the parallel level after it (see the module docstring).

    Raises:
        TensorParallelError: A node outside the split regions reads a sliced parameter, a split region would send
            something other than a partial sum (a split activation that reaches the replicated side), or the model
            outputs are not computed by the last piece.
    """
    check_random_ops(model.graph)
    a = Analysis(model, set(trainable))
    member = _region_members(a, plan, original.graph)
    level = _levels(a, member)
    _check_slices_stay_in_regions(a, member, plan)
    partial = {o for r in plan.regions for o in r.outputs}
    sliced = set(plan.slicing())
    groups = _fold(sorted(set(level.values())))
    piece_of = {lv: s for s, group in enumerate(groups) for lv in group}
    where = {i: piece_of[lv] for i, lv in level.items()}
    outputs = [o.name for o in model.graph.output]
    pieces = []
    for s in range(len(groups)):
        nodes = [i for i in a.order if where[i] == s]
        produced = {o for i in nodes for o in a.graph.node[i].output if o}
        receives, sends = [], []
        for i in a.order:
            for x in a.graph.node[i].input:
                p = a.producer.get(x)
                if p is None or p in a.free:
                    continue
                if where[i] == s and where[p] != s and x not in receives:
                    receives.append(x)
                if where[p] == s and where[i] != s and x not in sends:
                    sends.append(x)
        sends += [o for o in outputs if o in produced and o not in sends]
        parallel = any(level[i] % 2 == 1 for i in nodes)
        split = [x for x in sends if level[a.producer[x]] % 2 == 1 and x not in partial]
        if split:
            raise TensorParallelError(
                f"tensor-parallel piece {s} would pass split tensors {sorted(split)} to replicated nodes; this "
                "model's layers cannot be split: use distributed.horizontal_parallel_size 1"
            )
        stage = stage_model(a, s, nodes, receives, sends)
        floats = tuple(n for n in receives if a.types.get(n) in FLOAT_TYPES)
        mixed = tuple(p for p in stage.parameters if p not in sliced) if parallel else ()
        pieces.append(Piece(stage, parallel, floats, tuple(x for x in sends if x in partial), mixed))
    if set(outputs) - set(pieces[-1].stage.sends):
        raise TensorParallelError(f"model outputs {outputs} are not all computed by the last tensor-parallel piece")
    log.info("tensor-parallel pieces: %s", ", ".join(
        f"{p.index}{'P' if p.parallel else 'R'}({len(p.stage.parameters)} params)" for p in pieces))
    return pieces
