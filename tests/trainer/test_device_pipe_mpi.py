"""A CUDA pipeline's device messages under ``mpiexec -n 2``: the real schedule, :class:`DevicePipe`, process group and
watchdog, with CuPy's streams and NCCL's 2-rank communicators stood in for between the two processes
(tests/trainer/device_pipe_rank.py), so that what is host logic (headers, their communicator and tags, the order of
the calls, the watchdog's numbering) runs as on GPUs, and the GPU's implicit device-wide synchronizations can be
injected where native calls may make them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import MPIEXEC

pytestmark = pytest.mark.mpi
RANK = str(Path(__file__).with_name("device_pipe_rank.py"))
MICRO = 8


def _run(tmp_path: Path, mode: str, *options: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLLECTIVE_TIMEOUT_S": "10"}
    out = subprocess.run([MPIEXEC, "-n", "2", "-prepend-rank", sys.executable, "-u", RANK, mode, str(MICRO),
                          str(tmp_path), *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, stdin=subprocess.DEVNULL, timeout=120, check=False)
    assert out.returncode == 0, out.stdout[-4000:]
    return out.stdout


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_two_stages_exchange_eight_micro_batches_over_the_device_pipe_and_number_their_collectives_alike(tmp_path,
                                                                                                          mode):
    out = _run(tmp_path, mode)
    for rank in (0, 1):  # two updates of 8 micro-batches, every tensor checked by its receiver
        assert f"rank {rank} {mode} ok: {2 * MICRO} micro-batches checked, {2 * MICRO} sent, {2 * MICRO} received" \
            in out, out
    # Waits for one peer do not count among the collectives: both ranks are at the same number after the links' set-up
    # and at the end, so a stall report's "#N" on one rank and its peer's "#N" name the same collective.
    numbers = re.findall(r"collective #(\d+) after the links, #(\d+) at the end", out)
    assert len(numbers) == 2 and numbers[0] == numbers[1], numbers
    # Each stage has one received tensor in use at a time here: the first message allocates it, every later one of the
    # two updates is received into it again.
    assert out.count("at the end, 1 received tensor(s) allocated") == 2, out


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_implicit_device_synchronizations_in_engine_calls_and_receive_allocations_stall_nothing(tmp_path, mode):
    """An engine call or the allocation of a received message's tensor that waits for the whole GPU while this rank's
    send waits for its peer: the receive path allocates nothing once a step's first messages have arrived (the received
    tensors are reused), so no two stages each wait for the other's receive."""
    out = _run(tmp_path, mode, "--device-syncs", "--alloc-syncs")
    for rank in (0, 1):
        assert f"rank {rank} {mode} ok: {2 * MICRO} micro-batches checked" in out, out
