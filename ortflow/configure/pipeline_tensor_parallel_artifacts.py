"""Pipeline x tensor parallelism in configure: each pipeline stage's graph split over the tensor-parallel ranks.

The model is cut into stages as for the pipeline (:func:`ortflow.configure.stage_artifacts.plan_stages`), then
each stage's model is split and cut into pieces as a tensor-parallel model is
(:mod:`ortflow.configure.tensor_parallel_artifacts`). The first pieces of a stage also list what the stage receives
in ``requires_grad`` (their gradients go back to the previous stage); the last piece of a middle stage has the VJP
loss of what the stage sends, the last piece of the last stage the configured loss.

Folders: ``artifacts/pipetensor/stage-SS/tensor/rank-RR/piece-PP/`` (engine artifacts of piece PP of tensor-parallel
rank RR of stage SS), and ``artifacts/pipetensor/pipetensor.json`` (cuts, and each stage's tensors, slicing and
pieces), written last.

A tied weight read in two stages (an embedding and its LM head) is sliced alike in both (by vocabulary) and recorded
under ``shared``: the holders add their slices' gradients over their tensor-parallel rank's pipeline group.

A stage with no layer to split (a recurrent classifier's GRU and head) runs whole on each of its tensor-parallel
ranks, its parameters replicated as a split stage's unsplit layers are.

Refused, with the names and the fix: a cut crossed by a tensor inside a split region (an attention block or MLP:
its activations are split over the ranks, the pipeline carries whole tensors), a tied weight that two stages would
slice differently, and a model with no layer to split (:func:`_check_cuts` plans the whole model first).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import NamedTuple

import onnx

from ortflow.artifacts_folder import PIPE_TENSOR_DIR, PIPE_TENSOR_RECORD, TENSOR_DIR
from ortflow.config import RunConfig
from ortflow.configure.artifacts import PROTO_LIMIT, ArtifactsError, inspect_model, split_parameters
from ortflow.configure.building import building
from ortflow.configure.engine_input import split_source
from ortflow.configure.stage_artifacts import plan_stages
from ortflow.configure.tensor_parallel_artifacts import (
    build_piece,
    export_fixes,
    piece_record,
    rank_padding_rows,
    same_input_gradients,
    split_input,
    weights_folder,
)
from ortflow.configure.training_graph import sums_as_matmul_applies, torch_padding_rows
from ortflow.graph.gradients.same_gradients import agreed
from ortflow.graph.pipeline_parallel.pipeline_cuts import CutPlace, Stage
from ortflow.graph.prepare import PreparedModel
from ortflow.graph.tensor_parallel.tensor_pieces import Piece, cut_pieces
from ortflow.graph.tensor_parallel.tensor_plan import log_plan
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_split import (
    TensorParallelError,
    TensorParallelPlan,
    describe,
    plan_tensor_parallel_split,
)

log = logging.getLogger(__name__)

@dataclasses.dataclass
class StagePlan:
    """One pipeline stage, split for tensor parallelism: its model (export fixes applied), the split, and the folder
    its weights' data files are relative to (a model past 2 GB keeps them there)."""

    stage: Stage
    model: onnx.ModelProto
    plan: TensorParallelPlan
    weights: Path


def _check_cuts(cfg: RunConfig, stages: list[Stage], source: PreparedModel, proto_limit: int) -> frozenset[str]:
    """Refuse cuts crossed by a tensor made inside a split region of the whole model (``source``, the model the stages
    were cut from); returns the tables the whole model splits by vocabulary (its embeddings and LM heads: a stage
    holding one splits it so, though the stage's graph alone does not show the vocabulary, as the last stage's LM head
    whose embedding is in the first stage)."""
    size = cfg.distributed.horizontal_parallel_size
    whole, trainable, _ = split_input(cfg, proto_limit, source)
    try:
        plan = plan_tensor_parallel_split(whole, trainable, size)
    except TensorParallelError as err:
        raise ArtifactsError(str(err)) from None
    inside = {}
    for k, region in enumerate(plan.regions):
        for i in region.nodes:
            for out in whole.graph.node[i].output:
                inside[out] = (k, region)
    for stage in stages[1:]:
        bad = [n for n in stage.receives if n in inside]
        if bad:
            k, region = inside[bad[0]]
            raise ArtifactsError(
                f"pipeline cut {stage.index} (model.pipeline_cuts {_cuts(cfg, stages)}) is crossed by {bad}, made "
                f"inside tensor-parallel region {k} (columns {region.columns}, rows {region.rows}), whose "
                f"activations are split over the {size} tensor-parallel ranks: cut between regions instead, e.g. at "
                f"a residual add or a LayerNorm output, after {region.outputs} is summed")
    return frozenset(t for r in plan.regions if r.vocab for t in r.vocab)


def _check_tied(plans: list[StagePlan], size: int) -> None:
    """A parameter read in several stages (a tied embedding and LM head) must be sliced alike in each: the holders
    then add their slices' gradients over the pipeline group of their tensor-parallel rank."""
    tied = {n: list(h) for sp in plans for n, h in sp.stage.shared.items()}
    for name, holders in sorted(tied.items()):
        slicing = {s: plans[s].plan.slicing().get(name) for s in holders}
        if len(set(slicing.values())) > 1:
            raise ArtifactsError(
                f"the tied parameter '{name}' is read in pipeline stages {holders}, which split it differently for "
                f"distributed.horizontal_parallel_size {size} (stage: (axis, parts) or None when whole: {slicing}); "
                "move model.pipeline_cuts so its readers share a stage, or untie it in the model")


def _cuts(cfg: RunConfig, stages: list[Stage]) -> list[str]:
    return list(cfg.model.pipeline_cuts) or [s.receives[0] for s in stages[1:] if s.receives]


class PipeTensorPlan(NamedTuple):
    """The cuts, each stage's tensor-parallel split, and every place the automatic cuts may cut (for the plan's
    words)."""

    cuts: list[str]
    plans: list[StagePlan]
    places: list[CutPlace]


def plan_pipeline_tensor_parallel(cfg: RunConfig, proto_limit: int = PROTO_LIMIT) -> PipeTensorPlan:
    """The cuts and each stage's tensor-parallel split (a stage with nothing to split runs whole on each tensor-parallel
    rank), or the refusal naming what and how to fix: no engine call.

    Raises:
        ArtifactsError: The stages or a stage's split are refused.
    """
    size = cfg.distributed.horizontal_parallel_size
    # The whole model prepared once: the stages are cut from it, and its own split checks the cuts
    trainable, _ = split_parameters(inspect_model(cfg.model.path), cfg.model.frozen)
    source = split_source(cfg, trainable, proto_limit)
    cuts, stages, places = plan_stages(cfg, proto_limit, source)  # past proto_limit the stages' weights stay in files
    embedded = _check_cuts(cfg, stages, source, proto_limit)
    plans = []
    for stage in stages:
        model = export_fixes(stage.model, stage.parameters)
        try:
            plan = plan_tensor_parallel_split(model, stage.parameters, size, embedded, unsplit=True)
            # refuse a bad cut before any engine call (the slices' dims are enough: no weight is read)
            pieces(StagePlan(stage, model, plan, weights_folder(cfg)), 0, values=False)
        except TensorParallelError as err:
            raise ArtifactsError(f"pipeline stage {stage.index} of {len(stages)} (cuts {cuts}): {err}; or move "
                                 "model.pipeline_cuts so that each stage holds whole attention blocks and "
                                 "MLPs") from None
        plans.append(StagePlan(stage, model, plan, weights_folder(cfg)))
    _check_tied(plans, size)
    return PipeTensorPlan(cuts, plans, places)


def pieces(sp: StagePlan, rank: int, values: bool = True) -> list[Piece]:
    """Tensor-parallel rank ``rank``'s pieces of a stage; a piece reading what the stage receives also returns its
    gradient (the previous stage's backward needs it). Without ``values``: the slices' names, types and dims only."""
    cut = cut_pieces(shard_model(sp.model, sp.plan, rank, sp.weights, values), sp.plan, sp.model, sp.stage.parameters)
    received = set(sp.stage.receives)
    out = []
    for piece in cut:
        extra = tuple(n for n in piece.stage.data_inputs if n in received)
        if extra:
            stage = dataclasses.replace(piece.stage, receives=piece.stage.receives + extra,
                                        data_inputs=tuple(n for n in piece.stage.data_inputs if n not in received))
            piece = dataclasses.replace(piece, stage=stage, float_receives=piece.float_receives + extra)
        out.append(piece)
    return out


def build_pipeline_tensor_parallel_artifacts(cfg: RunConfig, artifacts_dir: Path,
                                             planned: PipeTensorPlan | None = None,
                                             proto_limit: int = PROTO_LIMIT) -> dict:
    """Build every (stage, tensor-parallel rank)'s pieces under ``artifacts_dir/pipetensor`` once; return the record.

    ``planned``: what :func:`plan_pipeline_tensor_parallel` returned for ``cfg`` (configure plans first, to refuse a
    bad split before building anything), so the stages and their splits are not planned twice. ``proto_limit``: model
    bytes from which the weights stay in their files (each piece then reaches the engine as a stage does).

    Raises:
        ArtifactsError: The split is refused (names the tensors and the fix) or the engine cannot build a piece.
    """
    size = cfg.distributed.horizontal_parallel_size
    cuts, plans, _ = planned or plan_pipeline_tensor_parallel(cfg, proto_limit)
    _, frozen = split_parameters(inspect_model(cfg.model.path), cfg.model.frozen)
    stages = []
    with building(artifacts_dir, PIPE_TENSOR_DIR) as scratch:
        padding, sums = torch_padding_rows(cfg), sums_as_matmul_applies(cfg)
        for sp in plans:
            s = sp.stage.index
            log_plan(sp.plan, f" (pipeline stage {s})")
            records, ran_by_piece, masked, rewrites, same = [], {}, {}, {}, {}
            for rank in range(size):
                mine = pieces(sp, rank)
                passes = []
                for piece in mine:
                    last = s == len(plans) - 1 and piece is mine[-1]
                    folder = scratch / f"stage-{s:02d}" / TENSOR_DIR / f"rank-{rank:02d}" / f"piece-{piece.index:02d}"
                    where = f"piece {piece.index} of tensor-parallel rank {rank} of pipeline stage {s}"
                    ran, rows, changed = build_piece(cfg, piece, last, set(frozen), folder, where, proto_limit,
                                                     rank_padding_rows(padding, sp.model, sp.plan, rank))
                    passes.append(ran)
                    masked.setdefault(piece.index, []).append(rows)
                    same.setdefault(piece.index, []).append(same_input_gradients(folder, piece))
                    rewrites[f"rank-{rank:02d}/piece-{piece.index:02d}"] = changed
                records.append([piece_record(p, p.stage.model, ran, sums) for p, ran in zip(mine, passes, strict=True)])
                ran_by_piece.update({f"rank-{rank:02d}/piece-{p.index:02d}": list(ran)
                                     for p, ran in zip(mine, passes, strict=True)})
            for info in records[0]:  # one record for every rank: each rank's padding rows, in rank order
                info["padding_rows"] = masked[info["index"]]
                info["same_gradient"] = agreed(same[info["index"]])
            stages.append({"index": s, "receives": list(sp.stage.receives), "sends": list(sp.stage.sends),
                           "parameters": list(sp.stage.parameters),
                           "shared": {name: list(holders) for name, holders in sp.stage.shared.items()},
                           "slicing": {n: list(v) for n, v in sp.plan.slicing().items()},
                           "split": describe(sp.plan), "pieces": records[0], "passes": ran_by_piece,
                           "rewrites": rewrites})
        record = {"size": size, "num_stages": len(plans), "cuts": cuts, "stages": stages}
        (scratch / PIPE_TENSOR_RECORD).write_text(json.dumps(record, indent=1))  # last: vouches for the pieces
    log.info("built %d pipeline stages x %d tensor-parallel ranks (cuts %s)", len(plans), size, cuts)
    return record
