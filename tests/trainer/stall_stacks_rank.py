"""Test-only rank entry: rank 1 stalls while rank 0 waits for it at a barrier, under the real process group and its
watchdog.

Usage: mpiexec -n 2 python stall_stacks_rank.py MODE FOLDER TIMEOUT_S, MODE one of:
  gil   - rank 1's main thread holds the interpreter's lock in a native call that does not return (libc's sleep called
          through ctypes.PyDLL, which keeps the lock): its watchdog and output threads cannot run;
  alive - rank 1 sleeps in Python (the lock free: its threads run) outside any collective.
"""

import ctypes
import sys
import time
from pathlib import Path

from ortflow.trainer.comm.mpi import MPIComm

mode, folder, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])


def hold_the_interpreter_lock():
    ctypes.PyDLL(None).sleep(600)


def sleep_with_the_lock_free():
    time.sleep(600)


def wait_at_the_barrier(comm):
    comm.barrier("barrier that rank 1 never reaches")


comm = MPIComm(folder / ".ranks", timeout)
comm.barrier("start")
if comm.rank == 1:
    hold_the_interpreter_lock() if mode == "gil" else sleep_with_the_lock_free()
else:
    wait_at_the_barrier(comm)
