"""The GPU tests' world-size check (tests/support/world.py): N singletons started by a launcher whose MPI is not
mpi4py's fail the test instead of passing as an N-rank run."""

from __future__ import annotations

import pytest

from tests.support.world import check_world

TWO_RANKS = "[0] rank 0/2 (local 0/2) on cuda:0 with 1 thread(s)\n[1] rank 1/2 (local 1/2) on cuda:1 with 1 thread(s)"
SINGLETONS = "[0] rank 0/1 (local 0/1) on cuda:0 with 1 thread(s)\n[0] rank 0/1 (local 0/1) on cuda:0 with 1 thread(s)"


def test_ranks_that_report_the_asked_world_pass():
    check_world(TWO_RANKS, 2)


def test_singletons_fail_loudly_naming_the_cause():
    with pytest.raises(AssertionError, match=r"asked for 2 rank\(s\).*\(0, 1\), \(0, 1\).*singletons"):
        check_world(SINGLETONS, 2)


def test_a_missing_or_partial_report_fails_when_required():
    with pytest.raises(AssertionError, match="nothing"):
        check_world("step 10/100 | loss 2.0\n", 2)
    with pytest.raises(AssertionError):
        check_world(TWO_RANKS.splitlines()[0], 2)
    check_world("a script's own output\n", 2, required=False)
