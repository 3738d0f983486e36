"""A pipeline rank drops the buffers of completed sends instead of holding every sent tensor until the step ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .runs import MPIEXEC


@pytest.mark.mpi
def test_completed_sends_release_their_buffers_at_two_ranks():
    script = str(Path(__file__).with_name("send_release_rank.py"))
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("send release ok") == 2
    print(out.stdout)
