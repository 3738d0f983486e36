"""A tensor-parallel rank's slice of a weight and the whole weight rebuilt from every rank's slices: what configure
writes into each rank's model (:mod:`ortflow.graph.tensor_parallel.tensor_shard`), what a rank reads from a whole
checkpoint, and what merged checkpoints, the state dict and a warm start at another size rebuild
(:mod:`ortflow.checkpoints.tp`).

A weight split along ``axis`` over ``size`` ranks may be a fusion of ``parts`` (their number, or their widths: Phi-3's
query, key and value rows of unequal widths under grouped-query attention): each rank keeps its block of every part,
concatenated, so a rank's slice holds the same proportion of each part as the whole tensor.
"""

from __future__ import annotations

import numpy as np


def parts_of(value) -> int | list[int]:
    """A weight's fused parts as recorded (a plan, JSON, an HDF5 attribute): their number, or their widths."""
    return int(value) if np.ndim(value) == 0 else [int(v) for v in np.asarray(value).reshape(-1)]


def part_widths(length: int, parts) -> list[int]:
    """The widths of a weight's fused parts along an axis of ``length``: equal, or in proportion to the recorded
    widths."""
    parts = parts_of(parts)
    if isinstance(parts, int):
        return [length // parts] * parts
    total = sum(parts)
    return [length * p // total for p in parts]


def _split_parts(value: np.ndarray, parts, axis: int) -> list[np.ndarray]:
    return np.split(value, np.cumsum(part_widths(value.shape[axis], parts))[:-1], axis=axis)


def slice_tensor(value: np.ndarray, axis: int, parts, size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s block of ``value`` along ``axis`` (a vector along its only axis): its block of every part,
    concatenated."""
    axis = axis if value.ndim > 1 else 0
    return np.concatenate([np.split(p, size, axis=axis)[rank] for p in _split_parts(value, parts, axis)], axis=axis)


def merge_slices(pieces: list[np.ndarray], axis: int, parts) -> np.ndarray:
    """The whole tensor from every rank's :func:`slice_tensor` (in rank order): its inverse."""
    axis = axis if pieces[0].ndim > 1 else 0
    per_rank = [_split_parts(p, parts, axis) for p in pieces]
    return np.concatenate(
        [np.concatenate([r[k] for r in per_rank], axis=axis) for k in range(len(per_rank[0]))], axis=axis
    )
