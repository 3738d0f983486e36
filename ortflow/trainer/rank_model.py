"""What the training loop asks of a rank's model, whatever part of the whole model the rank holds.

Every layout's rank model is one :class:`~.parallel.layout_model.LayoutModel`, composed of a body (the whole model or
a pipeline stage's graph, :mod:`.parallel.whole_model`; or tensor-parallel pieces,
:mod:`.parallel.tensor_parallel_body`), its replica part (the exchange over the data-parallel group and the update)
and, on a pipeline, a stage part (:mod:`.parallel.pipeline_stage`); :func:`ortflow.trainer.loop.train` is written once
against :class:`RankModel`. Its engine sessions are :class:`EnginePart` s (one, or one per piece), which is how the
per-op profiler reaches every layout.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ortflow.checkpoints import CheckpointInfo
from ortflow.checkpoints.h5state import TrainState
from ortflow.config import RunConfig
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.loss_scale import LossScaler
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.segments import Update
from ortflow.trainer.parallel.parallel_dims import ParallelDims
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")

class EvalBatches(Protocol):
    """This rank's share of the eval split (``EvalLoader``): its items and the whole evaluation's batch count."""

    num_batches: int

    def weighted_batches(self) -> Iterator[tuple[int, dict, float, int]]:
        """``(batch index, feeds, weight, rows)`` (``EvalLoader.weighted_batches``)."""


@dataclass
class EnginePart:
    """One engine ``Module`` of a rank (the whole model, a stage or a piece) and the folder of its artifacts.

    While ``profiling`` is set (:class:`~ortflow.trainer.profiling.StepProfiler`), training calls run there: a second
    module over the same state, created with the engine's profiler on.
    """

    state: object
    module: object
    folder: Path
    profiling: object | None = None
    #: The part's separate forward and backward calls, where it keeps its activations
    #: (:class:`~ortflow.trainer.parallel.kept_activations.KeptActivations`); the profiler then traces those.
    kept: object | None = None

    def training_module(self):
        """The module that runs this part's training calls now."""
        return self.module if self.profiling is None else self.profiling

    def prepared(self, train: bool):
        """The module for a training (forward + backward) or eval (forward) call, in that mode."""
        module = self.training_module() if train else self.module
        module.train() if train else module.eval()
        return module

    def call(self, train: bool, feeds: dict[str, np.ndarray]) -> list:
        """One engine call, training or eval; its outputs as a list."""
        module = self.prepared(train)
        outputs = module(*(feeds[n] for n in module.input_names()))
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@dataclass
class Reduced:
    """An update's gradients after the exchange, and what every rank agrees on with them.

    Attributes:
        grads: The gradient buffers the update reads (this rank's share under ZeRO-1).
        loss: The mean training loss over the micro-batches and replicas (loss scale divided out).
        stop: Whether any rank asked to stop.
        norm_sq: The squared global gradient norm when the exchange already summed it, else None.
    """

    grads: list
    loss: float
    stop: bool
    norm_sq: float | None = None


class RankModel(Protocol):
    """A rank's part of the model with its update and exchange (the fields the loop and the hooks read)."""

    cfg: RunConfig
    run_dir: Path
    comm: Communicator
    #: The replicas of this rank's part of the model: the group its exchange (and BatchNorm's statistics) runs over.
    replicas: Communicator
    dims: ParallelDims
    device: str
    #: Where the engine keeps the parameters and gradients (:mod:`ortflow.trainer.comm.engine_buffers`).
    buffers: HostBuffers | DeviceBuffers
    threads: int
    update: Update
    exchange: Exchange
    resume: CheckpointInfo | None
    loss_scale: LossScaler

    def data_shard(self) -> tuple[int, int]:
        """(shard index, number of shards) of the training data this rank reads (its replica's)."""

    def engine_parts(self) -> list[EnginePart]:
        """Its engine modules (the per-op profiler opens a profiling twin of each)."""

    def gradient_buffers(self) -> list:
        """The engine's gradient buffers the exchange reads, fixed for the modules' life."""

    def accumulate(self, batches: Iterator[dict], k: int, timer: PhaseTimer | None = None) -> float:
        """Forward and backward passes of ``k`` micro-batches (gradients accumulate in the engine); this rank's share
        of their loss sum (0 where another rank counts it)."""

    def reduce(self, k: int, loss_sum: float, stop: bool) -> Reduced:
        """The exchange: the mean gradient over micro-batches and replicas, the mean loss, the stop flag (and, for a
        split model, the norm from every rank's share)."""

    def grad_norm(self, reduced: Reduced) -> float:
        """The global gradient norm, equal on every rank (its own share of it counted once)."""

    def after_update(self) -> None:
        """After the optimizer step: gather shards, copy tied weights, reset the engine's gradients."""

    def eval_sums(self, eval_batches: EvalBatches) -> np.ndarray:
        """``[weighted loss sum, rows]`` per eval batch (``num_batches x 2``): this rank's batches, counted once per
        replica, zeros elsewhere."""

    def sum_scalars(self, values: np.ndarray, label: str) -> np.ndarray:
        """Float64 values (a few scalars, or a pair per eval batch) summed over every rank, bitwise the same on every
        rank."""

    def replica_check(self, step: int) -> dict:
        """Raise if ranks that must hold equal parameters do not; the checkpoint meta fields it vouches for."""

    def layout_meta(self) -> dict:
        """The parallel sizes a checkpoint records beyond ``num_ranks`` (empty for data parallelism alone)."""

    def train_state(self) -> TrainState:
        """What this rank writes into a checkpoint."""

    def whole_parameters(self, names: Callable[[str], bool]) -> dict[str, np.ndarray] | None:
        """On rank 0, the whole model's parameters whose names pass ``names`` (stages gathered, slices merged);
        None elsewhere. Collective on a split model."""

    def finish(self) -> None:
        """After the last update: log what the model measured on its own (a pipeline stage: its idle share)."""


def sha256_of(arrays) -> str:
    """The sha256 over ``arrays`` in order (no copy: the engine's views are contiguous)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array))
    return digest.hexdigest()


def compare_digests(model: RankModel, step: int, checks: list[tuple[str, Communicator, str]], shown: str) -> None:
    """The replica check: each ``(digest, group, label)`` must equal the digest of the group's first rank; ``shown``
    is what the log line gives as this rank's parameter digest.

    Raises:
        RuntimeError: on every rank alike, naming how many ranks differ (a silent divergence would poison
            checkpoints).
    """
    # Sync points: each group's first rank broadcasts its digest; the mismatch counts are summed over every rank.
    bad = np.array([float(group.broadcast(digest, label) != digest) for digest, group, label in checks])
    mismatches = model.comm.allreduce_sum(bad, "parameter digest check")
    log.info("rank %d parameters sha256 %s at step %d", model.comm.rank, shown, step)
    if mismatches.any():
        raise RuntimeError(f"ranks diverged at step {step}: {', '.join(str(int(m)) for m in mismatches)} rank(s) "
                           f"differ from their group's first rank ({', '.join(label for _, _, label in checks)})")
