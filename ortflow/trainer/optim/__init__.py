"""The weight update, applied by ortflow in place on the engine's parameter buffers.

The engine computes forward and backward; after the gradients are averaged (and clipped) the loop calls
``update.step(grads, lr)``. One small module per rule: :mod:`.adamw` (rules ``torch`` and ``engine``), :mod:`.sgd`,
:mod:`.lamb`; :mod:`.base` holds the segments, the flat optimizer state and the cache-sized chunk loop they share;
:mod:`.zero` shards the state over data-parallel ranks (ZeRO stage 1). Skipping an update (a non-finite gradient under
mixed precision) is simply not calling ``step``: nothing else changes, not even the step count.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import numpy as np

from ortflow.config import OptimizerConfig
from ortflow.trainer.optim.adamw import AdamW
from ortflow.trainer.optim.base import CHUNK, Segment, SumAcrossRanks, Update, chunks, whole_segments
from ortflow.trainer.optim.lamb import Lamb
from ortflow.trainer.optim.sgd import SGD

__all__ = [
    "CHUNK", "SGD", "AdamW", "Lamb", "Segment", "SumAcrossRanks", "Update", "build_rule", "build_update", "chunks",
    "decays", "whole_segments",
]


def build_rule(opt: OptimizerConfig):
    """The rule object of the ``optimizer`` config section."""
    if opt.name == "adamw":
        return AdamW(opt.beta1, opt.beta2, opt.epsilon, opt.weight_decay, opt.rule)
    if opt.name == "sgd":
        return SGD(opt.momentum, opt.dampening, opt.nesterov, opt.weight_decay)
    return Lamb(opt.beta1, opt.beta2, opt.epsilon, opt.weight_decay, opt.ratio_min, opt.ratio_max)


def decays(names: Sequence[str], patterns: Sequence[str]) -> list[bool]:
    """For each parameter name, whether weight decay applies (no ``no_weight_decay`` pattern matches it)."""
    return [not any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names]


def build_update(
    opt: OptimizerConfig,
    segments: Sequence[Segment],
    params: Sequence[np.ndarray],
    sum_across_ranks: SumAcrossRanks | None = None,
) -> Update:
    """The rank's update for its segments (:func:`whole_segments` without sharding, ``zero.shard_segments`` with).

    Args:
        opt: The ``optimizer`` config section.
        segments: This rank's segments.
        params: 1-D float32 views of each segment's elements in the engine's parameter buffers.
        sum_across_ranks: Sums per-tensor partial sums over ranks (ZeRO-1); None without sharding.
    """
    rule = build_rule(opt)
    flags = decays([s.name for s in segments], opt.no_weight_decay)
    if sum_across_ranks is None:
        return Update(rule, segments, params, flags)
    return Update(rule, segments, params, flags, sum_across_ranks)
