"""Adasum: adaptive summation of one packed vector across a power-of-two number of ranks.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021) combines two vectors as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so that orthogonal contributions add and parallel ones average. It is applied pairwise up a binary tree of ranks and
per tensor (each layer gets its own coefficients, so layers with different scales do not mix).

The schedule is Horovod's vector-halving, distance-doubling one (``horovod/common/ops/adasum/adasum.h``):

* Reduce phase, levels 1, 2, 4, ... size/2: rank ``r`` pairs with ``r ^ level``. Both hold the same segment of the
  packed vector; the lower rank keeps the first half and the upper rank the second, each sending the other half to its
  neighbour. Each rank now holds, for its half, its own group's partial result (``a`` or ``b``) and the neighbour
  group's. Per tensor, the dot product and both squared norms over the half are summed over the ``2 * level`` ranks
  that together hold the whole vector at this level (one small all-reduce of ``3 x tensors`` float64 values), and the
  rank overwrites its half with the combination. After the last level each rank owns ``1/size`` of the result.
* Gather phase, levels size/2, ..., 1: neighbours swap their finished segments, doubling them back to the whole
  vector. Every slice of the result was computed by exactly one rank, so all ranks end with identical bytes.

Norms below 1e-8 leave the other coefficient at 1 (as Horovod), so a zero contribution adds nothing and divides by
nothing. This module is transport-agnostic numpy; :class:`PeerGroup` is what it needs from a communicator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

#: Squared norms below this count as zero (Horovod's threshold): the other vector's coefficient stays 1.
NORM_EPS = 1e-8
_CHUNK = 1 << 20  # elements converted to float64 at a time for the dot products (bounded scratch memory)


class PeerGroup(Protocol):
    """Point-to-point and sub-group sums over the data-parallel ranks."""

    rank: int
    size: int

    def sendrecv(self, send: np.ndarray, peer: int, recv: np.ndarray, label: str) -> None:
        """Send ``send`` to ``peer`` and receive the same-tagged message from it into ``recv``."""

    def group_allreduce_sum(self, values: np.ndarray, group_size: int, label: str) -> np.ndarray:
        """Sum of a small float64 array over the ``group_size`` consecutive ranks that include this one."""


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def tensor_offsets(counts: Sequence[int]) -> np.ndarray:
    """Start offset of each tensor in the packed vector, plus the total at the end."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])


def _dots(a, b, xp) -> tuple:
    """(a.b, |a|^2, |b|^2) accumulated in float64, as 0-d arrays of ``xp`` (no device-to-host wait on CuPy)."""
    dot = aa = bb = xp.zeros((), dtype=xp.float64)
    for start in range(0, a.size, _CHUNK):
        x = a[start : start + _CHUNK].astype(xp.float64)
        y = b[start : start + _CHUNK].astype(xp.float64)
        dot, aa, bb = dot + xp.dot(x, y), aa + xp.dot(x, x), bb + xp.dot(y, y)
    return dot, aa, bb


def coefficients(dot: float, a_sq: float, b_sq: float) -> tuple[float, float]:
    """Adasum's weights of ``a`` and ``b`` given their dot product and squared norms."""
    a_coeff = 1.0 - dot / (2.0 * a_sq) if a_sq >= NORM_EPS else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_sq) if b_sq >= NORM_EPS else 1.0
    return a_coeff, b_coeff


def _pieces(lo: int, hi: int, offsets: np.ndarray) -> list[tuple[int, int, int]]:
    """(tensor index, start, stop) of every tensor overlapping the segment [lo, hi) of the packed vector."""
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    pieces = []
    for t in range(max(first, 0), len(offsets) - 1):
        start, stop = max(lo, int(offsets[t])), min(hi, int(offsets[t + 1]))
        if int(offsets[t]) >= hi:
            break
        if stop > start:
            pieces.append((t, start, stop))
    return pieces


def adasum_allreduce(flat, counts: Sequence[int], group: PeerGroup, scratch=None, xp=np) -> None:
    """Replace ``flat`` (float32, every rank's packed vector) by the Adasum of all ranks' vectors, in place.

    Args:
        flat: This rank's contribution: the tensors of ``counts`` packed one after the other.
        counts: Elements per tensor (the per-layer boundaries), the same on every rank.
        group: Point-to-point and sub-group sums over the ranks (a power of two of them).
        scratch: Optional float32 buffer of at least ``flat.size // 2 + 1`` elements to receive into.
        xp: The array module of ``flat``: numpy on the host, CuPy on the GPU (then ``group`` exchanges device
            buffers, and the dot products reach the host once per level).

    Raises:
        ValueError: If the number of ranks is not a power of two or the sizes disagree.
    """
    size, rank = group.size, group.rank
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, got {size}")
    offsets = tensor_offsets(counts)
    if int(offsets[-1]) != flat.size:
        raise ValueError(f"packed vector has {flat.size} elements but the tensors hold {int(offsets[-1])}")
    if size == 1:
        return
    half = flat.size // 2 + 1  # the largest half a rank keeps
    recv = scratch if scratch is not None and scratch.size >= half else xp.empty(half, xp.float32)
    lo, hi = 0, flat.size
    segments: list[tuple[int, int]] = []
    level = 1
    while level < size:
        neighbor = rank ^ level
        mid = lo + (hi - lo) // 2
        left = rank & level == 0
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        segments.append((lo, hi))
        other = recv[: keep[1] - keep[0]]
        group.sendrecv(flat[give[0] : give[1]], neighbor, other, f"adasum level {level}")
        mine = flat[keep[0] : keep[1]]
        pieces = _pieces(keep[0], keep[1], offsets)
        # [dot, |left group's|^2, |right group's|^2] per tensor: the same order on both sides of the pair.
        partial = xp.zeros((len(counts), 3), dtype=xp.float64)
        for t, start, stop in pieces:
            a = mine[start - keep[0] : stop - keep[0]]
            b = other[start - keep[0] : stop - keep[0]]
            dot, a_sq, b_sq = _dots(a, b, xp)
            partial[t, 0], partial[t, 1], partial[t, 2] = (dot, a_sq, b_sq) if left else (dot, b_sq, a_sq)
        sums = partial if xp is np else xp.asnumpy(partial)
        # Sync point: the coefficients need the dot products over the whole vector, held by 2 * level ranks.
        sums = group.group_allreduce_sum(sums.reshape(-1), 2 * level, f"adasum dots level {level}").reshape(-1, 3)
        for t, start, stop in pieces:
            dot, left_sq, right_sq = sums[t]
            left_coeff, right_coeff = coefficients(dot, left_sq, right_sq)
            a_coeff, b_coeff = (left_coeff, right_coeff) if left else (right_coeff, left_coeff)
            a = mine[start - keep[0] : stop - keep[0]]
            b = other[start - keep[0] : stop - keep[0]]
            a *= np.float32(a_coeff)
            a += np.float32(b_coeff) * b
        lo, hi = keep
        level <<= 1
    # Gather: swap finished segments with the same neighbours in reverse order until every rank holds everything.
    while segments:
        level >>= 1
        outer_lo, outer_hi = segments.pop()
        theirs = (hi, outer_hi) if rank & level == 0 else (outer_lo, lo)
        group.sendrecv(flat[lo:hi], rank ^ level, flat[theirs[0] : theirs[1]], f"adasum gather level {level}")
        lo, hi = outer_lo, outer_hi
