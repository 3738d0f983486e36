"""Parallel sizes and process groups from one place: ``dp x pp x tp`` ranks, a size of 1 being the degenerate group.

Every layout is a special case of one: data parallelism alone is ``(D, 1, 1)``, a pipeline ``(D, P, 1)``, tensor
parallelism ``(D, 1, H)``, both ``(D, P, H)``. :class:`ParallelDims` holds the sizes (from the config and the world
size), :func:`place` says where a rank sits, :func:`make_groups` joins the sub-groups the layout needs.

``rank = (d * P + s) * H + t`` for replica ``d`` of ``D``, stage ``s`` of ``P`` and tensor-parallel rank ``t`` of
``H``: a stage's ``H`` tensor-parallel ranks are neighbours (one host: their activation sums, the most frequent
collective, go through shared memory), then the ``P`` stages of a replica (point-to-point activations), then the
replicas (one gradient average per update). Three groups per rank:

* ``tp``: the ``H`` ranks of one stage of one replica (activation and input-gradient sums);
* ``pipe``: the ``P`` stages of one replica at tensor-parallel rank ``t`` (activations forward, gradients back:
  stage ``s`` rank ``t`` talks to stage ``s +- 1`` rank ``t`` only);
* ``dp``: the ``D`` replicas of one (stage, tensor-parallel rank) (its slices' gradient average).

With ``P = 1`` this is the tensor-parallel layout ``rank = d * H + t``; with ``H = 1`` the pipeline's
``rank = d * P + s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortflow.trainer.comm import Communicator, SingleProcessComm


@dataclass(frozen=True)
class Place:
    """A rank's coordinates and the colour of each group it joins (ranks of one colour form the group)."""

    replica: int
    stage: int
    tp_rank: int
    tp_color: int
    pipe_color: int
    dp_color: int


def place(rank: int, world: int, num_stages: int, tp_size: int) -> Place:
    """Rank ``rank``'s place in a ``world = D x P x H`` job.

    Raises:
        ValueError: ``world`` is not a multiple of ``P x H`` or ``rank`` is outside it.
    """
    if num_stages < 1 or tp_size < 1 or world % (num_stages * tp_size) or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} cannot be placed on {num_stages} stages x {tp_size} "
                         "tensor-parallel ranks: num_ranks must be a multiple of their product")
    group, tp_rank = divmod(rank, tp_size)
    replica, stage = divmod(group, num_stages)
    return Place(replica, stage, tp_rank, tp_color=group, pipe_color=world + replica * tp_size + tp_rank,
                 dp_color=2 * world + stage * tp_size + tp_rank)


def rank_of(replica: int, stage: int, tp_rank: int, num_stages: int, tp_size: int) -> int:
    """The inverse of :func:`place`."""
    return (replica * num_stages + stage) * tp_size + tp_rank


@dataclass(frozen=True)
class ParallelDims:
    """The job's ``dp x pp x tp`` sizes (replicas, pipeline stages, tensor-parallel ranks per stage)."""

    dp: int
    pp: int
    tp: int

    @classmethod
    def from_world(cls, world: int, pp: int, tp: int) -> ParallelDims:
        """The sizes of a ``world``-rank job with ``pp`` stages of ``tp`` ranks (the rest are replicas).

        Raises:
            ValueError: ``world`` is not a multiple of ``pp x tp``.
        """
        if pp < 1 or tp < 1 or world < 1 or world % (pp * tp):
            raise ValueError(f"{world} rank(s) cannot hold {pp} pipeline stage(s) x {tp} tensor-parallel rank(s): "
                             "distributed.num_ranks must be a multiple of their product")
        return cls(world // (pp * tp), pp, tp)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def split(self) -> bool:
        """Whether a rank holds less than the whole model (pipeline stages or tensor-parallel slices)."""
        return self.pp > 1 or self.tp > 1

    def place(self, rank: int) -> Place:
        """Rank ``rank``'s coordinates (:func:`place`)."""
        return place(rank, self.world, self.pp, self.tp)


@dataclass
class Groups:
    """A rank's process groups; a group of size 1 is a :class:`SingleProcessComm` (no collective runs).

    Attributes:
        world: Every rank (choosing the start, the checkpoint barriers, the loss/stop/norm sums).
        dp: The replicas of this rank's part (gradient averaging); the world when nothing is split.
        pp: The stages of this rank's replica at its tensor-parallel rank (activations forward, gradients back).
        tp: The tensor-parallel ranks of this rank's stage (activation and input-gradient sums).
    """

    world: Communicator
    dp: Communicator
    pp: Communicator
    tp: Communicator


def make_groups(comm: Communicator, dims: ParallelDims) -> tuple[Place, Groups]:
    """This rank's place and its groups. Collective over the world: every rank joins the same sub-groups in the
    same order (tensor-parallel, pipeline, replicas); a layout without a split joins none."""
    where = dims.place(comm.rank)
    if not dims.split:
        return where, Groups(comm, comm, SingleProcessComm(), SingleProcessComm())
    both = dims.pp > 1 and dims.tp > 1
    tp = pp = SingleProcessComm()
    if dims.tp > 1:  # Sync point (collective): the tensor-parallel group of this stage
        tp = comm.split(where.tp_color, "tensor-parallel group of a stage" if both else "tensor-parallel group")
    if dims.pp > 1:  # Sync point (collective): the stages of this replica
        pp = comm.split(where.pipe_color, "pipeline group of a tensor-parallel rank" if both else
                        "pipeline replica group")
    dp_label = ("replica group of a stage's tensor-parallel rank" if both else "pipeline stage group" if dims.pp > 1
                else "tensor-parallel replica group")
    dp = comm.split(where.dp_color, dp_label)  # Sync point (collective): the replicas of this rank's part
    return where, Groups(comm, dp, pp, tp)
