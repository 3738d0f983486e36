"""What every rule shares: the rank's segments of the parameters, flat optimizer state, and cache-sized chunks.

A *segment* is the part of one parameter tensor that this rank updates: the whole tensor without sharding (ZeRO-0),
a contiguous range of its flattened elements under ZeRO-1 (:mod:`ortflow.trainer.optim.zero`). The optimizer state of
all of a rank's segments lives in one flat float32 array per state name (``exp_avg``, ``exp_avg_sq``, ``momentum``), in
segment order, so a checkpoint can name each piece by (parameter, element range) and any world size can read it back.

Element-wise rules run over *chunks*. The default ``fused`` backend runs each rule as one compiled loop per chunk
(:mod:`.fused`): one pass over memory; its chunks only deal the work to the update's threads. The ``numpy`` backend
runs the rule's numpy operations per chunk of a few thousand elements, so each numpy pass reads and writes data that
sits in the CPU's L1/L2 cache and the rule costs about one pass over main memory per array it touches instead of one
per operation. Both give the same bits (bench/reports/optim-cpu.md has the times).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ortflow.trainer.comm.pending import ONE, Gradients, apply_factors, factors

#: Elements per chunk: 64K float32 = 256 KiB per array, so the 5-6 arrays a rule touches stay in L2 and numpy's
#: per-call overhead stays small (measured against 8K chunks and whole-array temporaries: bench/reports/optim-cpu.md).
CHUNK = 65536

#: Elements per chunk of the fused backend: large enough that Numba's per-call cost (~10 us) stays under 1% of the
#: update, small enough to deal the work evenly to a few threads (one pass over memory needs no cache blocking).
FUSED_CHUNK = 262144

log = logging.getLogger(__name__)
_warned = False

#: How the element-wise kernels run: one compiled pass (Numba, :mod:`.fused`), or numpy operations per chunk.
BACKENDS = ("fused", "numpy")

#: Element updates (elements x weight updates) below which a run keeps the numpy kernels: starting Numba (its import
#: and loading the cached kernels) costs a rank about 0.6-1 s of CPU, and the fused kernels save about 1 ns per
#: element update over the numpy chunks (0.97 ns on one thread, 0.76 ns on two: bench/reports/optim-cpu.md), so a
#: smaller run would spend more on the start than it saves.
FUSED_MIN_WORK = 1_000_000_000

#: Sums the per-tensor partial sums of every rank (identity on one rank / without sharding).
SumAcrossRanks = Callable[[np.ndarray], np.ndarray]


def _identity(values: np.ndarray) -> np.ndarray:
    return values


@dataclass(frozen=True)
class Segment:
    """The part of one parameter this rank updates.

    Attributes:
        name: Parameter name (as in the ONNX model).
        index: Position of the parameter in the trainable list (sorted names), for per-tensor sums across ranks.
        lo: First element of the flattened tensor in this segment.
        hi: One past the last element.
        numel: Elements of the whole tensor.
        offset: Where the segment starts in this rank's flat optimizer state.
    """

    name: str
    index: int
    lo: int
    hi: int
    numel: int
    offset: int

    @property
    def size(self) -> int:
        """Elements in the segment."""
        return self.hi - self.lo


def adam_moments(g, m, v, t1, c1, b1, c2, b2, eps_hat) -> None:
    """The Adam moments in place (numpy kernels of AdamW and Lamb): ``m = b1 m + c1 g``, ``v = b2 v + c2 g^2``, and
    ``t1 = sqrt(v) + eps_hat``, the denominator, in this order of float32 operations (the bits depend on it)."""
    m *= b1
    np.multiply(g, c1, out=t1)
    m += t1
    np.multiply(g, g, out=t1)
    t1 *= c2
    v *= b2
    v += t1
    np.sqrt(v, out=t1)
    t1 += eps_hat


def whole_segments(names: Sequence[str], sizes: Sequence[int]) -> list[Segment]:
    """One segment per tensor, covering it whole (no sharding)."""
    segments, offset = [], 0
    for index, (name, size) in enumerate(zip(names, sizes, strict=True)):
        segments.append(Segment(name, index, 0, int(size), int(size), offset))
        offset += int(size)
    return segments


def chunks(size: int, chunk: int = CHUNK) -> Iterator[slice]:
    """Slices of at most ``chunk`` elements covering ``range(size)``."""
    for start in range(0, size, chunk):
        yield slice(start, min(start + chunk, size))


def _plan(segments: Sequence[Segment], chunk: int, threads: int) -> list[list[tuple[int, slice]]]:
    """The chunks of all segments dealt into ``threads`` groups of about equal elements (contiguous runs)."""
    work = [(i, part) for i, seg in enumerate(segments) for part in chunks(seg.size, chunk)]
    total = sum(p.stop - p.start for _, p in work) or 1
    groups: list[list[tuple[int, slice]]] = [[] for _ in range(threads)]
    done = 0
    for item in work:
        groups[min(threads - 1, done * threads // total)].append(item)
        done += item[1].stop - item[1].start
    return [g for g in groups if g] or [[]]


def default_backend(work: int | None = None) -> str:
    """``fused`` where Numba is installed (a pinned dependency), else ``numpy`` with a warning, once; ``numpy`` also
    for a run whose ``work`` (elements x weight updates) is below :data:`FUSED_MIN_WORK`, where Numba's start costs
    more than its kernels save (both give the same bits).

    Environments installed without dependencies (e.g. offline installs with --no-deps) may lack Numba; the numpy
    kernels give the same bits, about 2-3x slower.
    """
    global _warned
    if work is not None and work < FUSED_MIN_WORK:
        return "numpy"
    try:
        import numba  # noqa: F401 - only whether it imports
    except ImportError:
        pass
    else:
        return "fused"
    if not _warned:
        log.warning("numba is not installed: the host update runs its numpy kernels (same results, slower); "
                    "install ortflow's pinned dependencies for the fused kernels")
        _warned = True
    return "numpy"


def fused_module():
    """:mod:`.fused` (imports Numba; compiled kernels come from Numba's cache after the first run on a machine)."""
    from ortflow.trainer.optim import fused

    return fused


class Update:
    """The in-place weight update of one rank: ``update.step(grads, lr)`` after the gradients are averaged.

    Args:
        rule: The rule (:class:`~ortflow.trainer.optim.adamw.AdamW`, ``SGD``, ``Lamb``).
        segments: This rank's segments, in order (:func:`whole_segments` without sharding).
        params: For each segment, a writable 1-D float32 view of its elements in the engine's parameter buffer.
        decay: For each segment, whether weight decay applies (False for names in ``optimizer.no_weight_decay``).
        sum_across_ranks: Sums per-tensor partial sums over the ranks that share tensors (ZeRO-1); Lamb's trust ratios
            need whole-tensor norms.
        num_tensors: Trainable tensors in all (every rank's segments index into them); default: from ``segments``.
        chunk: Elements per chunk (default :data:`FUSED_CHUNK` for ``fused``, :data:`CHUNK` for ``numpy``).
        threads: Threads sharing the chunks (the rank's intra-op threads, idle during the update); the kernels
            release the GIL. Element-wise rules give the same bits with any thread count.
        backend: ``fused`` (one compiled pass per chunk, :mod:`.fused`) or ``numpy`` (the rules' numpy operations
            per chunk; the same bits, slower: bench/reports/optim-cpu.md). Default: :func:`default_backend`.
        num_updates: The weight updates the run makes: with the elements, the work that picks the default backend
            (None: ``fused`` where Numba is installed).
    """

    def __init__(
        self,
        rule,
        segments: Sequence[Segment],
        params: Sequence[np.ndarray],
        decay: Sequence[bool],
        sum_across_ranks: SumAcrossRanks = _identity,
        num_tensors: int | None = None,
        chunk: int | None = None,
        threads: int = 1,
        backend: str | None = None,
        num_updates: int | None = None,
    ):
        backend = backend or default_backend(
            None if num_updates is None else num_updates * sum(s.size for s in segments))
        chunk = chunk or (FUSED_CHUNK if backend == "fused" else CHUNK)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not (len(segments) == len(params) == len(decay)):
            raise ValueError("segments, params and decay must have one entry per segment")
        for seg, p in zip(segments, params, strict=True):
            if p.dtype != np.float32 or p.ndim != 1 or p.size != seg.size or not p.flags.c_contiguous:
                raise TypeError(f"parameter {seg.name}: need a contiguous 1-D float32 view of {seg.size} elements")
        self.rule = rule
        self.backend = backend
        self.segments = list(segments)
        self.params = list(params)
        self.decay = list(decay)
        self.sum_across_ranks = sum_across_ranks
        # All ranks must agree on it (per-tensor sums are exchanged): the trainable count, not this rank's share.
        self.num_tensors = num_tensors if num_tensors is not None else max((s.index for s in segments), default=-1) + 1
        total = sum(s.size for s in self.segments)
        self.state = {name: np.zeros(total, dtype=np.float32) for name in rule.state_names}
        self.step_count = 0
        largest = max((s.size for s in self.segments), default=0)
        self.chunk = chunk
        width = min(chunk, max(largest, 1))
        self.scratch = [np.empty(width, dtype=np.float32) for _ in range(2)]
        # Threads only pay off over several chunks; tiny models stay on the calling thread.
        self._plan = _plan(self.segments, chunk, max(1, threads) if total >= 2 * chunk else 1)
        self._thread_scratch = [[np.empty(width, dtype=np.float32) for _ in range(2)] for _ in self._plan]
        self._pool = ThreadPoolExecutor(len(self._plan)) if len(self._plan) > 1 else None
        self._bound: list | None = None

    def _bind(self) -> None:
        self._bound = []
        for group, work in enumerate(self._plan):
            t1, t2 = self._thread_scratch[group]
            items = []
            for i, part in work:
                n = part.stop - part.start
                states = tuple(s[part] for s in self.state_views(i))
                items.append((i, part, self.params[i][part], states, t1[:n], t2[:n], self.decay[i]))
            self._bound.append(items)

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(a.nbytes for a in self.state.values())

    def state_views(self, segment_number: int) -> list[np.ndarray]:
        """The state arrays (in ``rule.state_names`` order) of one segment."""
        seg = self.segments[segment_number]
        return [self.state[n][seg.offset : seg.offset + seg.size] for n in self.rule.state_names]

    def step(self, grads: Sequence[np.ndarray], lr: float) -> None:
        """Apply one update in place: parameters and state of this rank's segments.

        Args:
            grads: For each segment, its averaged (and clipped) gradient, 1-D float32 of the segment's size; may be
                overwritten (the engine resets its gradients after the update anyway). :class:`Gradients` with owed
                factors (the mean's scale, the clip factor): the kernels apply them to each element as they read it,
                ``fl32(fl32(g * scale) * clip)``, the bits of the eager passes (comm/pending.py).
            lr: Learning rate of this update.
        """
        if len(grads) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} gradient segments, got {len(grads)}")
        self.step_count += 1
        self.rule.apply(self, Gradients([g.reshape(-1) for g in grads], *factors(grads)), float(lr))

    def for_each_chunk(self, grads: Sequence[np.ndarray], kernel, fused_kernel, *consts) -> None:
        """Run an element-wise kernel over every chunk of every segment, split over the update's threads.

        ``kernel(p, g, *states, t1, t2, decay, *consts)`` is the rule's numpy kernel (``t1``, ``t2``: chunk-sized
        scratch); ``fused_kernel`` names its one-pass equivalent in :mod:`.fused`,
        ``(p, g, *states, decay, scale, clip, *consts)``, used by the default backend (imported here, not at module
        load: GPU ranks never need Numba). The gradients' owed factors (:class:`Gradients`) reach every element: the
        fused kernels multiply as they read, the numpy backend scales each chunk in place first, while it is in cache.
        """
        if self._bound is None:  # views of parameters, state and scratch per chunk, made once (per-step overhead)
            self._bind()
        scale, clip = factors(grads)

        if self.backend == "fused":
            fused_kernel = getattr(fused_module(), fused_kernel)

            def run(group: int) -> None:
                for i, part, p, states, _, _, decay in self._bound[group]:
                    fused_kernel(p, grads[i][part], *states, decay, scale, clip, *consts)
        else:
            def run(group: int) -> None:
                for i, part, p, states, t1, t2, decay in self._bound[group]:
                    g = grads[i][part]
                    apply_factors(g, scale, clip)
                    kernel(p, g, *states, t1, t2, decay, *consts)

        self._run_groups(run)
        if self.backend != "fused" and isinstance(grads, Gradients):
            grads.scale = grads.clip = ONE  # now in the arrays: a second pass over them must not apply them again

    def for_each_part(self, fn: Callable[[int, int, slice], None]) -> None:
        """Call ``fn(group, segment_number, part)`` for every chunk, split over the update's threads (``group``: the
        thread's index, for per-thread scratch). For per-segment work such as Lamb's apply and the engine rule's
        finish, whose constants differ between segments."""
        self._run_groups(lambda group: [fn(group, i, part) for i, part in self._plan[group]])

    def scratch_for(self, group: int) -> list[np.ndarray]:
        """The two chunk-sized scratch arrays of thread group ``group``."""
        return self._thread_scratch[group]

    @property
    def num_groups(self) -> int:
        """Thread groups the chunks are dealt to."""
        return len(self._plan)

    def _run_groups(self, run: Callable[[int], object]) -> None:
        if self._pool is None:
            run(0)
        else:
            list(self._pool.map(run, range(len(self._plan))))
