"""The part of a rank that is one engine module: the whole model of a data-parallel replica, or a pipeline stage's
graph. One of the two bodies a :class:`~ortflow.trainer.parallel.layout_model.LayoutModel` is built from (the other:
:class:`~ortflow.trainer.parallel.tensor_parallel_body.TensorParallel`, a rank's tensor-parallel pieces).

A body runs micro-batches and holds parameters and gradients; it knows nothing of replicas (the exchange is the
layout's :class:`~ortflow.trainer.parallel.layout_model.DataParallel` part) nor of the schedule (a pipeline stage's
:class:`~ortflow.trainer.parallel.pipeline_stage.PipelineStage` part calls :meth:`WholeModel.stage_forward` and
:meth:`WholeModel.stage_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.artifacts_folder import BATCH_STATISTICS_INPUT, GRAD_IN_SUFFIX
from ortflow.trainer.captured_call import CapturedTraining
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.parallel.activations import DeviceTensors
from ortflow.trainer.parallel.kept_activations import KeptActivations
from ortflow.trainer.rank_model import EnginePart, sha256_of


@dataclass
class WholeModel:
    """One engine ``Module`` over its artifacts ``folder`` (the whole model's, or a stage's)."""

    state: object
    module: object
    folder: Path
    trainable: list[str]
    buffers: HostBuffers | DeviceBuffers
    #: A stage's forward-once calls (activations kept until the backward), else None (the training call recomputes).
    kept: KeptActivations | None = None
    #: Every rank of the body computes the loss it reports (a tensor-parallel body: only its tp rank 0 counts it).
    counts_loss = True
    #: Sums over ranks need not be added in rank order (a tensor-parallel body's replicated tensors need it).
    rank_order = False
    _grads: list | None = None
    _parts: list[EnginePart] | None = None
    _batch_statistics: bool | None = None  # its eval model takes BATCH_STATISTICS_INPUT (a BatchNorm before a cut)
    #: Its training calls as CUDA graph replays (trainer/captured_call.py), else None.
    captured: CapturedTraining | None = None
    #: A CUDA stage whose messages go over NCCL (:func:`~.build.pipeline_messages`): its stage calls take and return
    #: the engine's device tensors (:class:`~.activations.DeviceTensors`); None: host arrays.
    tensors: DeviceTensors | None = None
    _reset: bool = True  # the next training call starts the update's gradients (else it adds to them)

    def engine_parts(self) -> list[EnginePart]:
        """The one module."""
        if self._parts is None:
            self._parts = [EnginePart(self.state, self.module, self.folder, kept=self.kept)]
        return self._parts

    def gradient_buffers(self) -> list:
        """The engine's gradient buffers in ``trainable`` order (:mod:`ortflow.trainer.comm.engine_buffers`)."""
        if self._grads is None:  # the first call's buffers: a profiling module (trainer.profiling) swaps the state's
            grads = self.buffers.gradients(self.state)
            self._grads = [grads[n] for n in self.trainable]
        return self._grads

    def parameter_buffers(self) -> list:
        """The engine's parameter buffers in ``trainable`` order (what the update writes)."""
        return self.buffers.parameters(self.state, self.trainable)

    # -- the engine calls ------------------------------------------------------------------------------------------

    def micro_step(self, feeds: dict[str, np.ndarray]) -> float:
        """One training call (forward and backward; the engine adds the gradients up): its loss."""
        part, reset, self._reset = self.engine_parts()[0], self._reset, False
        captured = self.captured if part.profiling is None else None  # the profiler traces the engine's own call
        if captured is not None and captured.takes(feeds):
            return captured(feeds, reset)
        if captured is not None and not reset:
            raise RuntimeError(
                "distributed.cuda_graphs replays the training call for one batch shape, and this update's micro-"
                f"batches differ ({ {n: np.shape(v) for n, v in feeds.items()} }): set distributed.cuda_graphs false")
        engine = part.training_module()
        return float(engine(*(feeds[n] for n in self.module.input_names())))

    def stage_forward(self, feeds: dict[str, np.ndarray], sends: tuple[str, ...], train: bool) -> list[np.ndarray]:
        """A middle stage's forward pass: what it sends (host arrays, or device tensors with :attr:`tensors`). Of a
        training micro-batch (``train``), its activations kept where it keeps them, and BatchNorm normalises by the
        batch as the training call's recomputation will (graph/pipeline_parallel/batchnorm_forward.py); else the eval
        model, by the running statistics."""
        if train and self.kept is not None:
            return self.kept.forward(feeds)
        if self._batch_statistics is None:
            self._batch_statistics = BATCH_STATISTICS_INPUT in self.engine_parts()[0].prepared(False).input_names()
        if self._batch_statistics:
            feeds = {**feeds, BATCH_STATISTICS_INPUT: np.array(train)}
        return self._call(False, feeds)[: len(sends)]

    def _call(self, train: bool, feeds: dict) -> list:
        """One engine call of the module: on host arrays, or with :attr:`tensors` on device tensors (its outputs
        written on the GPU; the received ones are device tensors already)."""
        if self.tensors is not None:
            return self.tensors.call(self.engine_parts()[0], train, feeds)
        return self.engine_parts()[0].call(train, feeds)

    def stage_backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None, sends: tuple[str, ...],
                       receives: tuple[str, ...]) -> tuple[float, list]:
        """The backward pass (the last stage: from its loss; others: driven by ``grads`` of what it sent), the
        forward recomputed unless it was kept. Returns (loss, gradients of what it received)."""
        if grads is not None and self.kept is not None and self.kept.in_flight():
            return 0.0, self.kept.backward(grads)
        if grads is not None:
            feeds = {**feeds, **{n + GRAD_IN_SUFFIX: g for n, g in zip(sends, grads, strict=True)}}
        outputs = self._call(True, feeds)
        return self._scalar(outputs[0]), outputs[1 : 1 + len(receives)]

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The loss of an eval batch (eval model; configure fixed a loss scale input to 1)."""
        return self._scalar(self._call(False, feeds)[0])

    def _scalar(self, x) -> float:
        return self.tensors.scalar(x) if self.tensors is not None else float(x)

    def train_mode(self) -> None:
        """Back to training calls after eval."""
        self.module.train()

    # -- around the exchange and the update ------------------------------------------------------------------------

    def sum_tied_gradients(self) -> None:
        """Nothing: the engine adds a tied weight's uses inside its one graph."""

    def after_update(self) -> None:
        """The engine's gradient sums (and kept activations) start again."""
        self.module.lazy_reset_grad()
        self._reset = True
        if self.kept is not None:
            self.kept.reset()

    def counts_in_norm(self, name: str) -> bool:
        """Every gradient of the one module counts once in the norm."""
        return True

    # -- checkpoints and checks ------------------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter (trainable and frozen), host copies."""
        return {n: np.array(p.data) for n, p in self.state.parameters}

    def replica_checks(self, dp: Communicator, label: str) -> tuple[list, str]:
        """``[(digest, group, label)]`` the replicas must agree on, and the digest the log shows."""
        digest = sha256_of(self.state.parameters[n].data for n in self.trainable)
        return [(digest, dp, label)], digest

    def whole(self, names) -> dict[str, np.ndarray] | None:
        """Its trained parameters whose names pass ``names``."""
        return {n: self.state.parameters[n].data for n in self.trainable if names(n)}

    def tp_state(self) -> None:
        """No tensor-parallel slices in its checkpoint files."""

    def most_kept(self) -> int | None:
        """The most micro-batches whose activations it kept at once (None: it recomputes)."""
        return self.kept.most_in_flight if self.kept is not None else None
