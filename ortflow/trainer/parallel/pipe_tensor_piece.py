"""A rank of pipeline x tensor (x data) parallelism: one tensor-parallel slice of one pipeline stage.

The stage's pieces, their activation sums over the stage's tensor-parallel group, the gradient average over the replicas
and the update are the tensor-parallel rank's (:class:`~ortflow.trainer.parallel.tensor_piece.TensorRuntime`); the
micro-batches go through the stages with the pipeline's 1F1B schedule
(:func:`~ortflow.trainer.parallel.schedule.pipeline_step`), stage ``s`` tensor-parallel rank ``t`` exchanging with stage
``s +- 1`` rank ``t`` (what crosses a cut is replicated, so every tensor-parallel rank of a stage sends and receives the
same tensors). Layout: :mod:`ortflow.trainer.parallel.parallel_dims`.

Between a micro-batch's forward and backward a middle stage keeps the tensors its pieces passed each other (the
backward's training calls read them; running the stage's forward again would be a third forward per micro-batch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortflow.artifacts_folder import read_pipe_tensor_record, stage_base
from ortflow.config import RunConfig
from ortflow.trainer.comm import Communicator
from ortflow.trainer.parallel.parallel_dims import ParallelDims, make_groups
from ortflow.trainer.parallel.schedule import ACT_TAG, GRAD_TAG, pipeline_step, stage_eval_sums, sum_across_stages
from ortflow.trainer.parallel.tensor_piece import TensorRuntime, assemble_tensor_runtime

log = logging.getLogger("ortflow.trainer")


@dataclass
class PipeTensorRuntime(TensorRuntime):
    """A tensor-parallel rank whose pieces are one pipeline stage's; it also speaks the pipeline's stage protocol
    (``stage``, ``num_stages``, ``last``, ``pipe_comm``, ``receives``, ``sends``, ``forward``, ``backward``)."""

    stage: int = 0
    num_stages: int = 1
    pipe_comm: Communicator | None = None
    receives: tuple[str, ...] = ()
    sends: tuple[str, ...] = field(default_factory=tuple)
    shared: dict[str, list[int]] = field(default_factory=dict)  # tied parameters it holds -> every holding stage

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def view(self) -> _StageView:
        return _StageView(self)

    def accumulate(self, batches, k: int, timer=None) -> float:
        """``k`` micro-batches through the stages (1F1B); the loss sum on the last stage, 0 elsewhere."""
        loss_sum = pipeline_step(self.view(), batches, k, timer=timer).loss_sum
        if timer is not None:
            timer.lap("forward_backward")
        return loss_sum

    def sum_tied_gradients(self) -> None:
        """Within the stage (pieces that read one parameter), then across the stages that hold a tied parameter (an
        embedding and its LM head, sliced alike): each holder ends with the sum, added in stage order."""
        super().sum_tied_gradients()
        if self.shared:
            # Sync point: holders of a tied weight add their slices' gradients (point-to-point, pipeline group).
            owners = dict(zip(self.trainable, self.gradient_buffers(), strict=True))  # the owner pieces' buffers
            sum_across_stages(self.pipe_comm, self.stage, self.shared, owners.__getitem__)

    def counts_in_norm(self, name: str) -> bool:
        """As a tensor-parallel rank counts, a parameter tied across stages on its first holder only."""
        return super().counts_in_norm(name) and self.shared.get(name, [self.stage])[0] == self.stage

    def eval_sums(self, eval_batches) -> np.ndarray:
        """Each replica's eval batches forward through its stages (the last stage's tp rank 0 counts)."""
        return stage_eval_sums(self.view(), eval_batches)


class _StageView:
    """The pipeline's stage protocol over a :class:`PipeTensorRuntime` (its ``forward`` runs every piece)."""

    def __init__(self, rt: PipeTensorRuntime):
        self.rt = rt
        self.comm, self.pipe_comm, self.module = rt.comm, rt.pipe_comm, rt.pieces[-1].module
        self.stage, self.num_stages, self.last = rt.stage, rt.num_stages, rt.last
        self.receives, self.sends = rt.receives, rt.sends
        self.counts_loss = rt.tp_rank == 0  # every tp rank of the last stage computes the same loss

    def forward(self, feeds: dict[str, np.ndarray], train: bool = True) -> list[np.ndarray]:
        """A middle stage's forward: every piece (eval models, partial sums summed); ``feeds`` keeps what the pieces
        passed each other (on CUDA ranks on the GPU), for the backward. ``train`` changes nothing: tensor-parallel
        pieces hold no BatchNorm (validate and the ranks refuse it), but a training micro-batch's pieces keep their
        activations where they keep them."""
        feeds.update(self.rt.forward(feeds, len(self.rt.pieces), train=train))
        return [self.rt.tensors.host(feeds[n]) for n in self.sends]  # the pipeline sends host arrays

    def backward(self, feeds: dict[str, np.ndarray], grads: list[np.ndarray] | None) -> tuple[float, list]:
        """The pieces' backward (the last stage first runs its forward); returns (loss, gradients of what the stage
        received, summed over the tensor-parallel ranks)."""
        if grads is None:
            env, arriving = self.rt.forward(feeds, len(self.rt.pieces) - 1, train=True), None
        else:
            env, arriving = feeds, dict(zip(self.sends, grads, strict=True))
        loss, back = self.rt.backward(env, arriving)
        tensors = self.rt.tensors
        return loss, [tensors.host(back[n] if n in back else tensors.zeros_like(env[n])) for n in self.receives]

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        return self.rt.eval_loss(feeds)


def init_pipe_tensor_runtime(run_dir: Path, cfg: RunConfig, comm: Communicator, device: str,
                             dims: ParallelDims) -> PipeTensorRuntime:
    """Place this rank (stage, tensor-parallel rank, replica), join its three groups, load its stage's pieces."""
    num_stages, size = dims.pp, dims.tp
    record = read_pipe_tensor_record(cfg.artifacts_dir)
    if record is None or record["size"] != size or record["num_stages"] != num_stages:
        raise RuntimeError(f"{cfg.artifacts_dir} holds no pipeline x tensor-parallel artifacts of {num_stages} stages "
                           f"x {size} ranks: re-run `ortflow configure` with these sizes")
    where, groups = make_groups(comm, dims)  # Sync points (collective over the world): the three sub-groups
    groups.pp.open_point_to_point((ACT_TAG, GRAD_TAG))  # NCCL: its p2p communicators, before any transfer
    info = record["stages"][where.stage]
    return assemble_tensor_runtime(
        PipeTensorRuntime, run_dir, cfg, comm, device, info, stage_base(cfg.artifacts_dir, where.stage),
        dict(tp_rank=where.tp_rank, replica=where.replica, tp_comm=groups.tp, dp_comm=groups.dp, stage=where.stage,
             num_stages=num_stages, pipe_comm=groups.pp, dims=dims, receives=tuple(info["receives"]),
             sends=tuple(info["sends"]), shared=info.get("shared", {})),
        pipe=(where.stage, num_stages))
