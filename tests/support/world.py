"""The world size the ranks of a multi-process test report, checked against the one asked for: a launcher whose MPI
is not mpi4py's starts N singletons (each rank 0 of 1), which must fail the test, not pass as an N-rank run."""

from __future__ import annotations

import re

#: The trainer's start line, one per rank: ``rank 1/2 (local 1/2) on cuda:1 ...``.
_RANK_LINE = re.compile(r"\brank (\d+)/(\d+) \(local \d+/\d+\)")


def check_world(output: str, ranks: int, required: bool = True) -> None:
    """Raise AssertionError unless the ranks' start lines in ``output`` report a world of ``ranks``, once per rank.

    Args:
        output: The launcher's combined output.
        ranks: The ranks asked for (``mpiexec -n``).
        required: The output must hold the start lines (the trainer's runs); False checks only those present.
    """
    found = [(int(rank), int(world)) for rank, world in _RANK_LINE.findall(output)]
    if not found and not required:
        return
    worlds = sorted({world for _, world in found})
    if worlds != [ranks] or sorted(rank for rank, _ in found) != list(range(ranks)):
        raise AssertionError(
            f"asked for {ranks} rank(s), the ranks report {found or 'nothing'} as (rank, world size): the launcher "
            "started singletons (mpi4py is built against another MPI; `ortflow doctor --mpiexec MPIEXEC` names the "
            "fix)")
