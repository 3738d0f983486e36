"""Data-parallel gradient exchange around the update: ZeRO stage 0 (all-reduce) and stage 1 (sharded optimizer state).

Both stages present the loop with one sequence per update: ``mine = exchange.reduce(grads, divisor, scalars)`` (the
averaged gradients of the segments this rank updates), ``exchange.norm(mine)`` / ``exchange.scale(mine, f)`` for
clipping, ``update.step(mine, lr)``, then ``exchange.gather()`` (parameters back into every rank's engine buffers).

ZeRO-1 (Rajbhandari et al. 2020, stage 1): the trainable parameters in sorted-name order form one packed layout (the
layout of the stage-0 all-reduce); it is cut into ``world`` contiguous ranges of equal bytes (``r * total // world``,
so the cut depends only on the sizes and the world size). A rank's range may begin or end inside a tensor: its
segments are the pieces of tensors in its range. Per update: one reduce-scatter of the packed gradients (each rank
receives the sum of its range), one small all-gather of [sum of squares of its range, loss, stop] summed in rank order
(every rank gets the same global norm, bit for bit), the update of the rank's range, one all-gather of the parameters.
Each rank holds optimizer state for its range only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortflow.trainer.optim.base import Segment


def shard_bounds(total: int, world: int) -> list[int]:
    """Boundaries of the ``world`` ranges of a packed layout of ``total`` float32 elements (equal bytes +-1 element)."""
    return [r * total // world for r in range(world + 1)]


def shard_segments(names: Sequence[str], sizes: Sequence[int], rank: int, world: int) -> list[Segment]:
    """The segments of rank ``rank``: the pieces of each tensor that fall in its range of the packed layout."""
    bounds = shard_bounds(int(sum(sizes)), world)
    start, stop = bounds[rank], bounds[rank + 1]
    segments, offset, base = [], 0, 0
    for index, (name, size) in enumerate(zip(names, sizes, strict=True)):
        lo, hi = max(start, base), min(stop, base + size)
        if lo < hi:
            segments.append(Segment(name, index, lo - base, hi - base, int(size), offset))
            offset += hi - lo
        base += size
    return segments


class Zero0:
    """Stage 0: every rank all-reduces every gradient and updates everything (the communicator's all-reduce)."""

    stage = 0

    def __init__(self, comm):
        self.comm = comm

    def reduce(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> list:
        # Sync point: the update's only collective - mean gradient over micro-batches x ranks, plus loss and stop.
        self.comm.average_gradients(grads, divisor, scalars)
        return [g.reshape(-1) for g in grads] if grads and isinstance(grads[0], np.ndarray) else list(grads)

    def norm(self, mine: Sequence) -> float:
        return self.comm.gradient_norm(mine)

    def scale(self, mine: Sequence, factor: float) -> None:
        self.comm.scale_gradients(mine, factor)

    def gather(self) -> None:
        """Nothing to gather: every rank updated every parameter."""

    def sum_across_ranks(self, values: np.ndarray) -> np.ndarray:
        return values


class Zero1:
    """Stage 1 on host buffers over the communicator's reduce-scatter and all-gather.

    Args:
        comm: The process group (``reduce_scatter``, ``all_gather``, ``allgather_sum``).
        names: Trainable parameter names, sorted (the packed order).
        params: 1-D views of every trainable parameter in the engine's buffers, in packed (sorted-name) order.
        rank: This rank.
        world: Ranks.
    """

    stage = 1

    def __init__(self, comm, names: Sequence[str], params: Sequence[np.ndarray], rank: int, world: int):
        self.comm, self.params, self.rank, self.world = comm, list(params), rank, world
        sizes = [p.size for p in self.params]
        self.bounds = shard_bounds(int(sum(sizes)), world)
        self.counts = [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self.flat = np.empty(self.offsets[-1], dtype=np.float32)  # packed gradients, then packed parameters
        self.shard = np.empty(self.counts[rank], dtype=np.float32)  # this rank's summed gradients
        self.segments = shard_segments(names, sizes, rank, world)
        self._norm_sq = 0.0

    def my_params(self) -> list[np.ndarray]:
        """Views of this rank's segments in the engine's parameter buffers (what its update writes)."""
        return [self.params[s.index][s.lo : s.hi] for s in self.segments]

    def reduce(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> list[np.ndarray]:
        for grad, a, b in zip(grads, self.offsets[:-1], self.offsets[1:], strict=True):
            self.flat[a:b] = grad.reshape(-1)
        # Sync point: each rank receives the sum of its range of the packed gradients.
        self.comm.reduce_scatter(self.flat, self.shard, self.counts)
        self.shard *= np.float32(1.0 / divisor)
        small = np.concatenate([[float(np.dot(self.shard, self.shard))], scalars.astype(np.float64)])
        # Sync point: the global norm and the loss/stop scalars, summed in rank order (identical on every rank).
        total = self.comm.allgather_sum(small, "zero-1 norm and scalars")
        self._norm_sq = float(total[0])
        scalars[:] = total[1:]
        base = self.bounds[self.rank]
        return [self.shard[self.offsets[s.index] + s.lo - base : self.offsets[s.index] + s.hi - base]
                for s in self.segments]

    def norm(self, mine: Sequence[np.ndarray]) -> float:
        return float(np.sqrt(self._norm_sq))

    def scale(self, mine: Sequence[np.ndarray], factor: float) -> None:
        self.shard *= np.float32(factor)

    def gather(self) -> None:
        a, b = self.bounds[self.rank], self.bounds[self.rank + 1]
        for s in self.segments:
            start = self.offsets[s.index] + s.lo
            self.flat[start : start + s.size] = self.params[s.index][s.lo : s.hi]
        # Sync point: every rank needs every updated parameter for the next forward pass.
        self.comm.all_gather(self.flat, self.counts)
        for i, p in enumerate(self.params):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if hi <= a or lo >= b:  # wholly another rank's: copy back; (partly) mine: already in place
                p[...] = self.flat[lo:hi]
            else:
                p[: max(0, a - lo)] = self.flat[lo : max(lo, a)]
                tail = max(0, hi - b)
                if tail:
                    p[p.size - tail :] = self.flat[hi - tail : hi]

    def sum_across_ranks(self, values: np.ndarray) -> np.ndarray:
        # Sync point: Lamb's per-tensor norms of tensors split between ranks.
        return self.comm.allgather_sum(values, "zero-1 lamb norms")
