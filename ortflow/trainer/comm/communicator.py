"""The communicator seam: what the training loop needs from the process group, and the group of one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ortflow.trainer.comm.pending import gradient_norm, scale_gradients

__all__ = ["CollectiveTimeout", "Communicator", "SingleProcessComm", "gradient_norm", "scale_gradients"]


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``distributed.collective_timeout_s``."""


class Communicator(Protocol):
    """What the training loop needs from the process group."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    #: Whether :meth:`average_gradients` can leave the mean's scale to the caller (the host exchanges can; NCCL
    #: scales on the device).
    can_defer_scale: bool
    #: The switch a folding exchange sets where :attr:`can_defer_scale` (comm/pending.py).
    defer_scale: bool
    #: The host exchange's bucket size in float32 values (distributed.exchange_bucket_mb); 0: one pack.
    bucket_values: int

    def average_gradients(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> np.float32:
        """In place: every gradient becomes (sum over ranks) / divisor; ``scalars`` becomes its sum over ranks.

        Returns the scale still owed: 1 when applied here; ``float32(1 / divisor)`` when the communicator's
        ``defer_scale`` is set and it left the sums in place (comm/pending.py: the caller's norm and update apply it).
        """

    def adasum_tensors(self, tensors: Sequence, divisor: float, scalars: np.ndarray, peers=None) -> None:
        """In place: every tensor is divided by ``divisor`` on its own rank, then replaced by the Adasum of all ranks'
        (per tensor, the same bytes on every rank); ``scalars`` becomes its sum over ranks. ``peers``: the
        :class:`~ortflow.trainer.comm.adasum.PeerGroup` the tree runs over, when not this group itself (host
        tensors only)."""

    def gradient_norm(self, grads: Sequence) -> float:
        """Global L2 norm of the averaged gradients (the same on every rank; the trainer clips with it), owed factors
        (comm/pending.py ``Gradients``) included."""

    def scale_gradients(self, grads: Sequence, factor: float) -> None:
        """Every gradient times ``factor`` (gradient clipping): in place, or owed by host ``Gradients``."""

    def sum_squares(self, grads: Sequence) -> float:
        """The squared L2 norm of some of this rank's gradients as they are now (no collective): a subset, or
        gradients changed after the exchange (a tied weight's sum)."""

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        """Sum of a small float64 array over ranks (a new array)."""

    def allgather_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        """Sum of a small float64 array over ranks, added in rank order: bitwise the same on every rank."""

    def reduce_scatter(self, flat: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        """ZeRO-1: ``out`` becomes the sum over ranks of this rank's range of ``flat`` (ranges of ``counts``)."""

    def all_gather(self, flat: np.ndarray, counts: Sequence[int], label: str = "zero-1 parameter all-gather") -> None:
        """In place, every rank's range of ``flat`` (ranges of ``counts``) from that rank (ZeRO-1's parameters, tensor
        parallelism's activation sums); ``label`` names it in a stall report."""

    def broadcast(self, obj: object, label: str) -> object:
        """Rank 0's ``obj`` on every rank."""

    def barrier(self, label: str) -> None:
        """Wait for every rank."""

    def abort(self, code: int) -> None:
        """Stop every rank of the job now."""

    def split(self, color: int, label: str) -> Communicator:
        """The ranks sharing ``color`` as their own group (a pipeline stage's replicas, one replica's stages)."""

    @property
    def host(self) -> Communicator:
        """The group that moves host arrays between these ranks: this one, or the process group under a GPU one."""

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Start sending a float32 array to rank ``dest`` of this group (completed by :meth:`wait_sends`)."""

    def recv(self, source: int, tag: int, label: str) -> np.ndarray:
        """Receive an array from rank ``source`` under the watchdog; ``label`` names the peer for a stall report."""

    def wait_sends(self, label: str) -> None:
        """Wait for this rank's started sends to complete."""

    def pending_send_bytes(self) -> int:
        """Bytes of sent tensors this rank still holds (not yet known to be received; 0 where none can be)."""

    def gather_object(self, obj: object, label: str) -> list | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""

    def copy_to_host(self, buffer) -> np.ndarray:
        """A host copy of one of this rank's buffers (host or device)."""

    def copy_from_host(self, buffer, values: np.ndarray) -> None:
        """``values`` into one of this rank's buffers (host or device), done when this returns."""

    def close(self) -> None:
        """Release resources (stop the watchdog)."""


class SingleProcessComm:
    """The process group of one: collectives reduce over nothing."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    can_defer_scale = True
    #: True: ``average_gradients`` leaves the mean's scale to the caller (returns it) instead of a pass of its own.
    defer_scale = False
    bucket_values = 0

    def average_gradients(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> np.float32:
        scale = np.float32(1.0 / divisor)
        if self.defer_scale:
            return scale
        if divisor != 1.0:
            for grad in grads:
                grad *= scale
        return np.float32(1)

    def adasum_tensors(self, tensors: Sequence[np.ndarray], divisor: float, scalars: np.ndarray, peers=None) -> None:
        if divisor != 1.0:  # Adasum of one vector is that vector: only this rank's own mean
            scale_gradients(tensors, 1.0 / divisor)

    def gradient_norm(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads)

    def scale_gradients(self, grads: Sequence[np.ndarray], factor: float) -> None:
        scale_gradients(grads, factor)

    def sum_squares(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads) ** 2

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True)

    def allgather_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True)

    def reduce_scatter(self, flat: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        out[...] = flat[: out.size]

    def all_gather(self, flat: np.ndarray, counts: Sequence[int], label: str = "") -> None:
        pass

    def watched(self, label: str, call: Callable[[], object]) -> object:
        return call()

    def watched_peer(self, label: str, call: Callable[[], object], peer: int | None = None) -> object:
        return call()

    def broadcast(self, obj: object, label: str) -> object:
        return obj

    def barrier(self, label: str) -> None:
        pass

    def abort(self, code: int) -> None:
        raise SystemExit(code)

    def split(self, color: int, label: str) -> SingleProcessComm:
        return self

    @property
    def host(self) -> SingleProcessComm:
        return self

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        raise RuntimeError("a process group of one has no peer to send to (pipeline stages need mpiexec)")

    def recv(self, source: int, tag: int, label: str) -> np.ndarray:
        raise RuntimeError("a process group of one has no peer to receive from (pipeline stages need mpiexec)")

    def wait_sends(self, label: str) -> None:
        pass

    def gather_object(self, obj: object, label: str) -> list | None:
        return [obj]

    def pending_send_bytes(self) -> int:
        return 0

    def copy_to_host(self, buffer: np.ndarray) -> np.ndarray:
        return np.array(buffer, copy=True)

    def copy_from_host(self, buffer: np.ndarray, values: np.ndarray) -> None:
        buffer[...] = values

    def close(self) -> None:
        pass
