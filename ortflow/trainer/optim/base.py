"""What every rule shares: the rank's segments of the parameters, flat optimizer state, and cache-sized chunks.

A *segment* is the part of one parameter tensor that this rank updates: the whole tensor without sharding (ZeRO-0),
a contiguous range of its flattened elements under ZeRO-1 (:mod:`ortflow.trainer.optim.zero`). The optimizer state of
all of a rank's segments lives in one flat float32 array per state name (``exp_avg``, ``exp_avg_sq``, ``momentum``), in
segment order, so a checkpoint can name each piece by (parameter, element range) and any world size can read it back.

Element-wise rules run over *chunks* of a few thousand elements: every numpy pass of a rule then reads and writes data
that sits in the CPU's L1/L2 cache, so the rule as a whole costs about one pass over main memory for each array it
touches (parameter, gradient, each state) instead of one per numpy operation (bench/results/optim_cpu.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

#: Elements per chunk: 16K float32 = 64 KiB per array, so the 4-6 arrays a rule touches stay in L2 (measured fastest
#: among 4K..256K and whole tensors on the 2-core machine; bench/results/optim_cpu.md).
CHUNK = 16384

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


class Update:
    """The in-place weight update of one rank: ``update.step(grads, lr)`` after the gradients are averaged.

    Args:
        rule: The rule (:class:`~ortflow.trainer.optim.adamw.AdamW`, ``SGD``, ``Lamb``).
        segments: This rank's segments, in order (:func:`whole_segments` without sharding).
        params: For each segment, a writable 1-D float32 view of its elements in the engine's parameter buffer.
        decay: For each segment, whether weight decay applies (False for names in ``optimizer.no_weight_decay``).
        sum_across_ranks: Sums per-tensor partial sums over the ranks that share tensors (ZeRO-1); Lamb's trust ratios
            need whole-tensor norms.
    """

    def __init__(
        self,
        rule,
        segments: Sequence[Segment],
        params: Sequence[np.ndarray],
        decay: Sequence[bool],
        sum_across_ranks: SumAcrossRanks = _identity,
    ):
        if not (len(segments) == len(params) == len(decay)):
            raise ValueError("segments, params and decay must have one entry per segment")
        for seg, p in zip(segments, params, strict=True):
            if p.dtype != np.float32 or p.ndim != 1 or p.size != seg.size or not p.flags.c_contiguous:
                raise TypeError(f"parameter {seg.name}: need a contiguous 1-D float32 view of {seg.size} elements")
        self.rule = rule
        self.segments = list(segments)
        self.params = list(params)
        self.decay = list(decay)
        self.sum_across_ranks = sum_across_ranks
        self.num_tensors = max((s.index for s in self.segments), default=-1) + 1
        total = sum(s.size for s in self.segments)
        self.state = {name: np.zeros(total, dtype=np.float32) for name in rule.state_names}
        self.step_count = 0
        largest = max((s.size for s in self.segments), default=0)
        self.scratch = [np.empty(min(CHUNK, max(largest, 1)), dtype=np.float32) for _ in range(2)]

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
                overwritten (the engine resets its gradients after the update anyway).
            lr: Learning rate of this update.
        """
        if len(grads) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} gradient segments, got {len(grads)}")
        self.step_count += 1
        self.rule.apply(self, [g.reshape(-1) for g in grads], float(lr))

    def for_each_chunk(self, grads: Sequence[np.ndarray], kernel, *consts) -> None:
        """Run an element-wise ``kernel(p, g, *states, t1, t2, decay, *consts)`` over every chunk of every segment."""
        t1, t2 = self.scratch
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            states = self.state_views(i)
            for part in chunks(p.size):
                n = part.stop - part.start
                kernel(p[part], g[part], *(s[part] for s in states), t1[:n], t2[:n], self.decay[i], *consts)
