"""Gradients with factors still owed: the mean's 1/N scale and the clip factor, applied by the passes that read the
gradients anyway instead of by passes of their own.

The runs exchange (``MPIComm`` with ``defer_scale``) leaves the sums over ranks where they lie and reports the mean's
scale ``s = float32(1 / divisor)``; clipping records its factor ``c`` instead of writing the gradients. Every reader
then sees, element by element, what the eager passes would have written::

    g = fl32(x * s)          # the mean (x: the sum over ranks, as reduced)
    g = fl32(g * c)          # clipping, when it applies

two float32 multiplications in this order (not one by ``s * c``, whose rounding differs), so the norm, the optimizer's
parameters and state are bit for bit those of the eager passes: :func:`sum_of_squares` applies the factors per
cache-sized chunk into a scratch buffer, the host update's kernels (``optim/segments.py``, ``optim/fused.py``) as they
read each element. A factor of 1 is exact (``fl32(x * 1) = x``), so eager paths are the special case
``scale = clip = 1``. Measured: ``python -m bench exchange-fold``, docs/layouts.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ONE = np.float32(1)

#: Elements per chunk of the norm: 64K float32 = 256 KiB of scratch, which stays in L2 between the scaling and the dot.
#: Part of the norm's definition (each chunk's float32 dot, the chunks summed in float64): changing it changes bits.
NORM_CHUNK = 65536


class Gradients(list):
    """The gradients an update consumes (1-D float32 arrays), and the float32 factors every element still owes.

    Attributes:
        scale: The mean's scale, applied first (1: already applied, or none).
        clip: The clip factor, applied second (1: no clipping, or already applied).
    """

    def __init__(self, arrays: Sequence[np.ndarray] = (), scale: float = ONE, clip: float = ONE):
        super().__init__(arrays)
        self.scale, self.clip = np.float32(scale), np.float32(clip)

    @property
    def pending(self) -> bool:
        """Whether a factor is still owed."""
        return self.scale != 1 or self.clip != 1


def pick(grads: Sequence, keep: Sequence[bool]) -> Sequence:
    """The gradients whose ``keep`` is set, owing what ``grads`` owes (a subset for a norm share)."""
    picked = [g for g, k in zip(grads, keep, strict=True) if k]
    return Gradients(picked, grads.scale, grads.clip) if isinstance(grads, Gradients) else picked


def factors(grads: Sequence) -> tuple[np.float32, np.float32]:
    """(scale, clip) owed by ``grads``: those of :class:`Gradients`, (1, 1) for any other sequence."""
    if isinstance(grads, Gradients):
        return grads.scale, grads.clip
    return ONE, ONE


def apply_factors(chunk: np.ndarray, scale: np.float32, clip: np.float32) -> None:
    """In place on one (cache-sized) chunk: times ``scale``, then times ``clip`` (each skipped when exactly 1)."""
    if scale != 1:
        np.multiply(chunk, scale, out=chunk)
    if clip != 1:
        np.multiply(chunk, clip, out=chunk)


def sum_of_squares(arrays: Sequence[np.ndarray], scale: float = ONE, clip: float = ONE,
                   chunk: int = NORM_CHUNK) -> float:
    """Sum of squares of ``fl32(fl32(x * scale) * clip)`` over every array, without writing the arrays.

    Per chunk of :data:`NORM_CHUNK` elements: the float32 dot of the scaled chunk (numpy's ``dot``), added in float64.
    With both factors 1 the chunks are read where they lie; otherwise each is scaled into an L2-sized scratch buffer.
    inf or nan when a value overflows (fp16 loss scaling skips that update).
    """
    scale, clip = np.float32(scale), np.float32(clip)
    folded = scale != 1 or clip != 1
    largest = max((a.size for a in arrays), default=0)
    scratch = np.empty(min(chunk, largest), np.float32) if folded else None
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for array in arrays:
            flat = array.reshape(-1)
            for start in range(0, flat.size, chunk):
                part = flat[start : start + chunk]
                if folded:
                    view = scratch[: part.size]
                    np.multiply(part, scale, out=view)
                    if clip != 1:
                        view *= clip
                    part = view
                total += float(np.dot(part, part))
    return total


def gradient_norm(grads: Sequence[np.ndarray]) -> float:
    """Global L2 norm of host gradients as the update will see them (their owed factors applied on the fly)."""
    return float(np.sqrt(sum_of_squares(grads, *factors(grads))))


def settle(grads: Sequence[np.ndarray]) -> None:
    """Write the owed factors into the arrays now (a full pass), for a caller that cannot apply them on the fly."""
    if not isinstance(grads, Gradients) or not grads.pending:
        return
    for grad in grads:
        apply_factors(grad.reshape(-1), grads.scale, grads.clip)
    grads.scale = grads.clip = ONE


def scale_gradients(grads: Sequence[np.ndarray], factor: float) -> None:
    """Host gradients times ``factor`` (clipping): owed by :class:`Gradients` whose clip slot is free, else in place."""
    factor = np.float32(factor)
    if isinstance(grads, Gradients):
        if grads.clip != 1:
            settle(grads)  # a second clip: g * c1 * c2 must round twice, so the first goes into the arrays
        grads.clip = factor
        return
    for grad in grads:
        grad *= factor
