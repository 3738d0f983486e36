"""Where a rank sits when pipeline and tensor parallelism combine (with data parallelism): ``(dp, pp, tp)``.

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
