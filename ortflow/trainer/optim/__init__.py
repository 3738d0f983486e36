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
from ortflow.trainer.optim.groups import GroupedUpdate, GroupSettings, group_problems, grouped_update, regroup
from ortflow.trainer.optim.lamb import Lamb
from ortflow.trainer.optim.segments import CHUNK, Segment, SumAcrossRanks, Update, chunks, whole_segments
from ortflow.trainer.optim.sgd import SGD

__all__ = [
    "CHUNK", "SGD", "AdamW", "Lamb", "Segment", "SumAcrossRanks", "Update", "build_rule", "build_update", "chunks",
    "decays", "whole_segments", "GroupedUpdate", "group_problems", "grouped_update", "regroup",
]


def build_rule(opt: OptimizerConfig, group: GroupSettings | None = None):
    """The rule object of the ``optimizer`` config section (with one parameter group's settings)."""
    if group is not None:
        opt = opt.model_copy(update={"weight_decay": group.weight_decay, "beta1": group.beta1, "beta2": group.beta2})
    if opt.name == "adamw":
        return AdamW(opt.beta1, opt.beta2, opt.epsilon, opt.weight_decay, opt.rule)
    if opt.name == "sgd":
        return SGD(opt.momentum, opt.dampening, opt.nesterov, opt.weight_decay)
    return Lamb(opt.beta1, opt.beta2, opt.epsilon, opt.weight_decay, opt.ratio_min, opt.ratio_max)


def _same(values: np.ndarray) -> np.ndarray:
    return values


def decays(names: Sequence[str], patterns: Sequence[str]) -> list[bool]:
    """For each parameter name, whether weight decay applies (no ``no_weight_decay`` pattern matches it)."""
    return [not any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names]


def build_update(
    opt: OptimizerConfig,
    segments: Sequence[Segment],
    params: Sequence[np.ndarray],
    sum_across_ranks: SumAcrossRanks | None = None,
    num_tensors: int | None = None,
    threads: int = 1,
    num_updates: int | None = None,
) -> Update:
    """The rank's update for its segments (:func:`whole_segments` without sharding, ``zero.shard_segments`` with).

    Args:
        opt: The ``optimizer`` config section.
        segments: This rank's segments.
        params: 1-D float32 views of each segment's elements in the engine's parameter buffers.
        sum_across_ranks: Sums per-tensor partial sums over ranks (ZeRO-1); None without sharding.
        num_tensors: Trainable tensors in all (ZeRO-1, where a rank's segments cover only some).
        threads: Threads sharing the element-wise work (the rank's intra-op threads).
        num_updates: The run's weight updates; a run too small to repay Numba's start keeps the numpy kernels
            (:func:`~.segments.default_backend`).
    """
    flags = decays([s.name for s in segments], opt.no_weight_decay)
    if opt.groups:
        count = num_tensors if num_tensors is not None else max((s.index for s in segments), default=-1) + 1

        def make(group: GroupSettings, idx: list[int]) -> Update:
            return Update(build_rule(opt, group), regroup(segments, idx), [params[i] for i in idx],
                          [flags[i] for i in idx], sum_across_ranks or _same, count, threads=threads,
                          num_updates=num_updates)

        return grouped_update(segments, opt, make)  # type: ignore[return-value]
    rule = build_rule(opt)
    if sum_across_ranks is None:
        return Update(rule, segments, params, flags, num_tensors=num_tensors, threads=threads, num_updates=num_updates)
    return Update(rule, segments, params, flags, sum_across_ranks, num_tensors, threads=threads,
                  num_updates=num_updates)
