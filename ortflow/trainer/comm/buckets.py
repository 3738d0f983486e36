"""How the gradient exchange cuts the gradients into cache-sized buckets (a pure plan, tested without MPI).

Packing every gradient into one flat buffer, all-reducing it and unpacking it with the 1/N scale streams the whole
gradient set through memory twice beyond the collective itself (13 MB: 7.3 ms against 3.3 ms for a bare Allreduce of
the same bytes at 2 ranks). On CPU ranks the collective is itself memory traffic on the same core, so overlapping
cannot hide those passes; what can help is to make them hit the cache: gradients exchanged bucket by bucket, each
bucket small enough to stay in cache between its packing, its reduction and its scaling. A large gradient is reduced
in place in slices of its own memory (no packing at all); small ones are packed together so that the collectives stay
few. Every bucket is one more synchronisation of all ranks, though, which costs much more than the passes it saves
when ranks share cores with other processes: bench/bench_exchange.py measures the choices, and the default exchange
(MPIComm._exchange_runs: the gradients' memory runs reduced in place, comm/memory_runs.py) stays in place until a
dedicated host shows buckets faster (docs/layouts.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Values ``start:stop`` of gradient ``index`` (flattened)."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    """One collective: a slice of one gradient reduced in place (``packed`` False), or small gradients packed."""

    pieces: tuple[Piece, ...]
    packed: bool

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def plan_buckets(sizes: Sequence[int], bucket_values: int) -> list[Bucket]:
    """Cut gradients of ``sizes`` values into buckets of about ``bucket_values``, in order.

    A gradient of at least half a bucket is reduced in place, in slices of at most ``bucket_values``; smaller ones
    are packed together until the pack reaches ``bucket_values``. Every value is in exactly one bucket.
    """
    if bucket_values <= 0:
        raise ValueError(f"bucket_values must be > 0, got {bucket_values}")
    buckets: list[Bucket] = []
    group: list[Piece] = []

    def flush() -> None:
        if group:
            buckets.append(Bucket(tuple(group), packed=True))
            group.clear()

    for index, size in enumerate(sizes):
        if size and size >= bucket_values // 2:
            count = -(-size // bucket_values)
            step = -(-size // count)  # equal slices rather than one short tail
            buckets.extend(Bucket((Piece(index, a, min(a + step, size)),), packed=False) for a in range(0, size, step))
            continue
        if size:
            group.append(Piece(index, 0, size))
        if sum(p.size for p in group) >= bucket_values:
            flush()
    flush()
    return buckets
