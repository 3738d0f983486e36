"""Communicators: the only package that imports MPI (``mpi.py``) and CuPy/NCCL (``nccl.py``).

Two implementations share one small interface:

* :class:`SingleProcessComm` for a process not started by an MPI launcher: every collective is a no-op (or a local
  scale), so the training loop runs unchanged in unit tests.
* :class:`MPIComm` for ranks under ``mpiexec``: the gradients are summed in place, where the engine keeps them, one
  in-place ``Allreduce`` per run of gradients that lie back to back in memory (``runs.py``; the trainer's shared
  arena, ``trainer/arena.py``, makes that one run), the small runs and the scalars (loss, the stop flag) packed into
  one more; each run gets the mean's scale right after its reduction, or, with ``defer_scale`` (the trainer's CPU
  path), none: the scale is returned and the norm and the update apply it as they read (``pending.py``).
* :class:`NCCLComm` (``distributed.use_nccl``) wraps one of those two: gradients are averaged with NCCL through CuPy,
  in place in the engine's own device buffers when the engine runs on CUDA, or staged through device memory when it
  runs on the CPU. Everything else (broadcasts, barriers, the watchdog) stays on the wrapped process group.

Every MPI collective runs under a watchdog: each rank records, in a small heartbeat file, the sequence number and label
of the collective it last entered. A rank that waits longer than the timeout reads the other ranks' records, names
those that never arrived (and where they were last seen), and aborts the whole job.

:func:`create_communicator` makes the process group at rank start (before the device is chosen); :func:`attach_nccl`
adds NCCL once the rank's GPU is known (the reference's order: MPI, device, NCCL, session).
"""

from ortflow.trainer.comm.communicator import (
    CollectiveTimeout,
    Communicator,
    SingleProcessComm,
    gradient_norm,
    scale_gradients,
)
from ortflow.trainer.comm.mpi import MPIComm, create_communicator, launched_by_mpi
from ortflow.trainer.comm.nccl import DeviceBuffer, NCCLComm, attach_nccl
from ortflow.trainer.comm.watchdog import Heartbeats, Watchdog, describe_stall

__all__ = [
    "CollectiveTimeout", "Communicator", "DeviceBuffer", "Heartbeats", "MPIComm", "NCCLComm", "SingleProcessComm",
    "Watchdog", "attach_nccl", "create_communicator", "describe_stall", "gradient_norm", "launched_by_mpi",
    "scale_gradients",
]
