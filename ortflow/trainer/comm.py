"""Communicators: the only module that imports MPI.

Two implementations share one small interface:

* :class:`SingleProcessComm` for a process not started by an MPI launcher: every collective is a no-op (or a local
  scale), so the training loop runs unchanged in unit tests.
* :class:`MPIComm` for ranks under ``mpiexec``: gradients are packed into one contiguous buffer, summed with a single
  in-place ``Allreduce`` and unpacked with the mean's scale fused into the copy back. Small scalars (loss, the stop
  flag) ride at the end of the same buffer, so a weight update costs exactly one collective.

Every MPI collective runs under a watchdog: each rank records, in a small heartbeat file, the sequence number and label
of the collective it last entered. A rank that waits longer than the timeout reads the other ranks' records, names
those that never arrived (and where they were last seen), and aborts the whole job.

The NCCL communicator (GPU ranks) plugs in beside these two: :func:`create_communicator` is the seam.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

#: Environment variables that MPI launchers set in every rank (MPICH/Hydra, Open MPI, Slurm's PMI).
_LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``distributed.collective_timeout_s``."""


class Communicator(Protocol):
    """What the training loop needs from the process group."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    def average_gradients(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> None:
        """In place: every gradient becomes (sum over ranks) / divisor; ``scalars`` becomes its sum over ranks."""

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        """Sum of a small float64 array over ranks (a new array)."""

    def broadcast(self, obj: object, label: str) -> object:
        """Rank 0's ``obj`` on every rank."""

    def barrier(self, label: str) -> None:
        """Wait for every rank."""

    def abort(self, code: int) -> None:
        """Stop every rank of the job now."""

    def close(self) -> None:
        """Release resources (stop the watchdog)."""


class SingleProcessComm:
    """The process group of one: collectives reduce over nothing."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1

    def average_gradients(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> None:
        if divisor != 1.0:
            scale = np.float32(1.0 / divisor)
            for grad in grads:
                grad *= scale

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True)

    def broadcast(self, obj: object, label: str) -> object:
        return obj

    def barrier(self, label: str) -> None:
        pass

    def abort(self, code: int) -> None:
        raise SystemExit(code)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Heartbeats and the watchdog

_RECORD = struct.Struct("<qd48s")  # collective sequence number, wall time entered, label


class Heartbeats:
    """One fixed-size record per rank in ``directory``: the collective it last entered, and when."""

    def __init__(self, directory: Path, rank: int, size: int):
        self.directory = directory
        self.size = size
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank-{rank:05d}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write(0, "start")

    def write(self, seq: int, label: str) -> None:
        os.pwrite(self._fd, _RECORD.pack(seq, time.time(), label.encode()[:48]), 0)

    def read(self, rank: int) -> tuple[int, float, str] | None:
        try:
            data = (self.directory / f"rank-{rank:05d}").read_bytes()
        except FileNotFoundError:
            return None
        if len(data) < _RECORD.size:
            return None
        seq, when, label = _RECORD.unpack(data[: _RECORD.size])
        return seq, when, label.rstrip(b"\0").decode(errors="replace")

    def close(self) -> None:
        os.close(self._fd)


def describe_stall(heartbeats: Heartbeats, my_seq: int, label: str, waited: float, now: float) -> str:
    """The message a waiting rank prints: which ranks never reached collective ``my_seq``, and where they are."""
    stalled = []
    for rank in range(heartbeats.size):
        record = heartbeats.read(rank)
        if record is None:
            stalled.append(f"rank {rank} (no heartbeat: it never started)")
        elif record[0] < my_seq:
            seq, when, where = record
            stalled.append(f"rank {rank} (last entered collective #{seq} '{where}' {now - when:.0f} s ago)")
    names = "; ".join(stalled) or "none found (a rank may have entered late; check the logs)"
    return (
        f"collective #{my_seq} '{label}' waited {waited:.0f} s (distributed.collective_timeout_s); "
        f"stalled: {names}. Aborting the job; the last complete checkpoint is kept."
    )


class Watchdog:
    """Aborts the job when the current collective exceeds ``timeout`` seconds."""

    def __init__(self, timeout: float, heartbeats: Heartbeats, on_timeout: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.heartbeats = heartbeats
        self.on_timeout = on_timeout
        self.clock = clock
        self.seq = 0
        self._label = ""
        self._entered: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ortflow-watchdog", daemon=True)
        self._thread.start()

    def enter(self, label: str) -> None:
        self.seq += 1
        self._label = label
        self.heartbeats.write(self.seq, label)
        self._entered = self.clock()

    def leave(self) -> None:
        self._entered = None

    def _run(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stop.wait(poll):
            entered = self._entered
            if entered is not None and self.clock() - entered > self.timeout:
                waited = self.clock() - entered
                self.on_timeout(describe_stall(self.heartbeats, self.seq, self._label, waited, time.time()))
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------------------------------
# MPI


class MPIComm:
    """Ranks started by an MPI launcher."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float):
        from mpi4py import MPI  # the only MPI import in ortflow

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        local.Free()
        self.hostname = socket.gethostname()
        self._flat: np.ndarray | None = None
        self._slices: list[slice] = []
        self.heartbeats = Heartbeats(heartbeat_dir, self.rank, self.size)
        self.watchdog = Watchdog(timeout_s, self.heartbeats, self._timed_out)

    def _timed_out(self, message: str) -> None:
        sys.stderr.write(f"[rank {self.rank}] ERROR: {message}\n")
        sys.stderr.flush()
        self.comm.Abort(3)

    def _collective(self, label: str, call: Callable[[], object]) -> object:
        self.watchdog.enter(label)
        try:
            return call()
        finally:
            self.watchdog.leave()

    def _layout(self, grads: Sequence[np.ndarray], num_scalars: int) -> np.ndarray:
        sizes = [g.size for g in grads]
        if self._flat is None or len(self._slices) != len(sizes) or self._flat.size != sum(sizes) + num_scalars:
            offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self._slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            self._flat = np.empty(offsets[-1] + num_scalars, dtype=np.float32)
        return self._flat

    def average_gradients(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> None:
        for grad in grads:
            if grad.dtype != np.float32:
                raise TypeError(f"gradients must be float32, got {grad.dtype}: mixed precision is not supported yet")
        flat = self._layout(grads, scalars.size)
        for grad, part in zip(grads, self._slices, strict=True):
            flat[part] = grad.reshape(-1)
        flat[flat.size - scalars.size :] = scalars
        # One collective per weight update: gradients and scalars travel together.
        self._collective("gradient all-reduce", lambda: self.comm.Allreduce(self._mpi.IN_PLACE, flat, op=self._mpi.SUM))
        scale = np.float32(1.0 / divisor)
        for grad, part in zip(grads, self._slices, strict=True):
            np.multiply(flat[part].reshape(grad.shape), scale, out=grad)
        scalars[:] = flat[flat.size - scalars.size :]

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        buffer = np.array(values, dtype=np.float64, copy=True)
        self._collective(label, lambda: self.comm.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM))
        return buffer

    def broadcast(self, obj: object, label: str) -> object:
        return self._collective(label, lambda: self.comm.bcast(obj, root=0))

    def barrier(self, label: str) -> None:
        self._collective(label, self.comm.Barrier)

    def abort(self, code: int) -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        self.comm.Abort(code)

    def close(self) -> None:
        self.watchdog.close()
        self.heartbeats.close()


def launched_by_mpi(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process was started by an MPI launcher (so MPI must be initialized)."""
    return any(name in environ for name in _LAUNCHER_ENV)


def create_communicator(heartbeat_dir: Path, timeout_s: float, use_nccl: bool = False) -> Communicator:
    """The communicator for this process: MPI under a launcher, else the single-process one.

    Args:
        heartbeat_dir: Shared folder for the watchdog's per-rank heartbeat records.
        timeout_s: Abort when one collective waits longer than this.
        use_nccl: Reduce gradients with NCCL on the GPU (not available yet in this build).
    """
    if use_nccl:
        raise NotImplementedError("distributed.use_nccl: the NCCL communicator is not available yet; set it to false")
    if launched_by_mpi():
        return MPIComm(heartbeat_dir, timeout_s)
    return SingleProcessComm()
