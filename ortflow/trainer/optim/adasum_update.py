"""Adasum around the update (``distributed.enable_adasum``), as Horovod applies it.

The exchange presents the loop with the same calls as :mod:`.zero` (``reduce``, ``norm``, ``scale``, ``update.step``,
``gather``); the combination itself is :func:`ortflow.trainer.comm.adasum.adasum_allreduce`, per tensor.

* ``gradients`` (SGD): each rank's mean gradient over its micro-batches is combined with Adasum in ``reduce``; every
  rank then holds the same combined gradient and takes the same step (momentum state stays replicated).
* ``deltas`` (AdamW, Lamb): an adaptive optimizer's step is not linear in the gradient, so Adasum combines the
  *updates*: each rank steps its own optimizer on its own mean gradient (its moments are its own and differ between
  ranks), then ``gather`` replaces every parameter by ``start + adasum(p - start)``. ``start`` is the same on every
  rank, and so is the combination, so the ranks stay bitwise identical. Memory: one fp32 copy of the parameters
  (``start``) plus the communicator's packed buffer and half-size receive buffer, and every rank's optimizer state is
  saved in its own file (``optimizer-rankNNNNN-of-NNNNN.h5``, marked ``replica``).

Clipping (``optimizer.max_grad_norm``) applies to what the update consumes: the combined gradient in ``gradients``
mode, each rank's own gradient in ``deltas`` mode (the logged ``grad_norm`` is then rank 0's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortflow.trainer.comm.communicator import gradient_norm, scale_gradients

_NO_SCALARS = np.zeros(0, dtype=np.float32)


def adasum_mode(optimizer_name: str) -> str:
    """``gradients`` for sgd, ``deltas`` for the adaptive rules (adamw, lamb)."""
    return "gradients" if optimizer_name == "sgd" else "deltas"


class AdasumExchange:
    """Data-parallel exchange that combines ranks with Adasum instead of the mean (an
    :class:`~ortflow.trainer.optim.exchange.Exchange`, whole tensors on every rank).

    Args:
        comm: The process group (``adasum_tensors``, ``allreduce_sum``); a power of two of ranks.
        params: 1-D host views of every trainable parameter in the engine's buffers (trainable order).
        mode: ``gradients`` or ``deltas`` (:func:`adasum_mode`).
        peers: What the tree runs over when it is not ``comm`` itself (:class:`SlicedPeers`: the replicas of a
            tensor-parallel rank, whose tensors' dot products also add the other slices').
    """

    sharded = False
    per_rank_state = False
    averages = False

    def __init__(self, comm, params: Sequence[np.ndarray], mode: str, peers=None):
        if mode not in ("gradients", "deltas"):
            raise ValueError(f"Adasum mode must be gradients or deltas, got {mode!r}")
        self.comm, self.params, self.mode, self.peers = comm, list(params), mode, peers
        #: Each rank's optimizer state is its own (deltas): every rank writes it into the checkpoint.
        self.per_rank_state = mode == "deltas"
        self._start = [np.empty_like(p) for p in self.params] if mode == "deltas" else []

    def reduce(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> list[np.ndarray]:
        local = divisor / self.comm.size  # the loop's divisor is micro-batches x ranks; a rank's own mean is local
        if self.mode == "gradients":
            # Sync point: the update's collective - Adasum of the ranks' mean gradients, plus loss and stop.
            self.comm.adasum_tensors(grads, local, scalars, self.peers)
            return [g.reshape(-1) for g in grads]
        scale_gradients(grads, 1.0 / local)
        # Sync point: loss and stop must agree on every rank before anyone steps.
        scalars[:] = self.comm.allreduce_sum(scalars, "loss and stop")
        for start, p in zip(self._start, self.params, strict=True):
            np.copyto(start, p)
        return [g.reshape(-1) for g in grads]

    def norm(self, mine: Sequence[np.ndarray]) -> float:
        return self.comm.gradient_norm(mine) if self.mode == "gradients" else gradient_norm(mine)

    def scale(self, mine: Sequence[np.ndarray], factor: float) -> None:
        scale_gradients(mine, factor)

    def gather(self) -> None:
        if self.mode == "gradients":
            return
        for start, p in zip(self._start, self.params, strict=True):
            p -= start  # this rank's update
        # Sync point: the ranks' updates combined per tensor; identical bytes on every rank.
        self.comm.adasum_tensors(self.params, 1.0, _NO_SCALARS, self.peers)
        for start, p in zip(self._start, self.params, strict=True):
            p += start

    def sum_across_ranks(self, values: np.ndarray) -> np.ndarray:
        return values  # every rank updates whole tensors

    def names(self, trainable: Sequence[str]) -> list[str]:
        return list(trainable)


class SlicedPeers:
    """Adasum's tree over the replicas of a tensor-parallel rank, for tensors some of which are slices.

    The combination's coefficients come from each tensor's dot product and squared norms. A sliced tensor's partial
    sums are added over the tensor-parallel group too (in rank order: every tensor-parallel rank gets the same bits),
    so the coefficients are the whole tensor's, as data parallelism alone computes them; a replicated tensor is
    bitwise the same on every tensor-parallel rank, so its own sums already are. A
    :class:`~ortflow.trainer.comm.adasum.PeerGroup`.

    Args:
        dp: The replicas' group (the pairs exchange over it).
        tp: The tensor-parallel group of this rank's stage.
        sliced: For each tensor in packed (trainable) order, whether this rank holds a slice of it.
    """

    def __init__(self, dp, tp, sliced: Sequence[bool]):
        self.dp, self.tp, self.rank, self.size = dp, tp, dp.rank, dp.size
        self.sliced = np.repeat(np.asarray(sliced, dtype=bool), 3)  # [dot, |a|^2, |b|^2] per tensor

    def sendrecv(self, send: np.ndarray, peer: int, recv: np.ndarray, label: str) -> None:
        self.dp.sendrecv(send, peer, recv, label)

    def group_allreduce_sum(self, values: np.ndarray, group_size: int, label: str) -> np.ndarray:
        summed = self.dp.group_allreduce_sum(values, group_size, label)
        # Sync point: the slices' partial dot products and norms, added over the tensor-parallel ranks.
        over_tp = self.tp.allgather_sum(np.where(self.sliced, summed, 0.0), f"{label} (slices)")
        return np.where(self.sliced, over_tp, summed)
