"""Whether the ranks' MPI can join the launcher that started them: mpi4py binds to one MPI library (MPICH's ABI or
Open MPI's), and only that MPI's launcher can start a process group of it. Pure functions of the environment and
the binding (:func:`ortflow.trainer.comm.mpi.mpi_binding`), checked before MPI_Init and by ``ortflow doctor``."""

from __future__ import annotations

import os

from ortflow.protocol import MPI_MISMATCH as MISMATCH

_NAMES = {"mpich": "MPICH (or another MPICH-ABI MPI: Intel MPI, MVAPICH)", "openmpi": "Open MPI"}


def launcher_abi(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """The MPI ABI whose processes can join the launcher that started this one: ``openmpi`` under Open MPI's
    ``mpirun`` (OMPI_* variables), ``mpich`` under MPICH's Hydra ``mpiexec`` (MPI_LOCALNRANKS); None otherwise
    (no launcher, or one that several ABIs serve, such as ``srun --mpi=pmi2``)."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return "openmpi"
    if "MPI_LOCALNRANKS" in environ:
        return "mpich"
    return None


def launcher_mismatch(binding: dict[str, str], launcher: str | None) -> str | None:
    """Why the ranks cannot form one process group: mpi4py's MPI is not the launcher's (None: nothing known wrong).

    Open MPI's ``mpirun`` with an MPICH-bound mpi4py: MPI_Init fails (no PMI server it speaks); MPICH's ``mpiexec``
    with an Open-MPI-bound mpi4py: every process starts as a world of one (N singletons).
    """
    abi = binding.get("abi")
    if launcher is None or abi not in _NAMES or abi == launcher:
        return None
    fix = ("use the mpiexec of mpi4py's MPI (unset slurm.mpiexec / --mpiexec: the bundled MPICH's)"
           if abi == "mpich" else "use that MPI's own mpiexec, or unset MPI4PY_LIBMPI to bind mpi4py to the bundled "
           "MPICH")  # fmt: skip
    select = ("or bind mpi4py to the launcher's MPI: export MPI4PY_LIBMPI=libmpi.so.40 (Open MPI; its full path "
              "if it is not on the loader's path) in the ranks' environment (slurm.setup)" if launcher == "openmpi"
              else "or bind mpi4py to the launcher's MPI (MPI4PY_LIBMPI=libmpi.so.12 for MPICH)")  # fmt: skip
    return (f"{MISMATCH}: mpi4py is bound to {_NAMES[abi]} ({binding.get('library')}) but the ranks were started "
            f"by {_NAMES[launcher]}'s launcher, so they cannot form one process group: {fix}, {select} "
            "(docs/clusters.md, `ortflow doctor --mpiexec LAUNCHER`)")
