"""The data-parallel replica: the whole model on every rank, gradients averaged over the world (ZeRO-0, ZeRO-1 or
Adasum), fp16 loss scaling, the GPU update. The simplest :class:`~ortflow.trainer.rank_model.RankModel`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow import checkpoints
from ortflow.checkpoints import h5state
from ortflow.config import RunConfig
from ortflow.engine import api
from ortflow.trainer import loss_scale, optim
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers, engine_buffers
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.rank_update import replica_update
from ortflow.trainer.parallel.parallel_dims import ParallelDims
from ortflow.trainer.rank_model import EnginePart, Reduced, compare_digests, sha256_of
from ortflow.trainer.startup import (
    available_cores,
    choose_start,
    load_parameters,
    optimizer_label,
    session_options,
    spin_wait,
    threads_per_rank,
)
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


@dataclass
class Runtime:
    """A data-parallel replica (the whole model on this rank); also the fields every rank model shares."""

    cfg: RunConfig
    run_dir: Path
    comm: Communicator
    device: str
    threads: int
    state: object
    module: object
    update: optim.Update
    exchange: Exchange  # Zero0, Zero1, AdasumExchange (host) or Zero1Device, AdasumDevice (CUDA)
    trainable: list[str]
    resume: checkpoints.CheckpointInfo | None
    loss_scale: loss_scale.LossScaler = field(default_factory=loss_scale.LossScaler)
    #: Small named arrays/scalars saved with every checkpoint (e.g. a loss scaler's state); read them back on resume
    #: with ``h5state.read_extra_state(rt.resume.path)``.
    extra_state: Callable[[], dict] | None = None
    dims: ParallelDims = ParallelDims(1, 1, 1)
    #: Where the engine keeps the parameters and gradients: host views (CPU) or device buffers (CUDA).
    buffers: HostBuffers | DeviceBuffers = field(default_factory=HostBuffers)
    _grads: list | None = None
    _parts: list[EnginePart] | None = None

    def train_state(self) -> h5state.TrainState:
        """What this rank writes into a checkpoint (parameters on rank 0, optimizer state as sharded)."""
        return h5state.TrainState(
            parameters=lambda: {n: np.array(p.data) for n, p in self.state.parameters},
            trainable=self.trainable, update=self.update, optimizer=optimizer_label(self.cfg),
            rank=self.comm.rank, world_size=self.comm.size, sharded=self.exchange.sharded,
            extra_state=self.extra_state,
            replica=self.exchange.per_rank_state and not self.exchange.sharded,
        )

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of the training data this rank reads."""
        return self.comm.rank, self.comm.size

    def engine_parts(self) -> list[EnginePart]:
        """The one module of the whole model."""
        if self._parts is None:
            self._parts = [EnginePart(self.state, self.module, Path(self.cfg.artifacts_dir))]
        return self._parts

    def gradient_buffers(self) -> list:
        """The engine's gradient buffers in ``trainable`` order (:mod:`ortflow.trainer.comm.engine_buffers`)."""
        if self._grads is None:  # the first call's buffers: a profiling module (trainer.profiling) swaps the state's
            grads = self.buffers.gradients(self.state)
            self._grads = [grads[n] for n in self.trainable]
        return self._grads

    def accumulate(self, batches, k: int, timer: PhaseTimer | None = None) -> float:
        """``k`` micro-batches through the engine, which sums their gradients; their loss sum (loss scale included)."""
        engine, names = self.engine_parts()[0].training_module(), self.module.input_names()
        loss_sum = 0.0
        for _ in range(k):
            feeds = self.loss_scale.feed(next(batches))  # fp16: the graph multiplies the loss by the scale input
            _lap(timer, "data")
            loss_sum += float(engine(*(feeds[n] for n in names)))
            _lap(timer, "forward_backward")
        return loss_sum

    def reduce(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """The mean gradient over ``k`` micro-batches x ranks with the loss and the stop flag in the same exchange
        (ZeRO-1: this rank's share); the loss scale is divided out here too."""
        scaler, world = self.loss_scale, self.comm.size
        scalars = np.array([loss_sum / k / scaler.scale, float(stop)], dtype=np.float32)
        mine = self.exchange.reduce(self.gradient_buffers(), k * world * scaler.scale, scalars)
        return Reduced(mine, float(scalars[0]) / world, bool(scalars[1]))

    def grad_norm(self, reduced: Reduced) -> float:
        """One pass over the gradients; the same on every rank (ZeRO-1: summed from the shards in rank order)."""
        return self.exchange.norm(reduced.grads)

    def after_update(self) -> None:
        self.exchange.gather()  # Sync point (ZeRO-1): every rank's updated shard back into every rank's parameters
        self.module.lazy_reset_grad()

    def eval_sums(self, eval_batches) -> np.ndarray:
        """``[weighted loss sum, rows]`` over this rank's share of the eval split (the eval model takes no loss scale:
        configure fixed it to 1)."""
        self.module.eval()
        names = self.module.input_names()
        sums = np.zeros(2)
        for feeds, weight, rows in eval_batches():
            sums += (float(self.module(*(feeds[n] for n in names))) * weight, rows)
        self.module.train()
        return sums

    def sum_scalars(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.comm.allreduce_sum(values, label)

    def replica_check(self, step: int) -> dict:
        """Every rank holds rank 0's parameters bitwise; their sha256 goes into the checkpoint meta."""
        digest = sha256_of(self.state.parameters[n].data for n in self.trainable)
        compare_digests(self, step, [(digest, self.comm, "parameter digest")], digest)
        return {"params_sha256": digest}

    def layout_meta(self) -> dict:
        return {}

    def whole_parameters(self, names) -> dict[str, np.ndarray] | None:
        if self.comm.rank != 0:
            return None
        return {n: self.state.parameters[n].data for n in self.trainable if names(n)}

    def finish(self) -> None:
        """Nothing measured beyond the loop's step-time breakdown."""


def _lap(timer: PhaseTimer | None, phase: str) -> None:
    if timer is not None:
        timer.lap(phase)


def init_replica(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str, dims: ParallelDims) -> Runtime:
    """Steps 4-6 for a data-parallel replica: session configuration, session, state."""
    # 4. Session configuration and the state to start from. Rank 0 verifies (checksums) and every rank loads the same.
    threads = threads_per_rank(cfg, comm.local_size, available_cores())
    resume, warm = choose_start(cfg, comm, 1)
    state_file = cfg.artifacts_dir / "checkpoint"
    state = api.CheckpointState.load_checkpoint(str(state_file))
    # 5. Session. On the CPU, from an arena whose first chunk holds every gradient: the engine then allocates them
    # back to back, and the exchange reduces them as one buffer (trainer/arena.py).
    buffers = engine_buffers(device, comm)
    spin = spin_wait(cfg, comm.local_size, threads, available_cores())
    options = buffers.replica_options(session_options(threads, cfg.distributed.deterministic_compute, spin), state)
    module = api.Module(
        str(cfg.artifacts_dir / "training_model.onnx"),
        state,
        str(cfg.artifacts_dir / "eval_model.onnx"),
        device=device,
        session_options=options,
    )
    # 6. The checkpoint's values into the session's buffers, by name; then the update and its state.
    trainable = sorted(name for name, param in state.parameters if param.requires_grad)
    if not trainable:
        raise RuntimeError(f"{state_file} holds no trainable parameters: re-run `ortflow configure`")
    if resume or warm:  # a warm start takes the earlier version's weights only (its optimizer state starts fresh)
        load_parameters(state, resume.path if resume else Path(warm), buffers)
    update, exchange = replica_update(cfg, comm, state, trainable, threads, buffers)
    if resume:
        h5state.load_optimizer(resume.path, update, optimizer_label(cfg), rank=comm.rank)
    where = f"step {resume.step} ({resume.path.name})" if resume else f"the weights of {warm}" if warm else \
        "the initial weights"
    log.info(
        "rank %d/%d (local %d/%d) on %s with %d thread(s), starting from %s",
        comm.rank, comm.size, comm.local_rank, comm.local_size, device, threads, where,
    )
    scaler = loss_scale.from_config(cfg.precision, loss_scale.saved_state(resume.meta) if resume else None)
    if scaler.enabled:
        log.info("rank %d loss scale %g (%s; %d clean updates, %d skipped so far)", comm.rank, scaler.scale,
                 "dynamic" if scaler.dynamic else "static", scaler.clean_updates, scaler.skipped_updates)
    return Runtime(cfg, run_dir, comm, device, threads, state, module, update, exchange, trainable, resume, scaler,
                   dims=dims, buffers=buffers)


