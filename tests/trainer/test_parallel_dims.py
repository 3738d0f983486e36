"""Parallel sizes and process groups from one place: every layout's groups, and size 1 as the degenerate group."""

from __future__ import annotations

import pytest

from ortflow.trainer.comm import SingleProcessComm
from ortflow.trainer.parallel.parallel_dims import ParallelDims, make_groups


class Recorder:
    """A world rank that records the sub-groups it joins (``split`` is collective: every rank calls it alike)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.splits = rank, size, []

    def split(self, color: int, label: str):
        self.splits.append((color, label))
        return ("group", color, label)


def groups_of(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """For each of dp, pp, tp: the ranks that share a group, as sorted lists (a degenerate group: each rank alone)."""
    members: dict[str, dict[object, list[int]]] = {"dp": {}, "pp": {}, "tp": {}}
    for rank in range(dims.world):
        comm = Recorder(rank, dims.world)
        _, groups = make_groups(comm, dims)
        for kind in members:
            group = getattr(groups, kind)
            key = ("alone", rank) if isinstance(group, SingleProcessComm) else "world" if group is comm else group
            members[kind].setdefault(key, []).append(rank)
    return {kind: sorted(found.values()) for kind, found in members.items()}


def test_sizes_come_from_the_world_and_refuse_a_world_they_do_not_divide():
    assert ParallelDims.from_world(8, 2, 2) == ParallelDims(2, 2, 2)
    assert ParallelDims.from_world(4, 1, 1).world == 4 and not ParallelDims(4, 1, 1).split
    with pytest.raises(ValueError, match="6 rank\\(s\\) cannot hold 2 pipeline stage\\(s\\) x 2"):
        ParallelDims.from_world(6, 2, 2)


def test_data_parallelism_alone_joins_no_sub_group():
    dims = ParallelDims.from_world(4, 1, 1)
    comm = Recorder(0, 4)
    _, groups = make_groups(comm, dims)
    assert comm.splits == [] and groups.dp is comm and groups.world is comm
    assert isinstance(groups.pp, SingleProcessComm) and isinstance(groups.tp, SingleProcessComm)


@pytest.mark.parametrize("world,pp,tp,expected", [
    # pipeline: rank = replica * P + stage; a stage's replicas average, a replica's stages pass activations
    (4, 2, 1, {"dp": [[0, 2], [1, 3]], "pp": [[0, 1], [2, 3]], "tp": [[0], [1], [2], [3]]}),
    # tensor parallelism: rank = replica * H + t
    (4, 1, 2, {"dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]], "tp": [[0, 1], [2, 3]]}),
    # both: rank = (replica * P + stage) * H + t
    (8, 2, 2, {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
               "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}),
])
def test_every_layout_joins_the_groups_of_its_rank_order(world, pp, tp, expected):
    assert groups_of(ParallelDims.from_world(world, pp, tp)) == expected


def test_every_rank_joins_the_sub_groups_in_the_same_order():
    # A collective split called in different orders on different ranks would deadlock.
    dims = ParallelDims.from_world(8, 2, 2)
    orders = set()
    for rank in range(8):
        comm = Recorder(rank, 8)
        make_groups(comm, dims)
        orders.add(tuple(label for _, label in comm.splits))
    assert len(orders) == 1 and len(next(iter(orders))) == 3
