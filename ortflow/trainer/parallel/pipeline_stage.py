"""One pipeline stage on one rank (a :class:`~ortflow.trainer.rank_model.RankModel`): its engine session, its weight
update, its process groups, its checkpoint part.

Layout (:mod:`.parallel_dims` with ``tp = 1``): ``rank = replica * P + stage`` (a replica's stages are neighbouring
ranks, so on one host they talk through shared memory). Two sub-groups: ``stage_comm`` (the D replicas of this stage:
gradient averaging, as unsplit data-parallel training does) and ``pipe_comm`` (the P stages of this replica:
activations and gradients). The micro-batches go through the stages with :mod:`.schedule`'s 1F1B.

The weight update is ortflow's (:mod:`ortflow.trainer.optim`) over the stage's parameter buffers; a checkpoint holds
every stage's ``params``/``optimizer`` HDF5 files, written by each stage's first replica into the one folder
(:func:`ortflow.checkpoints.h5state.write_state`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime

from ortflow.artifacts_folder import BATCH_STATISTICS_INPUT, GRAD_IN_SUFFIX, read_stages_record, stage_dir
from ortflow.checkpoints import h5state
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers, engine_buffers
from ortflow.trainer.optim.rank_update import build_update, whole_update
from ortflow.trainer.optim.zero import Zero0
from ortflow.trainer.parallel.kept_activations import KeptActivations
from ortflow.trainer.parallel.parallel_dims import ParallelDims, make_groups
from ortflow.trainer.parallel.replica import Runtime
from ortflow.trainer.parallel.schedule import (
    ACT_TAG,
    GRAD_TAG,
    log_stage_timing,
    pipeline_step,
    stage_eval_sums,
    sum_tied_gradients,
)
from ortflow.trainer.rank_model import EnginePart, Reduced, compare_digests, sha256_of
from ortflow.trainer.startup import (
    available_cores,
    choose_start,
    load_parameters,
    optimizer_label,
    session_options,
    threads_per_rank,
)
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


def stage_session_options(threads: int, buffers: HostBuffers | DeviceBuffers,
                          deterministic: bool = True) -> onnxruntime.SessionOptions:
    """The trainer's session options; on the CPU, one arena for the stage's two sessions
    (:func:`ortflow.trainer.arena.use_stage_arena`)."""
    return buffers.stage_options(session_options(threads, deterministic))


@dataclass
class StageRuntime(Runtime):
    """A rank of a pipeline: the unsplit Runtime's fields for its own stage, plus where it sits."""

    stage: int = 0
    num_stages: int = 1
    replica: int = 0
    num_replicas: int = 1
    stage_comm: Communicator | None = None
    pipe_comm: Communicator | None = None
    receives: tuple[str, ...] = ()
    sends: tuple[str, ...] = ()
    shared: dict[str, list[int]] | None = None  # tied parameters it holds -> every holding stage, in order
    _timing: list[tuple[float, float]] = field(default_factory=list)  # (update s, engine s) of each update
    _update_started: float | None = None
    _compute_s: float = 0.0
    _batch_statistics: bool | None = None  # its eval model takes BATCH_STATISTICS_INPUT (a BatchNorm before the cut)
    kept: KeptActivations | None = None  # forward once, activations kept (else the training call recomputes them)

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def data_shard(self) -> tuple[int, int]:
        """Every stage of a replica reads that replica's batches (the first needs inputs, the last labels)."""
        return self.replica, self.num_replicas

    def train_state(self) -> h5state.TrainState:
        """This stage's files of a checkpoint, written by its first replica (the others write nothing)."""
        return h5state.TrainState(
            parameters=lambda: {n: np.array(p.data) for n, p in self.state.parameters},
            trainable=self.trainable, update=self.update, optimizer=optimizer_label(self.cfg),
            rank=self.replica, world_size=self.num_replicas, stage=(self.stage, self.num_stages),
            sharded=self.exchange.sharded,
            replica=self.exchange.per_rank_state and not self.exchange.sharded,
        )

    # -- the engine calls ------------------------------------------------------------------------------------------

    def engine_parts(self) -> list[EnginePart]:
        """The stage's one module."""
        if self._parts is None:
            self._parts = [EnginePart(self.state, self.module, stage_dir(self.cfg.artifacts_dir, self.stage))]
        return self._parts

    def _call(self, train: bool, feeds: dict[str, np.ndarray]) -> list:
        return self.engine_parts()[0].call(train, feeds)

    def forward(self, feeds: dict[str, np.ndarray], train: bool = True) -> list[np.ndarray]:
        """A middle stage's forward pass (eval model, which outputs just the sent tensors; nothing is kept). ``train``:
        of a training micro-batch, so BatchNorm normalises by the batch as the training call's recomputation will
        (graph/pipeline_parallel/batchnorm_forward.py); else by the running statistics."""
        if train and self.kept is not None:
            return self.kept.forward(feeds)
        if self._batch_statistics is None:
            self._batch_statistics = BATCH_STATISTICS_INPUT in self.engine_parts()[0].prepared(False).input_names()
        if self._batch_statistics:
            feeds = {**feeds, BATCH_STATISTICS_INPUT: np.array(train)}
        return self._call(False, feeds)[: len(self.sends)]

    def backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None) -> tuple[float, list]:
        """Recompute the forward pass and run the backward pass (the last stage: from its loss; others: driven by
        ``grads``); parameter gradients accumulate in the engine. Returns (loss, gradients of what it received)."""
        if grads is not None and self.kept is not None and self.kept.in_flight():
            return 0.0, self.kept.backward(grads)
        if grads is not None:
            feeds = {**feeds, **{n + GRAD_IN_SUFFIX: g for n, g in zip(self.sends, grads, strict=True)}}
        outputs = self._call(True, feeds)
        return float(outputs[0]), outputs[1 : 1 + len(self.receives)]

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The last stage's loss on an eval batch (eval model)."""
        return float(self._call(False, feeds)[0])

    def grad_view(self, name: str) -> np.ndarray:
        """The trainer's gradient buffer of ``name`` (pinned: a profiling module swaps what the state returns)."""
        return self.gradient_buffers()[self.trainable.index(name)]

    # -- the rank model ------------------------------------------------------------------------------------------

    def accumulate(self, batches, k: int, timer: PhaseTimer | None = None) -> float:
        """``k`` micro-batches through the stages (1F1B); their loss sum on the last stage, 0 elsewhere. The
        ``forward_backward`` phase includes waiting on the neighbouring stages."""
        started = time.perf_counter()
        stats = pipeline_step(self, batches, k, timer=timer)
        if timer is not None:
            timer.lap("forward_backward")
        self._update_started, self._compute_s = started, stats.compute_s
        return stats.loss_sum

    def reduce(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """A stage's replicas average its gradients (the unsplit exchange, per stage); holders of a tied weight add
        theirs; loss, stop and the norm shares are summed over every rank."""
        # The mean (ZeRO-0) adds the holders' averaged gradients of a tied weight; ZeRO-1 and Adasum combine after the
        # holders' sum, so that they see the one tensor the unsplit model's exchange sees.
        mean = isinstance(self.exchange, Zero0)
        if not mean:
            sum_tied_gradients(self)  # Sync point: holders of a tied weight add their gradients (point-to-point)
        mine = self.exchange.reduce(self.gradient_buffers(), k * self.num_replicas, np.zeros(0, np.float32))
        if mean:
            sum_tied_gradients(self)
        shared = self.shared or {}
        own = mine if self.exchange.sharded else [  # ZeRO-1: a shard of a stage without tied weights
            g for n, g in zip(self.trainable, mine, strict=True) if n not in shared or shared[n][0] == self.stage]
        # Adasum's deltas: each replica steps on its own gradients and clips by their norm, summed over its stages.
        norm_sq, own_norm = 0.0, self.exchange.per_rank_state and not self.exchange.sharded
        if own_norm:  # Sync point: the replica's stages add their shares
            norm_sq = float(self.pipe_comm.allreduce_sum(np.array([self.exchange.norm(own) ** 2]), "stage norms")[0])
        elif self.replica == 0:  # a tied weight counted once, after its sum
            # The tied sum changed gradients after the exchange, whose norm may predate it (NCCL's does): the stage's
            # own share is measured afresh then.
            norm_sq = self.pipe_comm.sum_squares(own) if shared else self.exchange.norm(own) ** 2
        local = np.array([loss_sum / k, float(stop), 0.0 if own_norm else norm_sq])
        # Sync point: loss, stop flag and gradient norm agree on every rank of every stage.
        scalars = self.comm.allreduce_sum(local, "pipeline loss, stop, norm")
        return Reduced(mine, float(scalars[0]) / self.num_replicas, bool(scalars[1]),
                       norm_sq if own_norm else float(scalars[2]))

    def grad_norm(self, reduced: Reduced) -> float:
        return float(np.sqrt(reduced.norm_sq))

    def after_update(self) -> None:
        self.exchange.gather()  # Sync point (ZeRO-1, Adasum's deltas): the stage's replicas' parameters agree again
        self.module.lazy_reset_grad()
        if self.kept is not None:
            self.kept.reset()
        if self._update_started is not None:
            self._timing.append((time.perf_counter() - self._update_started, self._compute_s))

    def eval_sums(self, eval_batches) -> np.ndarray:
        return stage_eval_sums(self, eval_batches)

    def sum_scalars(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.comm.allreduce_sum(values, label)

    def replica_check(self, step: int) -> dict:
        """A stage's replicas hold bitwise equal parameters; each stage's sha256 goes into the checkpoint meta."""
        mine = sha256_of(self.state.parameters[n].data for n in self.trainable)
        compare_digests(self, step, [(mine, self.stage_comm, "stage parameter digest")], mine)
        digests = self.pipe_comm.gather_object(mine, "gather stage digests") if self.replica == 0 else None
        return {"params_sha256": digests}

    def layout_meta(self) -> dict:
        return {"pipeline_parallel_size": self.num_stages}

    def whole_parameters(self, names) -> dict[str, np.ndarray] | None:
        """The stages' parameters gathered on rank 0 (replica 0's stages take part; collective over them)."""
        if self.replica != 0:
            return None
        mine = {n: np.array(self.state.parameters[n].data) for n in self.trainable if names(n)}
        parts = self.pipe_comm.gather_object(mine, "gather parameters for histograms")
        return {n: v for part in parts for n, v in part.items()} if parts is not None else None

    def finish(self) -> None:
        log_stage_timing(self, self._timing)
        if self.kept is not None:
            log.info("rank %d stage %d kept the activations of at most %d micro-batches at once", self.comm.rank,
                     self.stage, self.kept.most_in_flight)


def init_stage_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str,
                       dims: ParallelDims) -> StageRuntime:
    """Place this rank in the pipeline, load its stage's artifacts and the state to start from."""
    num_stages, num_replicas = dims.pp, dims.dp
    record = read_stages_record(cfg.artifacts_dir)
    if record is None or len(record["stages"]) != num_stages:
        raise RuntimeError(
            f"{cfg.artifacts_dir} holds no {num_stages}-stage pipeline artifacts: re-run `ortflow configure` with "
            f"distributed.pipeline_parallel_size {num_stages}"
        )
    # Sync points (collective over the world): the two sub-groups every rank joins (NCCL groups under use_nccl).
    where, groups = make_groups(comm, dims)
    replica, stage, stage_comm, pipe_comm = where.replica, where.stage, groups.dp, groups.pp
    pipe_comm.open_point_to_point((ACT_TAG, GRAD_TAG))  # NCCL: its p2p communicators, before any transfer
    resume, warm = choose_start(cfg, comm, num_stages)
    folder = stage_dir(cfg.artifacts_dir, stage)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    buffers = engine_buffers(device, stage_comm)  # on CUDA, updated on the stage group's NCCL stream
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device=device,
                        session_options=stage_session_options(threads, buffers, cfg.distributed.deterministic_compute))
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if resume or warm:  # this stage's parameters, read by name from the stage files (or a whole model's params.h5)
        load_parameters(state, resume.path if resume else Path(warm), buffers,
                        names={name for name, _ in state.parameters})
    info = record["stages"][stage]
    if not buffers.on_device and (cfg.distributed.zero_stage or cfg.distributed.enable_adasum):
        # ZeRO-1 or Adasum over the stage's replicas, built as over an unsplit model's (host buffers)
        update, exchange = build_update(cfg, stage_comm, state, trainable, threads)
    else:  # whole tensors, the stage's replicas average (ZeRO-0), its scale applied before the norm reads them
        update = whole_update(cfg, stage_comm, trainable, buffers.parameters(state, trainable), buffers, threads)
        exchange = Zero0(stage_comm)
    if exchange.sharded and info.get("shared"):
        raise RuntimeError(f"pipeline stage {stage} holds tied weights {sorted(info['shared'])} also held by another "
                           "stage: distributed.zero_stage 1 shards each stage's gradients before the holders could "
                           "add theirs; use zero_stage 0 with this model and cut, or cut where no weight is shared")
    if resume:  # this stage's files (any replica count and sharding)
        h5state.load_optimizer(resume.path, update, optimizer_label(cfg), rank=replica,
                               files=h5state.stage_optimizer_files(resume.path, stage, num_stages))
    start = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info("rank %d on %s: pipeline stage %d/%d of replica %d/%d, %d parameter tensors, receives %s, sends %s, "
             "starting from %s", comm.rank, device, stage, num_stages, replica, num_replicas, len(trainable),
             info["receives"], info["sends"], start)
    rt = StageRuntime(cfg, Path(run_dir), comm, device, threads, state, module, update, exchange, trainable,
                      resume,
                      stage=stage, num_stages=num_stages, replica=replica, num_replicas=num_replicas,
                      stage_comm=stage_comm, pipe_comm=pipe_comm, receives=tuple(info["receives"]),
                      sends=tuple(info["sends"]), shared=info.get("shared", {}), dims=dims, buffers=buffers)
    rt.gradient_buffers()  # pinned now: the tied-gradient sums and a profiling module read these
    rt.kept = rt.engine_parts()[0].kept = keep_activations(cfg, rt, folder)
    if not rt.last:
        log.info("rank %d stage %d: %s", comm.rank, stage, "forward once, activations kept until the backward"
                 if rt.kept is not None else "forward recomputed inside the backward call")
    return rt


def keep_activations(cfg: RunConfig, rt: StageRuntime, folder: Path) -> KeptActivations | None:
    """The forward-once calls of a stage that is not the last, unless the config asks for recomputation; CUDA stages
    and stages whose forward switches BatchNorm to batch statistics (its eval model's extra input) recompute."""
    if rt.last or cfg.distributed.recompute_forward or rt.buffers.on_device:
        return None
    eval_model = folder / "eval_model.onnx"
    if BATCH_STATISTICS_INPUT in rt.engine_parts()[0].prepared(False).input_names():
        return None
    rt.module.train()
    options = stage_session_options(rt.threads, rt.buffers, cfg.distributed.deterministic_compute)
    return KeptActivations(eval_model, rt.state, rt.trainable, rt.receives, rt.sends, options,
                           cfg.distributed.recompute_subgraphs)


