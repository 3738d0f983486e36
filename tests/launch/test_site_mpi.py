"""The site's MPI: mpi4py binds to one MPI library and only that MPI's launcher can start a process group of it. A
mismatch (Open MPI's ``mpirun`` with the bundled MPICH's mpi4py, or MPICH's ``mpiexec`` with mpi4py bound to a
system Open MPI) is refused at rank start with the fix named, and ``ortflow doctor --mpiexec`` finds it first;
bound to the system Open MPI (``MPI4PY_LIBMPI``), its ``mpirun`` trains the same run to the same bits as the
bundled MPICH. The system Open MPI tests need Debian's ``openmpi-bin`` (``.ci/run`` installs it as root)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow.trainer.comm.launcher_match import MISMATCH, launcher_abi, launcher_mismatch
from tests.support.prefect_runs import final_parameters
from tests.support.runs import copied_run, make_run

ORTFLOW = str(Path(sys.executable).parent / "ortflow")
OPEN_MPI_LIBRARY = "libmpi.so.40"


def _system_open_mpi() -> str | None:
    """Why the system Open MPI tests cannot run here (None: they can)."""
    mpirun = shutil.which("mpirun.openmpi") or "/usr/bin/mpirun.openmpi"
    if not Path(mpirun).exists():
        return "no system Open MPI (apt-get install openmpi-bin; .ci/run installs it when run as root)"
    try:
        ctypes.CDLL(OPEN_MPI_LIBRARY)
    except OSError as err:
        return f"Open MPI's {OPEN_MPI_LIBRARY} does not load: {err}"
    return None


NO_OPEN_MPI = _system_open_mpi()
needs_open_mpi = pytest.mark.skipif(NO_OPEN_MPI is not None, reason=str(NO_OPEN_MPI))
MPIRUN = "/usr/bin/mpirun.openmpi"


@pytest.mark.parametrize(("environ", "abi"), [
    ({"OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "0"}, "openmpi"),  # Open MPI's mpirun
    ({"PMI_RANK": "0", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}, "mpich"),  # MPICH's Hydra mpiexec
    ({"PMI_RANK": "0", "PMI_FD": "9", "SLURM_JOB_ID": "3"}, None),  # srun --mpi=pmi2: either ABI may join
    ({}, None),
])
def test_the_launcher_is_told_from_the_ranks_environment(environ, abi):
    assert launcher_abi(environ) == abi


def test_a_mismatch_names_both_mpis_and_the_fix():
    mpich = {"abi": "mpich", "library": "/venv/lib/libmpi.so.12"}
    problem = launcher_mismatch(mpich, "openmpi")
    assert problem.startswith(MISMATCH) and "/venv/lib/libmpi.so.12" in problem
    assert "MPI4PY_LIBMPI=libmpi.so.40" in problem and "unset slurm.mpiexec" in problem
    assert launcher_mismatch(mpich, "mpich") is None and launcher_mismatch(mpich, None) is None
    assert "unset MPI4PY_LIBMPI" in launcher_mismatch({"abi": "openmpi", "library": "x"}, "mpich")


SECTIONS = {"distributed": {"num_ranks": 2}, "train": {"num_train_steps": 6}}


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("configured"), "configured", **SECTIONS)


def run_folder(configured, tmp_path: Path, name: str):
    """A run folder of its own with the configured artifacts copied (configure verifies and reuses them)."""
    return copied_run(configured, make_run, tmp_path, name, **SECTIONS)


def train(run_dir: Path, mpiexec: str | None, **env: str) -> subprocess.CompletedProcess:
    command = [ORTFLOW, "train", str(run_dir), "--np", "2", "--threads", "1"]
    command += ["--mpiexec", mpiexec] if mpiexec else []
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


@needs_open_mpi
def test_open_mpis_mpirun_with_the_bundled_mpich_mpi4py_is_refused_naming_the_fix(configured, tmp_path):
    cfg = run_folder(configured, tmp_path, "mismatch")
    done = train(cfg.output_dir, MPIRUN)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "MPI launcher mismatch: mpi4py is bound to MPICH" in said and "MPI4PY_LIBMPI=libmpi.so.40" in said
    assert "no error lines captured" not in said


@needs_open_mpi
def test_the_bundled_mpiexec_with_mpi4py_bound_to_open_mpi_is_refused_not_run_as_singletons(configured, tmp_path):
    cfg = run_folder(configured, tmp_path, "singletons")
    done = train(cfg.output_dir, None, MPI4PY_LIBMPI=OPEN_MPI_LIBRARY)
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "MPI launcher mismatch: mpi4py is bound to Open MPI" in said
    assert "started with 1 rank(s)" not in said


@needs_open_mpi
def test_the_system_open_mpi_trains_the_run_to_the_bundled_mpichs_bits(configured, tmp_path):
    runs = {name: run_folder(configured, tmp_path, name) for name in ("mpich", "openmpi")}
    assert train(runs["mpich"].output_dir, None).returncode == 0
    done = train(runs["openmpi"].output_dir, MPIRUN, MPI4PY_LIBMPI=OPEN_MPI_LIBRARY)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "rank 1/2" in done.stdout + done.stderr  # one process group of two, not two worlds of one
    ours, reference = final_parameters(runs["openmpi"]), final_parameters(runs["mpich"])
    assert ours.keys() == reference.keys()
    for name in reference:
        assert np.array_equal(ours[name], reference[name]), name


@needs_open_mpi
def test_doctor_finds_the_mismatch_before_a_run_and_passes_the_fixed_binding():
    doctor = subprocess.run([ORTFLOW, "doctor", "--mpiexec", MPIRUN], capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 1 and "MPI launcher mismatch" in doctor.stdout + doctor.stderr
    fixed = subprocess.run([ORTFLOW, "doctor", "--mpiexec", MPIRUN], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "MPI4PY_LIBMPI": OPEN_MPI_LIBRARY})  # fmt: skip
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "MPI match: mpi4py and mpirun.openmpi both speak Open MPI" in fixed.stdout + fixed.stderr
