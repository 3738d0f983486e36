"""Build every tensor-parallel rank's piece artifacts once, in configure (the pipeline stages' recipe, per piece).

For tensor-parallel rank ``r`` of ``tp`` the folder ``artifacts/tensor/rank-RR/piece-PP/`` holds the engine's
training and eval models and initial state of one piece of that rank's model (its slices of the split weights):

* a piece before the last has the VJP loss ``sum_i ReduceSum(y_i * g_i)`` over the float tensors it sends, and its
  eval model computes what it sends (docs/engine.md);
* the last piece keeps the configured loss;
* the float tensors a piece receives are listed in ``requires_grad``; their gradients come out per call as
  ``<name>.backprop`` right after the loss.

``tensor.json`` in ``artifacts/tensor/`` records the size, the split (what each rank slices, along which axis) and
each piece's tensors (:mod:`ortflow.graph.tensor_parallel.tensor_pieces`): whether it is parallel, which of its sends
are partial sums (``partial_sends``, summed over the ranks; the others are replicated) and which of its parameters
are not sliced (``replicated_parameters``, whose gradients are summed over the ranks); it is written last.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx

from ortflow.artifacts_folder import BACKPROP_SUFFIX, TENSOR_DIR, TENSOR_RECORD
from ortflow.config import RunConfig
from ortflow.configure.artifacts import (
    PROTO_LIMIT,
    ArtifactsError,
    inspect_model,
    split_parameters,
)
from ortflow.configure.building import building
from ortflow.configure.engine_input import split_source
from ortflow.configure.stage_artifacts import finish_part, generate_part, prepare_part
from ortflow.configure.training_graph import rewrite_part_training_model, sums_as_matmul_applies, torch_padding_rows
from ortflow.graph.gradients.padding_rows import local_padding_rows
from ortflow.graph.gradients.same_gradients import agreed, same_gradients
from ortflow.graph.pipeline_parallel.pipeline_cuts import FLOAT_TYPES, SplitError, check_random_ops
from ortflow.graph.precision.noop_casts import drop_noop_casts
from ortflow.graph.prepare import PreparedModel
from ortflow.graph.tensor_parallel.tensor_gemm import separate_gemm_biases
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

def export_fixes(model: onnx.ModelProto, trainable) -> onnx.ModelProto:
    """What the tensor-parallel split needs beyond the preparation passes: Gemm biases added after the product (so a
    row-split Gemm's bias is added once, after the all-reduce), and no Cast to its input's own type (a piece passing one
    on is a graph the engine rejects: ortflow/graph/precision/noop_casts.py)."""
    return separate_gemm_biases(drop_noop_casts(model), trainable)


def split_input(cfg: RunConfig, proto_limit: int = PROTO_LIMIT, source: PreparedModel | None = None
                ) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """The whole model prepared for a tensor-parallel split (:func:`ortflow.configure.engine_input.split_source`, or
    ``source`` where the caller has made it, left unchanged; then the Gemm biases apart), its trained and its frozen
    parameters; past ``proto_limit`` its weights stay in the data files (:func:`weights_folder` says where)."""
    trainable, frozen = split_parameters(inspect_model(cfg.model.path), cfg.model.frozen)
    source = source or split_source(cfg, trainable, proto_limit)
    trainable = [n for n in trainable if n not in source.frozen]
    return export_fixes(source.model, trainable), trainable, sorted({*frozen, *source.frozen})


def weights_folder(cfg: RunConfig) -> Path:
    """The folder the split model's external data file names are relative to (the user's model's)."""
    return Path(cfg.model.path).parent


def plan_tensor_parallel(cfg: RunConfig, proto_limit: int = PROTO_LIMIT
                         ) -> tuple[onnx.ModelProto, TensorParallelPlan, list[str], list[str]]:
    """The split of the configured model (or the refusal, naming what and how to fix): fast, no engine call."""
    size = cfg.distributed.horizontal_parallel_size
    model, trainable, frozen = split_input(cfg, proto_limit)
    try:
        check_random_ops(model.graph)
        plan = plan_tensor_parallel_split(model, trainable, size)
        # refuse a bad cut before any engine call (the slices' dims are enough: no weight is read)
        cut_pieces(shard_model(model, plan, 0, values=False), plan, model, trainable)
    except TensorParallelError as err:
        raise ArtifactsError(str(err)) from None
    except SplitError as err:  # random operators: the pieces could not train them
        raise ArtifactsError(f"distributed.horizontal_parallel_size {size}: {err}") from None
    return model, plan, trainable, frozen


def build_piece(cfg: RunConfig, piece: Piece, last: bool, frozen: set[str], folder: Path,
                where: str, proto_limit: int = PROTO_LIMIT,
                padding: dict[str, int] | None = None) -> tuple[tuple[str, ...], dict[str, int], list[dict]]:
    """Build one piece's artifacts into ``folder``; returns the preparation passes its graph went through, the
    padding rows of its tables where its training model masks a lookup gradient (``padding``: table -> torch's padding
    row in this rank's rows of it, :func:`rank_padding_rows`; empty where it masks none) and the report entries of the
    passes over its training model (:func:`ortflow.configure.training_graph.rewrite_part_training_model`).

    A piece of a model past ``proto_limit`` reaches the engine as a pipeline stage does
    (:func:`ortflow.configure.stage_artifacts.generate_part`): its slices written to a data file in ``folder``, its
    replicated weights still references into the user's data files, linked there.

    Raises:
        ArtifactsError: Also for the engine's own failures (bare RuntimeErrors and C++ errors), naming ``where``
            (e.g. "piece 1 of tensor-parallel rank 0").
    """
    try:
        return _build_piece(cfg, piece, last, frozen, folder, proto_limit, padding or {}, where)
    except ArtifactsError:
        raise
    except Exception as err:  # noqa: BLE001 - the engine raises bare RuntimeErrors and C++ errors
        raise ArtifactsError(f"the engine could not build {where}: {type(err).__name__}: {err}") from err


def _build_piece(cfg: RunConfig, piece: Piece, last: bool, frozen: set[str], folder: Path,
                 proto_limit: int, padding: dict[str, int],
                 where: str) -> tuple[tuple[str, ...], dict[str, int], list[dict]]:
    folder.mkdir(parents=True)
    stage = piece.stage
    prepared, scale = prepare_part(cfg, stage, last)
    frozen = frozen | set(prepared.frozen)
    types = {o.name: o.type.tensor_type.elem_type for o in prepared.model.graph.output}
    sends = None if last else stage.sends
    generate_part(cfg, prepared, folder, proto_limit, scale, sends,
                  tuple(n for n in stage.sends if types[n] in FLOAT_TYPES),
                  requires_grad=[*(p for p in stage.parameters if p not in frozen), *piece.float_receives],
                  frozen_params=sorted(t.name for t in prepared.model.graph.initializer if t.name in frozen))
    finish_part(folder, scale, sends, piece.float_receives)
    rows = {t: r for t, r in padding.items() if t in stage.parameters}
    masked, rewrites = rewrite_part_training_model(cfg, folder / "training_model.onnx", rows, where)
    return prepared.passes, masked, rewrites


def rank_padding_rows(rows: dict[str, int], model: onnx.ModelProto, plan: TensorParallelPlan,
                      rank: int) -> dict[str, int]:
    """Torch's padding rows (``rows``: :func:`ortflow.configure.training_graph.torch_padding_rows`) of the tables of
    ``model`` (the whole model or a pipeline stage, before the split) as tensor-parallel rank ``rank`` holds them
    (:func:`ortflow.graph.gradients.padding_rows.local_padding_rows`)."""
    tables = {t.name: t.dims[0] for t in model.graph.initializer if t.name in rows}
    return local_padding_rows({t: r for t, r in rows.items() if t in tables}, plan.slicing(), tables, plan.size, rank)


def same_input_gradients(folder: Path, piece: Piece) -> dict[str, str]:
    """A parallel piece's received tensors whose gradients its training model (built in ``folder``) computes as one
    tensor (:func:`ortflow.graph.gradients.same_gradients.same_gradients`): the backward sums that gradient over the
    tensor-parallel ranks once for all of them."""
    if not piece.parallel or len(piece.float_receives) < 2:
        return {}
    graph = onnx.load(str(folder / "training_model.onnx"), load_external_data=False).graph
    return same_gradients(graph, {name: name + BACKPROP_SUFFIX for name in piece.float_receives})


def piece_record(piece: Piece, model: onnx.ModelProto, passes=(), sums_as_matmul: bool = False) -> dict:
    """A piece's ``tensor.json`` entry (``sums_as_matmul``: its training model's leading-axis sums are MatMuls, and
    its forward-once gradient graph gets the same rewrite at rank start)."""
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    stage = piece.stage
    return {"index": stage.index, "parallel": piece.parallel, "receives": list(stage.receives),
            "float_receives": list(piece.float_receives), "sends": list(stage.sends),
            "float_sends": [n for n in stage.sends if types.get(n) in FLOAT_TYPES],
            "partial_sends": list(piece.partial_sends), "replicated_parameters": list(piece.replicated_parameters),
            "data_inputs": list(stage.data_inputs), "parameters": list(stage.parameters), "passes": list(passes),
            "sums_as_matmul": sums_as_matmul}


def build_tensor_parallel_artifacts(cfg: RunConfig, artifacts_dir: Path,
                                    planned: tuple | None = None, proto_limit: int = PROTO_LIMIT) -> dict:
    """Build every rank's pieces under ``artifacts_dir/tensor`` (replacing what was there) and return the record.

    ``planned``: what :func:`plan_tensor_parallel` returned for ``cfg`` (configure plans before it builds the whole
    model's artifacts, to refuse a bad split early), so the split is not planned twice. ``proto_limit``: model bytes
    from which the weights stay in their files (each piece's slices are read one weight at a time and written to a data
    file in its folder).

    Raises:
        ArtifactsError: The split is refused (names the tensors and the fix) or the engine cannot build a piece.
    """
    size = cfg.distributed.horizontal_parallel_size
    model, plan, trainable, frozen = planned or plan_tensor_parallel(cfg, proto_limit)
    log_plan(plan)  # what was split and what was kept (a WARNING each), with the reason
    ranks, ran_by_piece, masked, rewrites, same = [], {}, {}, {}, {}
    padding, sums = torch_padding_rows(cfg), sums_as_matmul_applies(cfg)
    with building(artifacts_dir, TENSOR_DIR) as scratch:
        for rank in range(size):
            pieces = cut_pieces(shard_model(model, plan, rank, weights_folder(cfg)), plan, model, trainable)
            passes = []
            for piece in pieces:
                key = f"rank-{rank:02d}/piece-{piece.index:02d}"
                ran, rows, rewrites[key] = build_piece(cfg, piece, piece is pieces[-1], set(frozen), scratch / key,
                                                       f"tensor-parallel piece {piece.index} of rank {rank}",
                                                       proto_limit, rank_padding_rows(padding, model, plan, rank))
                passes.append(ran)
                masked.setdefault(piece.index, []).append(rows)
                same.setdefault(piece.index, []).append(same_input_gradients(scratch / key, piece))
            ranks.append([piece_record(p, p.stage.model, ran, sums) for p, ran in zip(pieces, passes, strict=True)])
            ran_by_piece.update({f"rank-{rank:02d}/piece-{p.index:02d}": list(ran)
                                 for p, ran in zip(pieces, passes, strict=True)})
        for info in ranks[0]:  # one record for every rank: each rank's padding rows, in rank order
            info["padding_rows"] = masked[info["index"]]
            info["same_gradient"] = agreed(same[info["index"]])
        record = {"size": size, "slicing": {n: list(v) for n, v in plan.slicing().items()},
                  "split": describe(plan), "pieces": ranks[0], "passes": ran_by_piece, "rewrites": rewrites}
        (scratch / TENSOR_RECORD).write_text(json.dumps(record, indent=1))
    log.info("built %d tensor-parallel ranks of %d pieces each", size, len(record["pieces"]))
    return record
