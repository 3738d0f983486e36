"""The gradient exchange over the engine's memory runs: no packing of large gradients, few collectives.

The engine allocates its gradient buffers from an arena, mostly back to back: the bench GPT's 69 gradients (13.3 MB)
lie in 5 contiguous runs. A run is reduced in place as one buffer, so the exchange needs as many collectives as runs
(plus one packed buffer for runs too small to deserve their own and the loss/stop scalars), not one per gradient,
and copies nothing. An MPI derived datatype over the buffers' absolute addresses (one collective in all) is not
usable: the runs span ~46 TB of address space (the arena's pages and the heap), and MPICH sizes its temporary buffers
by that span.

Which gradients form a run is read from each rank's own addresses, so the ranks agree on it once (every rank must
post the same collectives on the same values): a pair of gradients stays joined only if it is adjacent, in the same
order, on every rank (:func:`common_runs`). Pure functions here; ``MPIComm`` (comm/mpi.py) posts the collectives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence

import numpy as np

#: Runs of at least this many values are reduced where they lie; smaller ones are packed with the scalars.
RUN_MIN_VALUES = 16384
#: Linux madvise advice: back with transparent huge pages, and (Linux >= 6.1) do it now rather than in the background.
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE_PAGE = 2 * 2**20


def local_runs(addresses: Sequence[int], sizes: Sequence[int], itemsize: int = 4) -> list[list[int]]:
    """Gradient indices grouped into runs that lie back to back in this process's memory, each in address order.

    Empty gradients are left out (nothing to exchange).
    """
    runs: list[list[int]] = []
    end = None
    for i in sorted((i for i in range(len(sizes)) if sizes[i] > 0), key=lambda i: addresses[i]):
        if runs and addresses[i] == end:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = addresses[i] + sizes[i] * itemsize
    return runs


def common_runs(per_rank: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """The runs every rank can reduce alike: rank 0's runs, cut wherever another rank does not hold the same two
    gradients adjacent in the same order (so each result is contiguous in every rank's memory)."""
    joined = None
    for runs in per_rank:
        pairs = {(a, b) for run in runs for a, b in zip(run[:-1], run[1:], strict=True)}
        joined = pairs if joined is None else joined & pairs
    out: list[list[int]] = []
    for run in per_rank[0]:
        out.append([run[0]])
        for a, b in zip(run[:-1], run[1:], strict=True):
            if (a, b) in joined:
                out[-1].append(b)
            else:
                out.append([b])
    return out


def run_view(first: np.ndarray, values: int) -> np.ndarray:
    """A float32 view of ``values`` values starting at ``first``'s data (the gradients of one run, back to back).

    The caller keeps the gradients (and the engine that owns them) alive while the view is used.
    """
    buffer = (ctypes.c_float * values).from_address(first.__array_interface__["data"][0])
    return np.frombuffer(buffer, dtype=np.float32)


def advise_huge_pages(view: np.ndarray) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside ``view`` with transparent huge pages, now.

    Why: numpy asks this for its own large arrays, the engine's arena does not, and the same all-reduce measured
    1.27x slower on the engine's 4 KiB pages than on a numpy buffer (bench/bench_exchange.py, ``bare-runs`` against
    ``bare-nonblocking``). Advice only: contents are unchanged; False where the kernel refuses (no THP, older kernel).
    """
    start = view.__array_interface__["data"][0]
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + view.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_HUGEPAGE) == 0
    return advised and libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_COLLAPSE) == 0


def split_runs(
    runs: Sequence[Sequence[int]], sizes: Sequence[int], min_values: int = RUN_MIN_VALUES
) -> tuple[list[list[int]], list[int]]:
    """(runs reduced in place, gradient indices packed): runs below ``min_values`` values are packed."""
    large = [list(r) for r in runs if sum(sizes[i] for i in r) >= min_values]
    small = [i for r in runs if sum(sizes[i] for i in r) < min_values for i in r]
    return large, small


class RunPlan:
    """The runs every rank reduces in place (as float32 views), and the pack for small runs plus the scalars.

    Args:
        grads: The gradients (C-contiguous float32 arrays in the engine's memory), in the same order on every rank.
        num_scalars: Values appended to the pack (loss, stop flag).
        allgather: Every rank's value of a small picklable object, in rank order (the one collective of the plan).
        min_values: Runs smaller than this are packed.
    """

    def __init__(self, grads: Sequence[np.ndarray], num_scalars: int, allgather, min_values: int = RUN_MIN_VALUES):
        for i, g in enumerate(grads):
            if not g.flags.c_contiguous:
                raise TypeError(f"gradient {i} is not contiguous: the exchange reduces the engine's buffers in place")
        sizes = [g.size for g in grads]
        self.grads = list(grads)  # held: their identities are the plan's key (plan_key), so none may be reused
        self.key = plan_key(grads, num_scalars)
        mine = local_runs([g.__array_interface__["data"][0] for g in grads], sizes)
        large, self.small = split_runs(common_runs(allgather(mine)), sizes, min_values)
        self.views = [run_view(grads[r[0]], sum(sizes[i] for i in r)) for r in large]
        self.huge_pages = [advise_huge_pages(v) for v in self.views]
        self.flats = [g.reshape(-1) for g in grads]  # views (contiguous), kept so the engine's buffers stay referenced
        self.pack = np.empty(sum(sizes[i] for i in self.small) + num_scalars, np.float32)

    def fill(self, scalars: np.ndarray) -> None:
        """Copy the small runs' gradients and the scalars into the pack."""
        at = 0
        for i in self.small:
            self.pack[at : at + self.flats[i].size] = self.flats[i]
            at += self.flats[i].size
        self.pack[at:] = scalars

    def drain(self, scalars: np.ndarray, scale: np.float32) -> None:
        """The reduced pack back: gradients times ``scale`` (one pass: scale and copy fused), the scalars as summed."""
        at = 0
        for i in self.small:
            np.multiply(self.pack[at : at + self.flats[i].size], scale, out=self.flats[i])
            at += self.flats[i].size
        scalars[:] = self.pack[at:]


def plan_key(grads: Sequence[np.ndarray], num_scalars: int) -> tuple:
    """What a :class:`RunPlan` depends on: which arrays the gradients are, and the scalars' count.

    Identities suffice, and cost far less per call than reading addresses: the plan holds the arrays, so no other
    array can take an identity of theirs while it lives, and an array's memory never moves.
    """
    return tuple(map(id, grads)), num_scalars
