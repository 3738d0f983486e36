"""Steps 4-6 of a rank's start for any layout: its body, its replica part and, on a pipeline, its stage part
(:mod:`.layout_model`), from the artifacts configure wrote for the layout and the state to start from.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ortflow.artifacts_folder import (
    BATCH_STATISTICS_INPUT,
    CAPTURE_HEAD,
    CAPTURE_TAIL,
    read_pipe_tensor_record,
    read_stages_record,
    read_tensor_record,
    stage_base,
    stage_dir,
)
from ortflow.checkpoints import h5state
from ortflow.checkpoints.tp import tp_optimizer_files
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer import loss_scale
from ortflow.trainer.captured_call import CapturedTraining
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.device_pipe import DevicePipe
from ortflow.trainer.comm.engine_buffers import engine_buffers
from ortflow.trainer.comm.nccl import NCCLComm
from ortflow.trainer.optim.adasum_update import SlicedPeers
from ortflow.trainer.optim.rank_update import data_parallel_update
from ortflow.trainer.parallel.activations import DeviceTensors, activation_store
from ortflow.trainer.parallel.kept_activations import KeptActivations, keep_piece_activations
from ortflow.trainer.parallel.layout_model import DataParallel, LayoutModel
from ortflow.trainer.parallel.parallel_dims import Groups, ParallelDims, Place, make_groups
from ortflow.trainer.parallel.pipeline_stage import PipelineStage, stage_session_options
from ortflow.trainer.parallel.tensor_parallel_body import TensorParallel, load_pieces, load_sliced_parameters
from ortflow.trainer.parallel.whole_model import WholeModel
from ortflow.trainer.startup import (
    available_cores,
    choose_start,
    load_parameters,
    session_options,
    spin_wait,
    threads_per_rank,
)

log = logging.getLogger("ortflow.trainer")


def init_layout(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str, dims: ParallelDims) -> LayoutModel:
    """This rank's model in the ``dp x pp x tp`` layout ``dims``: groups joined, sessions opened, state loaded."""
    record = layout_record(cfg, dims)
    where, groups = make_groups(comm, dims)  # Sync points (collective over the world): the sub-groups it joins
    resume, warm = choose_start(cfg, comm, dims.pp)
    start = resume.path if resume else Path(warm) if warm else None  # a warm start takes the weights only
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    buffers = engine_buffers(device, groups.dp)  # on CUDA, updated on the replicas' NCCL stream
    info = record["stages"][where.stage] if dims.pp > 1 else {}
    if dims.tp > 1:
        pieces = info if dims.pp > 1 else record
        base = stage_base(cfg.artifacts_dir, where.stage) if dims.pp > 1 else Path(cfg.artifacts_dir)
        body = tensor_body(cfg, pieces, base, where, groups, buffers, threads, device, start,
                           last=where.stage == dims.pp - 1)
    else:
        body = whole_body(cfg, comm, dims, where, buffers, threads, device, start)
    stage = None
    if dims.pp > 1:
        stage = PipelineStage(body, comm, where.stage, dims.pp, groups.pp, tuple(info["receives"]),
                              tuple(info["sends"]), info.get("shared", {}),
                              padding_rows=info.get("padding_rows", {}),
                              sums_as_matmul=bool(info.get("sums_as_matmul")))
        stage.device_pipe = pipeline_messages(groups.pp, body, buffers)  # Sync point (collective): the NCCL links
    data = replica_part(cfg, groups, where, dims, body, stage, threads, resume)
    scaler = loss_scale.from_config(cfg.precision, loss_scale.saved_state(resume.meta) if resume else None)
    if scaler.enabled:
        log.info("rank %d loss scale %g (%s; %d clean updates, %d skipped so far)", comm.rank, scaler.scale,
                 "dynamic" if scaler.dynamic else "static", scaler.clean_updates, scaler.skipped_updates)
    model = LayoutModel(cfg, Path(run_dir), comm, dims, device, threads, buffers, resume, body, data, stage, scaler)
    if isinstance(body, WholeModel) and stage is not None:
        body.kept = body.engine_parts()[0].kept = keep_activations(cfg, body, stage, threads)
    log_start(model, where, info, "the initial weights" if start is None else
              f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}")
    return model


def layout_record(cfg: RunConfig, dims: ParallelDims) -> dict:
    """The record of the artifacts configure wrote for this layout (stages, tensor-parallel pieces or both).

    Raises:
        RuntimeError: they were written for other sizes (or not at all), naming the fix.
    """
    folder = cfg.artifacts_dir
    if dims.pp > 1 and dims.tp > 1:
        record = read_pipe_tensor_record(folder)
        if record is None or record["size"] != dims.tp or record["num_stages"] != dims.pp:
            raise RuntimeError(f"{folder} holds no pipeline x tensor-parallel artifacts of {dims.pp} stages x "
                               f"{dims.tp} ranks: re-run `ortflow configure` with these sizes")
    elif dims.tp > 1:
        record = read_tensor_record(folder)
        if record is None or record["size"] != dims.tp:
            raise RuntimeError(f"{folder} holds no tensor-parallel artifacts of size {dims.tp}: re-run `ortflow "
                               f"configure` with distributed.horizontal_parallel_size {dims.tp}")
    elif dims.pp > 1:
        record = read_stages_record(folder)
        if record is None or len(record["stages"]) != dims.pp:
            raise RuntimeError(f"{folder} holds no {dims.pp}-stage pipeline artifacts: re-run `ortflow configure` "
                               f"with distributed.pipeline_parallel_size {dims.pp}")
    else:
        record = {}
    return record


def whole_body(cfg: RunConfig, comm: Communicator, dims: ParallelDims, where: Place, buffers, threads: int,
               device: str, start: Path | None) -> WholeModel:
    """One engine module: the whole model, or this rank's pipeline stage; its parameters from ``start``."""
    folder = stage_dir(cfg.artifacts_dir, where.stage) if dims.pp > 1 else Path(cfg.artifacts_dir)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    deterministic = cfg.distributed.deterministic_compute
    if dims.pp > 1:  # on the CPU, one arena for the stage's two sessions (trainer/arena.py)
        options = stage_session_options(threads, buffers, deterministic)
    else:  # on the CPU, from an arena whose first chunk holds every gradient: the exchange reduces them as one buffer
        spin = spin_wait(cfg, comm.local_size, threads, available_cores())
        options = buffers.replica_options(session_options(threads, deterministic, spin), state)
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device=device,
                        session_options=options)
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if not trainable:
        raise RuntimeError(f"{folder / 'checkpoint'} holds no trainable parameters: re-run `ortflow configure`")
    if start is not None:  # by name (a stage reads its own from the stage files or a whole model's params.h5)
        load_parameters(state, start, buffers, names={n for n, _ in state.parameters} if dims.pp > 1 else None)
    body = WholeModel(state, module, folder, trainable, buffers)
    if device != "cpu" and dims.pp == 1 and cfg.distributed.cuda_graphs and (folder / CAPTURE_HEAD).exists():
        tail = folder / CAPTURE_TAIL
        body.captured = CapturedTraining(folder / CAPTURE_HEAD, tail if tail.exists() else None, state,
                                         int(device.partition(":")[2] or 0), options)
    body.gradient_buffers()  # pinned now: the tied-gradient sums and a profiling module read these
    return body


def tensor_body(cfg: RunConfig, record: dict, base: Path, where: Place, groups: Groups, buffers, threads: int,
                device: str, start: Path | None, last: bool) -> TensorParallel:
    """This tensor-parallel rank's pieces (of ``base``, their ``tensor.json`` ``record``), their slices of
    ``start``'s parameters (merged ones sliced for this size) and where their activations live."""
    size = cfg.distributed.horizontal_parallel_size  # choose_start refused a checkpoint of another size
    pieces, holders = load_pieces(record, base, where.tp_rank, device, stage_session_options(threads, buffers))
    trainable = sorted(n for n, hs in holders.items() if pieces[hs[0]].state.parameters[n].requires_grad)
    body = TensorParallel(pieces, holders, trainable, record["slicing"], buffers, where.tp_rank, size, groups.tp)
    if start is not None:
        load_sliced_parameters(body, start)
    body.tensors = activation_store(buffers, groups.tp, where.tp_rank, size)
    body.gradient_buffers()  # pinned now: the tied-gradient sums and a profiling module read these
    if not cfg.distributed.recomputes_forward():
        options = stage_session_options(threads, buffers, cfg.distributed.deterministic_compute)
        keep_piece_activations(pieces, where.tp_rank, last, options, cfg.distributed.recompute_subgraphs, buffers)
    return body


def replica_part(cfg: RunConfig, groups: Groups, where: Place, dims: ParallelDims, body, stage, threads: int,
                 resume) -> DataParallel:
    """The exchange over the replicas of this rank's part and the update of its parameters (optimizer state from
    the checkpoint being resumed: this part's files, any replica count and sharding)."""
    dist, dp = cfg.distributed, groups.dp
    averages = not ((dist.zero_stage == 1 or dist.enable_adasum) and dp.size > 1)
    shared = stage.shared if stage is not None else {}
    tensor = isinstance(body, TensorParallel)
    peers = SlicedPeers(dp, groups.tp, [n in body.slicing for n in body.trainable]) if tensor else None
    # The host exchange leaves the mean's scale to the norm and the update; a split model's mean (over a sub-group,
    # where a tied sum may write the gradients between the exchange and the update) scales eagerly.
    update, exchange = data_parallel_update(cfg, dp, body.trainable, body.parameter_buffers(), body.buffers, threads,
                                            fold=not (dims.split and averages), peers=peers)
    if exchange.sharded and shared:
        raise RuntimeError(f"pipeline stage {where.stage} holds tied weights {sorted(shared)} also held by another "
                           "stage: distributed.zero_stage 1 shards each stage's gradients before the holders could "
                           "add theirs; use zero_stage 0 with this model and cut, or cut where no weight is shared")
    if resume:
        if tensor:
            files = tp_optimizer_files(resume.path, where.tp_rank, dims.tp,
                                       (where.stage, dims.pp) if dims.pp > 1 else None)
        elif stage is not None:
            files = h5state.stage_optimizer_files(resume.path, where.stage, dims.pp)
        else:
            files = None
        h5state.load_optimizer(resume.path, update, cfg.optimizer.label, rank=where.replica, files=files)
    return DataParallel(dp, where.replica, dims.dp, update, exchange)


def keep_activations(cfg: RunConfig, body: WholeModel, stage: PipelineStage, threads: int) -> KeptActivations | None:
    """The forward-once calls of a stage that is not the last (on the CPU or its GPU), unless it recomputes
    (``DistributedConfig.recomputes_forward``); stages whose forward switches BatchNorm to batch statistics (its eval
    model's extra input) recompute. A stage whose training model masks an embedding's padding row has the same mask
    applied to its gradient graph (``stage.padding_rows``), and one whose training model's leading-axis sums are
    MatMuls the same rewrite (``stage.sums_as_matmul``)."""
    if stage.last or cfg.distributed.recomputes_forward():
        return None
    if BATCH_STATISTICS_INPUT in body.engine_parts()[0].prepared(False).input_names():
        return None
    body.module.train()
    options = stage_session_options(threads, body.buffers, cfg.distributed.deterministic_compute)
    return KeptActivations(body.folder / "eval_model.onnx", body.state, body.trainable, stage.receives, stage.sends,
                           options, cfg.distributed.recompute_subgraphs, buffers=body.buffers,
                           host_sends=stage.device_pipe is None, padding_rows=stage.padding_rows,
                           sums_as_matmul=stage.sums_as_matmul)


def pipeline_messages(pipe: Communicator, body, buffers) -> DevicePipe | None:
    """The pipeline's activations and gradients over NCCL, device to device
    (:meth:`~ortflow.trainer.comm.nccl.NCCLComm.device_pipe`), where they can go so: a CUDA rank (``buffers`` on the
    device) whose pipeline group is an NCCL group and whose body is one engine module, which then takes and returns
    device tensors (:attr:`WholeModel.tensors`). Else None: host arrays over the pipeline's process group (CPU ranks; a
    pipeline x tensor-parallel stage). Collective over the pipeline group when it makes the links (every rank of it has
    the same device kind and body kind)."""
    if not (buffers.on_device and isinstance(pipe, NCCLComm) and isinstance(body, WholeModel)):
        return None
    engine = buffers.engine_stream()
    body.tensors = DeviceTensors(pipe, engine, "pipeline stage work on the engine stream", collective=False)
    return pipe.device_pipe(engine)


def log_start(model: LayoutModel, where: Place, info: dict, start: str) -> None:
    """Lines per rank: the same first line in every layout (its place in the world, its device, where it starts
    from: what ``mpiexec`` launchers are checked by), then its part of the model in a split layout."""
    comm, body, dims = model.comm, model.body, model.dims
    log.info("rank %d/%d (local %d/%d) on %s with %d thread(s), starting from %s", comm.rank, comm.size,
             comm.local_rank, comm.local_size, model.device, model.threads, start)
    if isinstance(body, TensorParallel):
        log.info("rank %d: tensor-parallel rank %d/%d of replica %d/%d%s, %d pieces (%d keep their activations), %d "
                 "parameter tensors (%d sliced)", comm.rank, body.tp_rank, body.tp_size,
                 where.replica, dims.dp, f" of pipeline stage {where.stage}/{dims.pp}" if dims.pp > 1 else "",
                 len(body.pieces), sum(p.kept is not None for p in body.pieces), len(body.trainable),
                 len(set(body.trainable) & set(body.slicing)))
        masking = {p.info["index"]: p.kept.padding_rows for p in body.pieces if p.kept is not None and p.kept.masked}
        if masking:
            log.info("rank %d: kept pieces whose gradient graphs mask torch's padding rows: %s", comm.rank, masking)
        sums = {p.info["index"]: p.kept.sums.line() for p in body.pieces
                if p.kept is not None and p.kept.sums is not None}
        if sums:
            log.info("rank %d: kept pieces' gradient graphs: %s", comm.rank, sums)
    elif model.stage is not None:
        log.info("rank %d: pipeline stage %d/%d of replica %d/%d, %d parameter tensors, receives %s, sends %s",
                 comm.rank, where.stage, dims.pp, where.replica, dims.dp, len(body.trainable), info["receives"],
                 info["sends"])
        if not model.stage.last:
            log.info("rank %d stage %d: %s", comm.rank, where.stage, "forward once, activations kept until the "
                     "backward" if body.kept is not None else "forward recomputed inside the backward call")
        if body.kept is not None and body.kept.masked:
            log.info("rank %d stage %d: its gradient graph masks torch's padding rows %s", comm.rank, where.stage,
                     body.kept.padding_rows)
        if body.kept is not None and body.kept.sums is not None:
            log.info("rank %d stage %d: its gradient graph: %s", comm.rank, where.stage, body.kept.sums.line())
