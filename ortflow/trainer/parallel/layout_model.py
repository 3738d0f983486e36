"""A rank's model in any layout, composed of parts: the one :class:`~ortflow.trainer.rank_model.RankModel`.

Every rank is a replica (:class:`DataParallel`: the exchange over the replicas of its part of the model and the update
of its parameters) of a body, the part of the model it runs:

* :class:`~.whole_model.WholeModel`: one engine module, the whole model or a pipeline stage's graph;
* :class:`~.tensor_parallel_body.TensorParallel`: its tensor-parallel pieces (of the whole model or of a stage).

A pipeline schedule (:class:`~.pipeline_stage.PipelineStage`) is applied to the body when the model is cut into
stages. So data parallelism is ``(whole, no stage)``, a pipeline ``(whole, stage)``, tensor parallelism
``(tensor, no stage)`` and pipeline x tensor ``(tensor, stage)``, and what the replica part does (ZeRO-0, ZeRO-1,
Adasum, the loss scale, the norm and clipping, the checkpoint's optimizer files) is written once for all four.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.checkpoints import CheckpointInfo, h5state
from ortflow.config import RunConfig
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.comm.pending import pick
from ortflow.trainer.loss_scale import LossScaler
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.segments import Update
from ortflow.trainer.parallel.parallel_dims import ParallelDims
from ortflow.trainer.parallel.pipeline_stage import PipelineStage
from ortflow.trainer.parallel.tensor_parallel_body import TensorParallel
from ortflow.trainer.parallel.whole_model import WholeModel
from ortflow.trainer.rank_model import EnginePart, Reduced, compare_digests
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


@dataclass
class DataParallel:
    """The replica part of every layout: this rank's place among the replicas of its part of the model, the exchange
    over them (:func:`~ortflow.trainer.optim.rank_update.data_parallel_update`) and the update of its parameters."""

    comm: Communicator  # the replicas of this rank's part (every rank when nothing is split)
    replica: int
    num_replicas: int
    update: Update
    exchange: Exchange


@dataclass
class LayoutModel:
    """A body, its replica part and, on a pipeline, its stage part (the fields the loop and the hooks read)."""

    cfg: RunConfig
    run_dir: Path
    comm: Communicator
    dims: ParallelDims
    device: str
    threads: int
    #: Where the engine keeps the parameters and gradients (:mod:`ortflow.trainer.comm.engine_buffers`).
    buffers: HostBuffers | DeviceBuffers
    resume: CheckpointInfo | None
    body: WholeModel | TensorParallel
    data: DataParallel
    stage: PipelineStage | None = None
    loss_scale: LossScaler = field(default_factory=LossScaler)
    #: Small named arrays/scalars saved with every checkpoint; read them back on resume with
    #: ``h5state.read_extra_state(model.resume.path)``.
    extra_state: Callable[[], dict] | None = None

    @property
    def update(self) -> Update:
        return self.data.update

    @property
    def exchange(self) -> Exchange:
        return self.data.exchange

    @property
    def replicas(self) -> Communicator:
        """The replicas of this rank's part of the model (every rank when nothing is split)."""
        return self.data.comm

    @property
    def trainable(self) -> list[str]:
        return self.body.trainable

    @property
    def state(self):
        """The engine state of the body's (last) module."""
        return self.body.state

    @property
    def module(self):
        """The body's (last) engine module."""
        return self.body.module

    def data_shard(self) -> tuple[int, int]:
        """Every rank of a replica (its stages and tensor-parallel ranks) reads that replica's batches."""
        return self.data.replica, self.data.num_replicas

    def engine_parts(self) -> list[EnginePart]:
        return self.body.engine_parts()

    def gradient_buffers(self) -> list:
        return self.body.gradient_buffers()

    # -- one weight update ----------------------------------------------------------------------------------------

    def accumulate(self, batches, k: int, timer: PhaseTimer | None = None) -> float:
        """``k`` micro-batches (through the stages on a pipeline); gradients accumulate in the engines. Their loss
        sum (loss scale included) where this rank computes the loss, else 0."""
        batches = map(self.loss_scale.feed, batches)  # fp16: the loss's graph multiplies the loss by the scale input
        if self.stage is not None:
            return self.stage.accumulate(batches, k, timer)
        loss_sum = 0.0
        for _ in range(k):
            feeds = next(batches)
            _lap(timer, "data")
            loss_sum += self.body.micro_step(feeds)
            _lap(timer, "forward_backward")
        return loss_sum

    def reduce(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """The exchange over the replicas; on a split model also the tied-gradient sums, and loss, stop and the norm
        shares summed over every rank. The loss scale is divided out with the average (a non-finite gradient of any
        stage or piece makes the global norm non-finite on every rank, so every rank skips that update)."""
        if not self.dims.split:
            return self._reduce_whole(k, loss_sum, stop)
        ex, stage = self.exchange, self.stage
        # Sync point (tensor parallel): a parallel piece's replicated parameters' partial gradients summed over tp;
        # then within the rank, pieces that read one weight add their gradients.
        self.body.sum_tied_gradients()
        # A mean (ZeRO-0) adds the holders' averaged gradients of a weight tied across stages; ZeRO-1 and Adasum
        # combine after the holders' sum, so that they see the one tensor the unsplit model's exchange sees.
        tied_after = stage is not None and bool(stage.shared) and ex.averages
        if stage is not None and not tied_after:
            stage.sum_tied_gradients(self._grad_of)
        scale = self.loss_scale.scale  # 1 but in fp16, whose gradients arrive that much larger on every stage
        mine = ex.reduce(self.gradient_buffers(), k * self.data.num_replicas * scale, np.zeros(0, np.float32))
        if tied_after:
            stage.sum_tied_gradients(self._grad_of)
        own = ex.per_rank_state and not ex.sharded  # Adasum's deltas: each replica clips by its own gradient's norm
        share = self._norm_share(mine, tied_after, own)
        norm_sq = self._sum_over_replica(share) if own else 0.0
        local = np.array([loss_sum / k / scale if self.body.counts_loss else 0.0, float(stop), 0.0 if own else share])
        # Sync point: loss, stop flag and gradient norm agree on every rank.
        scalars = self.sum_scalars(local, "loss, stop, norm")
        return Reduced(mine, float(scalars[0]) / self.data.num_replicas, bool(scalars[1]),
                       norm_sq if own else float(scalars[2]))

    def _reduce_whole(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """The whole model on every rank: the loss and the stop flag ride in the gradients' exchange, whose norm is
        the global one; the loss scale is divided out here too."""
        scaler, world = self.loss_scale, self.data.num_replicas
        scalars = np.array([loss_sum / k / scaler.scale, float(stop)], dtype=np.float32)
        mine = self.exchange.reduce(self.gradient_buffers(), k * world * scaler.scale, scalars)
        return Reduced(mine, float(scalars[0]) / world, bool(scalars[1]))

    def _grad_of(self, name: str):
        """The gradient buffer of ``name`` that the exchange reads (its owner piece's on a tensor-parallel rank)."""
        return self.gradient_buffers()[self.trainable.index(name)]

    def _norm_share(self, mine, fresh: bool, own: bool) -> float:
        """This rank's share of the squared global norm: each gradient counted once over the tensor-parallel ranks
        and the stages (:meth:`counts_in_norm`) and, but for sharded exchanges, over the replicas. ``fresh``: the
        gradients changed after the exchange (a tied sum), whose own norm then predates them."""
        ex = self.exchange
        keep = [self.counts_in_norm(n) for n in ex.names(self.trainable)]
        if own:
            return ex.norm(pick(mine, keep)) ** 2  # this replica's own gradient
        if ex.sharded:  # ZeRO-1: every replica holds another range; its norm already sums the ranges
            if all(keep):
                return ex.norm(mine) ** 2 if self.data.replica == 0 else 0.0
            return self.data.comm.sum_squares(pick(mine, keep))
        if self.data.replica != 0:  # the replicas hold the same mean
            return 0.0
        if all(keep) and not fresh:
            return ex.norm(mine) ** 2
        # After a tied sum the buffers were last written over the pipeline group (its stream on GPUs).
        group = self.stage.pipe_comm if fresh else self.data.comm
        return group.sum_squares(pick(mine, keep))

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank counts ``name``'s gradient in the global norm (a replicated tensor on tensor-parallel
        rank 0, a tied one on its first stage)."""
        return self.body.counts_in_norm(name) and (self.stage is None or self.stage.counts_in_norm(name))

    def _sum_over_replica(self, share: float) -> float:
        """A replica's own squared norm: the shares of its stages and tensor-parallel ranks added."""
        total = np.array([share])
        if self.stage is not None:  # Sync point: the replica's stages add their shares
            total = self.stage.pipe_comm.allreduce_sum(total, "stage norms")
        if isinstance(self.body, TensorParallel):  # Sync point: and its tensor-parallel ranks, in rank order
            total = self.body.tp_comm.allgather_sum(total, "tensor-parallel norms")
        return float(total[0])

    def grad_norm(self, reduced: Reduced) -> float:
        """The global gradient norm, the same on every rank."""
        if reduced.norm_sq is None:
            return self.exchange.norm(reduced.grads)  # ZeRO-1: summed from the shards in rank order
        return float(np.sqrt(reduced.norm_sq))

    def after_update(self) -> None:
        self.exchange.gather()  # Sync point (ZeRO-1, Adasum's deltas): the replicas' parameters agree again
        self.body.after_update()  # tied copies within the rank; the engines' gradient sums start again
        if self.stage is not None:
            self.stage.after_update()

    # -- eval, checks, checkpoints --------------------------------------------------------------------------------

    def eval_sums(self, eval_batches) -> np.ndarray:
        """``[weighted loss sum, rows]`` per eval batch (``num_batches x 2``): this rank's batches, counted once per
        replica, zeros elsewhere."""
        if self.stage is not None:
            return self.stage.eval_sums(eval_batches)
        sums = np.zeros((eval_batches.num_batches, 2))
        for k, feeds, weight, rows in eval_batches.weighted_batches():
            sums[k] += (self.body.eval_loss(feeds) * weight, rows)
        self.body.train_mode()
        return sums if self.body.counts_loss else np.zeros_like(sums)

    def sum_scalars(self, values: np.ndarray, label: str) -> np.ndarray:
        """Summed over every rank; in rank order where tensor-parallel ranks must get the same bits."""
        if self.body.rank_order:
            return self.comm.allgather_sum(values, label)
        return self.comm.allreduce_sum(values, label)

    def replica_check(self, step: int) -> dict:
        """Ranks that must hold equal parameters do (replicas; a tensor-parallel group's replicated tensors); the
        digests a checkpoint's meta records (the whole model's, or each stage's)."""
        label = "stage parameter digest" if self.stage is not None else "parameter digest"
        checks, shown = self.body.replica_checks(self.data.comm, label)
        compare_digests(self, step, checks, shown)
        if self.dims.tp > 1:
            return {}
        digest = checks[0][0]
        if self.stage is None:
            return {"params_sha256": digest}
        digests = self.stage.pipe_comm.gather_object(digest, "gather stage digests") if self.data.replica == 0 \
            else None
        return {"params_sha256": digests}

    def layout_meta(self) -> dict:
        """The parallel sizes a checkpoint records beyond ``num_ranks``."""
        if not self.dims.split:
            return {}
        meta = {"pipeline_parallel_size": self.dims.pp}
        return {"horizontal_parallel_size": self.dims.tp, **meta} if self.dims.tp > 1 else meta

    def whole_parameters(self, names) -> dict[str, np.ndarray] | None:
        """On rank 0, the whole model's parameters whose names pass ``names``: slices merged over the tensor-parallel
        ranks, then the stages gathered (replica 0 takes part; collective over those ranks)."""
        if self.data.replica != 0:
            return None
        part = self.body.whole(names)
        if part is None or self.stage is None:
            return part
        parts = self.stage.pipe_comm.gather_object(part, "gather parameters for histograms")
        return {n: v for p in parts for n, v in p.items()} if parts is not None else None

    def train_state(self) -> h5state.TrainState:
        """This rank's files of a checkpoint: parameters from each part's first replica, optimizer state as the
        exchange keeps it (one file per part, or per replica under ZeRO-1 and Adasum's deltas)."""
        ex = self.exchange
        return h5state.TrainState(
            parameters=self.body.parameters, trainable=self.trainable, update=self.update,
            optimizer=self.cfg.optimizer.label, rank=self.data.replica, world_size=self.data.num_replicas,
            sharded=ex.sharded, replica=ex.per_rank_state and not ex.sharded, extra_state=self.extra_state,
            stage=(self.stage.stage, self.stage.num_stages) if self.stage is not None else None,
            tp=self.body.tp_state(),
        )

    def finish(self) -> None:
        """A pipeline stage logs its timing and the activations it kept; every rank its peak resident memory."""
        if self.stage is not None:
            self.stage.finish()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        log.info("rank %d peak resident memory %.1f MiB", self.comm.rank, peak)


def _lap(timer: PhaseTimer | None, phase: str) -> None:
    if timer is not None:
        timer.lap(phase)
