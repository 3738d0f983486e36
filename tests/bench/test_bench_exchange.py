"""``python -m bench exchange``: what its report says about the MPI library."""

from __future__ import annotations

from bench.bench_exchange import library_line


def test_the_mpi_library_is_its_version_strings_first_line_without_the_c_strings_nul():
    open_mpi = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023\0"
    assert library_line(open_mpi) == open_mpi[:-1]
    assert library_line("MPICH Version:      5.0.2\nMPICH Release date: x\n") == "MPICH Version:      5.0.2"
    assert library_line("\0") == "unknown"
