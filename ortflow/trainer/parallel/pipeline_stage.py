"""The pipeline part of a layout: where a rank's body sits in its replica's pipeline, and the schedule it runs.

A :class:`PipelineStage` is applied to a body (:class:`~.whole_model.WholeModel`, a stage's graph, or
:class:`~.tensor_parallel_body.TensorParallel`, a stage's tensor-parallel pieces): the micro-batches go through the
stages with :mod:`.schedule`'s 1F1B, stage ``s`` exchanging activations and gradients with stages ``s +- 1`` of its
replica (at the same tensor-parallel rank: what crosses a cut is replicated). Layout: :mod:`.parallel_dims`; a
replica's stages are neighbouring ranks. The messages (:attr:`PipelineStage.messages`) are host arrays over the
pipeline's process group (``pipe_comm``, MPI: on one host through shared memory), or, on a CUDA stage of a whole
stage's graph with NCCL, device tensors over NCCL point-to-point (:class:`~ortflow.trainer.comm.device_pipe.DevicePipe`,
made by :func:`~.build.pipeline_messages`): the engine's outputs go from one GPU to the next without a host copy. A
pipeline x tensor-parallel stage's messages and the tied-gradient sums stay host arrays over ``pipe_comm``.

A trainable parameter read on both sides of a cut (a tied embedding and LM head) is held by every stage that reads
it; the holders add their gradients in stage order (:func:`~.schedule.sum_across_stages`), so their copies get
bitwise the same update, and the norm counts it on its first holder only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnxruntime

from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.engine_buffers import DeviceBuffers, HostBuffers
from ortflow.trainer.parallel.schedule import log_stage_timing, pipeline_step, stage_eval_sums, sum_across_stages
from ortflow.trainer.startup import session_options
from ortflow.trainer.timing import PhaseTimer

log = logging.getLogger("ortflow.trainer")


def stage_session_options(threads: int, buffers: HostBuffers | DeviceBuffers,
                          deterministic: bool = True) -> onnxruntime.SessionOptions:
    """The trainer's session options; on the CPU, one arena for a stage's (or a piece's) two sessions
    (:func:`ortflow.trainer.arena.use_stage_arena`)."""
    return buffers.stage_options(session_options(threads, deterministic))


@dataclass
class PipelineStage:
    """Stage ``stage`` of ``num_stages`` over a body; it speaks the schedule's stage protocol (``stage``,
    ``num_stages``, ``last``, ``pipe_comm``, ``receives``, ``sends``, ``forward``, ``backward``, ``eval_loss``)."""

    body: object
    comm: Communicator  # every rank (the log lines name the world rank)
    stage: int
    num_stages: int
    pipe_comm: Communicator
    receives: tuple[str, ...]
    sends: tuple[str, ...]
    shared: dict[str, list[int]] = field(default_factory=dict)  # tied parameters it holds -> every holding stage
    #: Table -> the padding row whose lookup gradient its training model masks (its forward-once calls mask it too).
    padding_rows: dict[str, int] = field(default_factory=dict)
    #: Whether its training model's leading-axis sums are MatMuls (its forward-once calls' gradient graph's too).
    sums_as_matmul: bool = False
    #: The activations and gradients over NCCL, device to device (a DevicePipe); None: host arrays over ``pipe_comm``.
    device_pipe: object | None = None
    _timing: list[tuple[float, float]] = field(default_factory=list)  # (update s, engine s) of each update
    _update_started: float | None = None
    _compute_s: float = 0.0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def messages(self):
        """Where the schedule sends and receives the activations and their gradients."""
        return self.device_pipe if self.device_pipe is not None else self.pipe_comm

    @property
    def counts_loss(self) -> bool:
        """Of a last stage's tensor-parallel ranks (same loss), one counts."""
        return self.body.counts_loss

    def train_mode(self) -> None:
        """Back to training calls after eval."""
        self.body.train_mode()

    # -- the stage protocol of the schedule ------------------------------------------------------------------------

    def forward(self, feeds: dict[str, np.ndarray], train: bool = True) -> list[np.ndarray]:
        """A middle stage's forward pass: what it sends (``train``: of a training micro-batch)."""
        return self.body.stage_forward(feeds, self.sends, train)

    def backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None) -> tuple[float, list]:
        """The backward pass (the last stage: from its loss; others: driven by ``grads``); parameter gradients
        accumulate in the engine. Returns (loss, gradients of what it received)."""
        return self.body.stage_backward(feeds, grads, self.sends, self.receives)

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The last stage's loss on an eval batch."""
        return self.body.eval_loss(feeds)

    # -- what the layout asks of it --------------------------------------------------------------------------------

    def accumulate(self, batches, k: int, timer: PhaseTimer | None = None) -> float:
        """``k`` micro-batches through the stages (1F1B); their loss sum on the last stage, 0 elsewhere. The
        ``forward_backward`` phase includes waiting on the neighbouring stages."""
        started = time.perf_counter()
        stats = pipeline_step(self, batches, k, timer=timer)
        if timer is not None:
            timer.lap("forward_backward")
        self._update_started, self._compute_s = started, stats.compute_s
        return stats.loss_sum

    def sum_tied_gradients(self, grad_of: Callable) -> None:
        """Holders of a tied weight add their gradients (``grad_of(name)``: its buffer here), in stage order."""
        if self.shared:  # Sync point: point-to-point over the pipeline group
            sum_across_stages(self.pipe_comm, self.stage, self.shared, grad_of)

    def counts_in_norm(self, name: str) -> bool:
        """A parameter tied across stages counts on its first holder only."""
        return self.shared.get(name, [self.stage])[0] == self.stage

    def eval_sums(self, eval_batches) -> np.ndarray:
        """Each replica's eval batches forward through its stages; the last stage counts the loss."""
        return stage_eval_sums(self, eval_batches)

    def after_update(self) -> None:
        if self._update_started is not None:
            self._timing.append((time.perf_counter() - self._update_started, self._compute_s))

    def finish(self) -> None:
        """Log this rank's median update time, the idle share of it, its messages over NCCL (a device pipe's) and the
        activations it kept."""
        log_stage_timing(self, self._timing)
        pipe = self.device_pipe
        if pipe is not None:
            log.info("rank %d stage %d pipeline messages over NCCL, device to device: %d sent (%.1f MiB), %d received "
                     "(%.1f MiB)", self.comm.rank, self.stage, pipe.sent, pipe.sent_bytes / 2**20, pipe.received,
                     pipe.received_bytes / 2**20)
        most = self.body.most_kept()
        if most is not None:
            log.info("rank %d stage %d kept the activations of at most %d micro-batch%s at once", self.comm.rank,
                     self.stage, most, "" if most == 1 else "es")
