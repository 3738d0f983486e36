"""Parameter groups: per-group learning rate, weight decay and betas, as torch's optimizer ``param_groups``.

``optimizer.groups`` lists groups of fnmatch patterns. A parameter belongs to the first group with a pattern that
matches its name; parameters matched by no group form the last, implicit group with the section's own settings, so
every parameter is in exactly one group. A pattern that matches no parameter, or only parameters an earlier group
already holds, is refused (:func:`group_problems`, run by ``validate`` and by configure, before training).

The update is the same rule per group: :class:`GroupedUpdate` holds one update per group (host :class:`Update` or
the device update, built by the caller's factory), hands each its segments' gradients and the scheduled rate times
the group's scale, and presents the interface of one update (``segments``, ``state_views``, ``step_count``, ...),
so checkpoints, ZeRO-1 and the device path need nothing else. Every rank steps every group in the same order, also a
group with no segment on this rank (ZeRO-1), so Lamb's per-tensor sums over ranks line up.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ortflow.config import OptimizerConfig
from ortflow.config import param_group_index as assign
from ortflow.config import param_group_problems as group_problems  # noqa: F401 - re-exported by optim
from ortflow.trainer.comm.pending import ONE, Gradients, factors
from ortflow.trainer.optim.segments import Segment


@dataclass(frozen=True)
class GroupSettings:
    """What one group's rule uses."""

    lr_scale: float
    weight_decay: float
    beta1: float
    beta2: float


def settings(opt: OptimizerConfig) -> list[GroupSettings]:
    """Each configured group's settings, then the implicit last group's (the section's own)."""
    out = []
    for g in opt.groups:
        scale = g.lr_scale if g.lr_scale is not None else (
            g.learning_rate / opt.learning_rate if g.learning_rate is not None else 1.0)
        wd = opt.weight_decay if g.weight_decay is None else g.weight_decay
        b1, b2 = g.betas if g.betas is not None else (opt.beta1, opt.beta2)
        out.append(GroupSettings(scale, wd, b1, b2))
    return [*out, GroupSettings(1.0, opt.weight_decay, opt.beta1, opt.beta2)]


def record(opt: OptimizerConfig) -> str:
    """JSON of the groups as configured and resolved (patterns and settings, the implicit group last), saved with the
    optimizer state; the same on every rank."""
    patterns = [list(g.params) for g in opt.groups] + [["*"]]
    return json.dumps([{**dataclasses.asdict(s), "patterns": p} for s, p in zip(settings(opt), patterns, strict=True)],
                      sort_keys=True)


def member_names(names: Sequence[str], opt: OptimizerConfig) -> str:
    """JSON of the parameter names in each group (a file's own parameters), saved beside :func:`record`."""
    where = assign(names, opt)
    return json.dumps([[n for n, g in zip(names, where, strict=True) if g == k] for k in range(len(opt.groups) + 1)])


#: (group settings, segment numbers of the group) -> the group's update over those segments
MakeUpdate = Callable[[GroupSettings, list[int]], object]


def grouped_update(segments: Sequence[Segment], opt: OptimizerConfig, make: MakeUpdate):
    """One update per group over this rank's ``segments`` (see the module docstring). The patterns are checked
    against the whole model by configure and validate (:func:`group_problems`), not here: a pipeline stage or a
    tensor-parallel rank holds only some of the parameters."""
    of_segment = assign([s.name for s in segments], opt)
    table = settings(opt)
    members = [[i for i, g in enumerate(of_segment) if g == k] for k in range(len(table))]
    parts = [make(s, idx) for s, idx in zip(table, members, strict=True)]
    kind = DeviceGroupedUpdate if hasattr(parts[0], "to_host") else GroupedUpdate
    update = kind(segments, members, parts, [s.lr_scale for s in table], record(opt))
    update.groups_members = member_names(list(dict.fromkeys(s.name for s in segments)), opt)
    return update


def regroup(segments: Sequence[Segment], idx: Sequence[int]) -> list[Segment]:
    """The segments ``idx`` with offsets into a flat state of their own (a group's update owns its state)."""
    out, offset = [], 0
    for i in idx:
        out.append(dataclasses.replace(segments[i], offset=offset))
        offset += segments[i].size
    return out


class GroupedUpdate:
    """Several groups' updates behind the interface of one (see the module docstring)."""

    def __init__(self, segments: Sequence[Segment], members: list[list[int]], parts: list, scales: list[float],
                 groups_record: str):
        self.groups_members = "[]"
        self.segments, self.members, self.parts, self.scales = list(segments), members, parts, scales
        self.groups_record = groups_record
        self.rule = parts[0].rule  # every group runs the same rule type: the same state names
        self._where = {i: (k, j) for k, idx in enumerate(members) for j, i in enumerate(idx)}

    @property
    def step_count(self) -> int:
        return self.parts[0].step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        for part in self.parts:
            part.step_count = value

    @property
    def state_bytes(self) -> int:
        return sum(part.state_bytes for part in self.parts)

    @property
    def backend(self) -> str | None:
        return getattr(self.parts[0], "backend", None)

    def state_views(self, i: int) -> list:
        k, j = self._where[i]
        return self.parts[k].state_views(j)

    def step(self, grads: Sequence, lr: float) -> None:
        """One update of every group: group k gets its segments' gradients (and their owed factors) and
        ``lr * scale_k``."""
        if len(grads) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} gradient segments, got {len(grads)}")
        scale, clip = factors(grads)
        subs = []
        for part, idx, lr_scale in zip(self.parts, self.members, self.scales, strict=True):
            if not idx:  # nothing of this group on this rank: keep its count, and join Lamb's sums over ranks
                part.step_count += 1
                if getattr(part.rule, "trust_ratios", None) is not None and getattr(part, "sum_across_ranks", None):
                    part.sum_across_ranks(np.zeros(2 * part.num_tensors, dtype=np.float64))
                continue
            sub = Gradients([grads[i] for i in idx], scale, clip) if isinstance(grads, Gradients) else \
                [grads[i] for i in idx]
            part.step(sub, lr * lr_scale)
            subs.append(sub)
        if isinstance(grads, Gradients) and subs and not any(isinstance(s, Gradients) and s.pending for s in subs):
            grads.scale = grads.clip = ONE  # the groups' kernels applied the factors in place


class DeviceGroupedUpdate(GroupedUpdate):
    """Groups of device updates: their state moves between device and host mirrors around checkpoints."""

    def to_host(self) -> None:
        for part in self.parts:
            part.to_host()

    def to_device(self) -> None:
        for part in self.parts:
            part.to_device()
