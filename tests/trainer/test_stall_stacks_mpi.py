"""A stalled rank's Python stacks land in ``.ranks/stacks-rank-N.txt`` under ``mpiexec -n 2``, also when its main
thread holds the interpreter's lock in a native call, and the watchdog's message names the files
(tests/trainer/stall_stacks_rank.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ortflow.trainer.comm.watchdog import STACKS_FILE
from tests.support.runs import MPIEXEC

pytestmark = pytest.mark.mpi
RANK = str(Path(__file__).with_name("stall_stacks_rank.py"))
TIMEOUT_S = 4


@pytest.mark.parametrize(("mode", "where"), [("gil", "hold_the_interpreter_lock"),
                                             ("alive", "sleep_with_the_lock_free")])
def test_a_stalled_rank_leaves_its_python_stacks_in_its_file_and_the_message_names_it(tmp_path, mode, where):
    out = subprocess.run([MPIEXEC, "-n", "2", "-prepend-rank", sys.executable, "-u", RANK, mode, str(tmp_path),
                          str(TIMEOUT_S)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL, timeout=120,
                         check=False).stdout
    stacks = [tmp_path / ".ranks" / STACKS_FILE.format(rank=r) for r in (0, 1)]
    message = next(line for line in out.splitlines() if "ERROR: collective" in line)
    assert "stalled: rank 1" in message, out
    assert f"rank 1 {stacks[1]}" in message and f"this rank {stacks[0]}" in message, message
    if mode == "gil":
        assert "no sign of life" in message, message
    stalled = stacks[1].read_text()
    assert f"in {where}" in stalled, stalled  # the stalled rank's main thread, where it is stuck
    waiting = stacks[0].read_text()
    assert "this rank timed out" in waiting and "in wait_at_the_barrier" in waiting, waiting
