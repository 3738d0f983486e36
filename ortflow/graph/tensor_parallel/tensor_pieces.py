"""Cut a rank's tensor-parallel model into pieces at its all-reduce points, for the pipeline's VJP machinery.

Pieces alternate: replicated (even levels: embeddings, residual adds, LayerNorms, the LM head; every rank computes
the same) and parallel (odd levels: the split regions of :mod:`ortflow.graph.tensor_parallel.tensor_split`). A parallel
piece's only outputs are its row-split MatMuls' partial sums; the runtime all-reduces them before any later piece reads
them (Megatron's ``g``: all-reduce forward, identity backward). The gradients a parallel piece returns for what it read
are partial too, and are all-reduced before they join the replicated side's (Megatron's ``f``: identity forward,
all-reduce backward). A piece may read tensors of any earlier piece (the residual stream skips the parallel pieces),
so the runtime keeps every piece's outputs until the last reader ran.

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
        parallel: True for a split region (its sends are partial sums, its input gradients partial).
        float_receives: The received tensors that carry a gradient (float activations), in ``receives`` order.
    """

    stage: Stage
    parallel: bool
    float_receives: tuple[str, ...]

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


def cut_pieces(model: onnx.ModelProto, plan: TensorParallelPlan, original: onnx.ModelProto,
               trainable: list[str] | set[str]) -> list[Piece]:
    """Cut a rank's model (:func:`ortflow.graph.tensor_parallel.tensor_shard.shard_model`) into pieces, in the order
    they run.

    Raises:
        TensorParallelError: A node outside the split regions reads a sliced parameter, a parallel piece would send
            something other than a partial sum (a split activation that reaches the replicated side), or the model
            outputs are not computed by the last piece.
    """
    check_random_ops(model.graph)
    a = Analysis(model, set(trainable))
    member = _region_members(a, plan, original.graph)
    level = _levels(a, member)
    _check_slices_stay_in_regions(a, member, plan)
    partial = {o for r in plan.regions for o in r.outputs}
    levels = sorted(set(level.values()))
    outputs = [o.name for o in model.graph.output]
    pieces = []
    for s, lv in enumerate(levels):
        nodes = [i for i in a.order if level[i] == lv]
        produced = {o for i in nodes for o in a.graph.node[i].output if o}
        receives, sends = [], []
        for i in a.order:
            for x in a.graph.node[i].input:
                p = a.producer.get(x)
                if p is None or p in a.free:
                    continue
                if level[i] == lv and level[p] != lv and x not in receives:
                    receives.append(x)
                if level[p] == lv and level[i] != lv and x not in sends:
                    sends.append(x)
        sends += [o for o in outputs if o in produced and o not in sends]
        parallel = lv % 2 == 1
        if parallel and set(sends) - partial:
            raise TensorParallelError(
                f"tensor-parallel piece {s} would pass split tensors {sorted(set(sends) - partial)} to replicated "
                "nodes; this model's layers cannot be split: use distributed.horizontal_parallel_size 1"
            )
        stage = stage_model(a, s, nodes, receives, sends)
        floats = tuple(n for n in receives if a.types.get(n) in FLOAT_TYPES)
        pieces.append(Piece(stage, parallel, floats))
    if set(outputs) - set(pieces[-1].stage.sends):
        raise TensorParallelError(f"model outputs {outputs} are not all computed by the last tensor-parallel piece")
    log.info("tensor-parallel pieces: %s", ", ".join(
        f"{p.index}{'P' if p.parallel else 'R'}({len(p.stage.parameters)} params)" for p in pieces))
    return pieces
