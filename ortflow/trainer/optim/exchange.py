"""The exchange seam: how a rank's gradients reach the update and its updated parameters reach every replica.

Every rank model holds one :class:`Exchange` and calls it in the same order each update: ``mine = reduce(grads,
divisor, scalars)`` (the averaged gradients of what this rank updates), ``norm(mine)`` and ``scale(mine, factor)``
for the guard and clipping, ``update.step(mine, lr)``, then ``gather()``. The implementations:

=============================================  =========  ==============  ==========================================
exchange                                       sharded    per_rank_state  where
=============================================  =========  ==============  ==========================================
:class:`~.zero.Zero0` (all-reduce)             no         no              host or device buffers
:class:`~.zero.Zero1` (ZeRO-1)                 yes        yes             host buffers
:class:`~.device.Zero1Device` (ZeRO-1)         yes        yes             CUDA buffers (NCCL)
:class:`~.adasum_update.AdasumExchange`        no         ``deltas`` mode host buffers
:class:`~.device.AdasumDevice`                 no         ``deltas`` mode CUDA buffers (NCCL)
=============================================  =========  ==============  ==========================================

What differs between them that a caller must know is declared as capabilities, read as plain attributes (never
probed with ``hasattr``): :attr:`Exchange.sharded`, :attr:`Exchange.per_rank_state` and :attr:`Exchange.averages`.
Every layout builds its exchange the same way (:func:`~.rank_update.data_parallel_update`) over the replicas of
its part of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Exchange(Protocol):
    """The data-parallel exchange around the update (the replicas of one rank model's part)."""

    #: Each rank updates and keeps the optimizer state of its own range of the parameters only (ZeRO-1); the update
    #: reads ``mine``, a share of the gradients, and ``gather`` brings every range back to every rank.
    sharded: bool
    #: Every rank writes its own optimizer file into a checkpoint: ZeRO-1's shards, or Adasum's ``deltas`` mode, where
    #: each rank's moments are its own.
    per_rank_state: bool
    #: The result is the plain mean of the replicas' gradients (ZeRO-0): a sum taken after it equals the sum taken
    #: before it up to rounding, so a layout may add gradients across ranks (a tied weight's holders) after it.
    averages: bool

    def reduce(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> Sequence:
        """The gradients this rank updates, summed over the replicas and divided by ``divisor``; ``scalars`` (loss,
        stop flag) become their sum over the replicas in the same exchange."""

    def norm(self, mine: Sequence) -> float:
        """The global L2 norm of the reduced gradients, the same on every replica."""

    def scale(self, mine: Sequence, factor: float) -> None:
        """The reduced gradients times ``factor`` (clipping)."""

    def gather(self) -> None:
        """After the update: every rank's updated parameters into every replica's engine buffers (ZeRO-1, Adasum's
        ``deltas``); nothing where every replica updated everything alike."""

    def sum_across_ranks(self, values: np.ndarray) -> np.ndarray:
        """Per-tensor sums an update rule needs (Lamb's norms) over the ranks that share a tensor's elements."""

    def names(self, trainable: Sequence[str]) -> list[str]:
        """The parameter each array of ``mine`` belongs to (``trainable``: the names of the gradients reduced)."""

