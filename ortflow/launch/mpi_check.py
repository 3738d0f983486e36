"""Whether the MPI launcher and the ranks' mpi4py speak the same MPI (``ortflow doctor``): mpi4py binds to one MPI
library at import (``MPI4PY_LIBMPI``, else the environment's own MPICH, else the system's), and only that MPI's
launcher can start a process group of it. The binding is read in a child process with the ranks' environment, the
way a rank would load it (:func:`ortflow.trainer.comm.mpi.mpi_binding`), without initializing MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ortflow.launch.job import LaunchError
from ortflow.launch.local import find_mpiexec, launcher_flavor

_PROBE = (
    "import json, sys\n"
    "from ortflow.trainer.comm.launcher_match import launcher_mismatch\n"
    "from ortflow.trainer.comm.mpi import mpi_binding\n"
    "binding = mpi_binding()\n"
    "print(json.dumps({**binding, 'problem': launcher_mismatch(binding, sys.argv[1] or None)}))\n"
)


def probe(flavor: str | None, python: str = sys.executable, env: dict[str, str] | None = None) -> dict[str, str]:
    """mpi4py's MPI as a rank started with ``env`` would load it, and the mismatch with a ``flavor`` launcher."""
    out = subprocess.run([python, "-c", _PROBE, flavor or ""], capture_output=True, text=True, timeout=120,
                         env=dict(env if env is not None else os.environ), check=False)  # fmt: skip
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"abi": "unknown", "library": (out.stderr.strip().splitlines() or ["no answer"])[-1], "problem": None}


def mpi_rows(mpiexec: str | Path | None = None, python: str = sys.executable) -> list[tuple[str, bool, str]]:
    """``ortflow doctor``'s MPI rows: the launcher and its MPI, mpi4py's MPI, and whether the two match.

    Args:
        mpiexec: The launcher the ranks will be started with (default: the bundled MPICH's mpiexec).
        python: The Python of the ranks.
    """
    try:
        exe = find_mpiexec(mpiexec)
    except LaunchError as err:
        return [("mpiexec", False, str(err))]
    flavor = launcher_flavor(exe)
    binding = probe(flavor, python)
    names = {"mpich": "MPICH ABI", "openmpi": "Open MPI"}
    rows = [("mpiexec", True, f"{exe} ({names[flavor]})"),
            ("mpi4py", binding["abi"] in names, f"bound to {names.get(binding['abi'], binding['abi'])}: "
                                                 f"{binding['library']}")]  # fmt: skip
    problem = binding.get("problem")
    rows.append(("MPI match", not problem, problem or f"mpi4py and {exe.name} both speak {names[flavor]}"))
    return rows
