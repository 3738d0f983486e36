"""Communicators: the only module that imports MPI.

Two implementations share one small interface:

* :class:`SingleProcessComm` for a process not started by an MPI launcher: every collective is a no-op (or a local
  scale), so the training loop runs unchanged in unit tests.
* :class:`MPIComm` for ranks under ``mpiexec``: gradients are packed into one contiguous buffer, summed with a single
  in-place ``Allreduce`` and unpacked with the mean's scale fused into the copy back. Small scalars (loss, the stop
  flag) ride at the end of the same buffer, so a weight update costs exactly one collective.
* :class:`NCCLComm` (``distributed.use_nccl``) wraps one of those two: gradients are averaged with NCCL through CuPy,
  in place in the engine's own device buffers when the engine runs on CUDA, or staged through device memory when it
  runs on the CPU. Everything else (broadcasts, barriers, the watchdog) stays on the wrapped process group.

Every MPI collective runs under a watchdog: each rank records, in a small heartbeat file, the sequence number and label
of the collective it last entered. A rank that waits longer than the timeout reads the other ranks' records, names
those that never arrived (and where they were last seen), and aborts the whole job.

:func:`create_communicator` makes the process group at rank start (before the device is chosen); :func:`attach_nccl`
adds NCCL once the rank's GPU is known (the reference's order: MPI, device, NCCL, session).
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
from dataclasses import dataclass
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

    def average_gradients(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> None:
        """In place: every gradient becomes (sum over ranks) / divisor; ``scalars`` becomes its sum over ranks."""

    def gradient_norm(self, grads: Sequence) -> float:
        """Global L2 norm of the averaged gradients (the same on every rank; the trainer clips with it)."""

    def scale_gradients(self, grads: Sequence, factor: float) -> None:
        """In place: every gradient times ``factor`` (gradient clipping)."""

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


def gradient_norm(grads: Sequence[np.ndarray]) -> float:
    """Global L2 norm of host gradients."""
    return float(np.sqrt(sum(float(np.dot(g.reshape(-1), g.reshape(-1))) for g in grads)))


def scale_gradients(grads: Sequence[np.ndarray], factor: float) -> None:
    """Host gradients times ``factor``, in place."""
    scale = np.float32(factor)
    for grad in grads:
        grad *= scale


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

    def gradient_norm(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads)

    def scale_gradients(self, grads: Sequence[np.ndarray], factor: float) -> None:
        scale_gradients(grads, factor)

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True)

    def watched(self, label: str, call: Callable[[], object]) -> object:
        return call()

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
        self._closed = False

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

    #: Run a blocking call (a collective, or a wait on one) under the watchdog.
    watched = _collective

    def gradient_norm(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads)

    def scale_gradients(self, grads: Sequence[np.ndarray], factor: float) -> None:
        scale_gradients(grads, factor)

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
        if self.size == 1:  # `mpiexec -n 1`: nothing to exchange, so no packing copies (only the mean's scale)
            if divisor != 1.0:
                scale_gradients(grads, 1.0 / divisor)
            return
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
        if self._closed:  # an NCCLComm wrapping this one closes it too
            return
        self._closed = True
        self.watchdog.close()
        self.heartbeats.close()


def launched_by_mpi(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process was started by an MPI launcher (so MPI must be initialized)."""
    return any(name in environ for name in _LAUNCHER_ENV)


def create_communicator(heartbeat_dir: Path, timeout_s: float, use_nccl: bool = False) -> Communicator:
    """The process group for this process: MPI under a launcher, else the single-process one.

    NCCL is added later, by :func:`attach_nccl`, once the rank's GPU is chosen (it needs this group to share its id).

    Args:
        heartbeat_dir: Shared folder for the watchdog's per-rank heartbeat records.
        timeout_s: Abort when one collective waits longer than this.
        use_nccl: Accepted for the call sites' sake; the group itself is the same with or without NCCL.
    """
    if launched_by_mpi():
        return MPIComm(heartbeat_dir, timeout_s)
    return SingleProcessComm()


# ---------------------------------------------------------------------------------------------------------------------
# NCCL through CuPy


@dataclass(frozen=True)
class DeviceBuffer:
    """A float32 tensor the engine owns on the GPU: its device address and element count (no host copy)."""

    ptr: int
    count: int
    name: str = ""


#: One launch for a whole list of tensors (like llm.c's and apex's multi-tensor kernels): blockIdx.y picks the tensor.
_MULTI_TENSOR_SRC = r"""
// Sum of one value per thread over a block of 256 threads, by a fixed tree (the same order on every run and rank).
__device__ double block_sum(double acc) {
    __shared__ double part[256];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    return part[0];
}
extern "C" __global__ void sum_squares(const unsigned long long* ptrs, const long long* counts, double* out) {
    const float* x = (const float*)ptrs[blockIdx.y];
    long long n = counts[blockIdx.y];
    double acc = 0.0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        double v = x[i];
        acc += v * v;
    }
    // One partial per block, summed in a fixed order by sum_in_order: an atomicAdd here would make the norm (and so
    // the clipping factor) depend on block timing and differ between ranks in the last bits.
    double total = block_sum(acc);
    if (threadIdx.x == 0) out[blockIdx.y * gridDim.x + blockIdx.x] = total;
}
extern "C" __global__ void sum_in_order(const double* parts, long long n, double* out) {
    // One block of 256 threads: each thread sums a fixed strided share, then a fixed tree: the same order every time.
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    double total = block_sum(acc);
    if (threadIdx.x == 0) *out = total;
}
extern "C" __global__ void scale(const unsigned long long* ptrs, const long long* counts, float factor) {
    float* x = (float*)ptrs[blockIdx.y];
    long long n = counts[blockIdx.y];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= factor;
}
"""


class NCCLComm:
    """Gradients averaged with NCCL; every other collective goes to the wrapped MPI (or single-process) group.

    * Engine on CUDA: ``grads`` are :class:`DeviceBuffer` s, the engine's own gradient buffers. One NCCL group call
      all-reduces each of them in place (``ncclAvg`` when the divisor is the world size, else a sum and one scaling
      launch), the loss/stop scalars ride in the same group, and one multi-tensor launch sums the squares for the
      norm (one read of the gradients).
      The host waits once per update, under the watchdog.
    * Engine on the CPU: ``grads`` are host views; they are packed into one host buffer, copied to the GPU,
      all-reduced there and copied back (staging through device memory).

    Args:
        group: The process group (rank, size, broadcast of the NCCL id, the watchdog).
        device_index: This rank's GPU among the visible ones.
    """

    def __init__(self, group: Communicator, device_index: int):
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as err:
            raise RuntimeError(
                f"distributed.use_nccl needs CuPy with NCCL ({err}): install ortflow's `cuda` extra (docs/gpu.md) or "
                "set use_nccl: false"
            ) from None
        self._cp, self._nccl, self.group = cupy, nccl, group
        self.rank, self.size = group.rank, group.size
        self.local_rank, self.local_size = group.local_rank, group.local_size
        self.device_index = device_index
        cupy.cuda.Device(device_index).use()
        # Rank bootstrap as in llm.c's zero.cuh: rank 0 makes the unique id, the process group broadcasts it.
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = group.broadcast(uid, "nccl unique id")
        self.comm = group.watched("nccl init", lambda: nccl.NcclCommunicator(self.size, uid, self.rank))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        try:
            module = cupy.RawModule(code=_MULTI_TENSOR_SRC)
            self._sum_squares, self._scale = module.get_function("sum_squares"), module.get_function("scale")
            self._sum_in_order = module.get_function("sum_in_order")
            module.compile()
        except Exception as err:  # noqa: BLE001 - CuPy raises several kinds for a missing or broken NVRTC
            raise RuntimeError(
                f"CuPy cannot compile kernels on GPU {device_index} ({type(err).__name__}: {err}); it needs NVRTC: "
                "install the `cuda` extra (cupy with its [ctk] libraries) or set CUDA_PATH to a CUDA toolkit"
            ) from None
        self._scalars = cupy.zeros(8, dtype=cupy.float64)  # [scalars..., sum of squares]
        self._table: tuple | None = None
        self._parts = None  # per-block partial sums of squares
        self._host: np.ndarray | None = None
        self._device_flat = None
        self._norm_sq = 0.0
        self._closed = False

    # -- the gradient path ----------------------------------------------------------------------------------------
    def _tensor_table(self, grads: Sequence[DeviceBuffer]) -> tuple:
        cp = self._cp
        key = tuple((g.ptr, g.count) for g in grads)
        if self._table is None or self._table[0] != key:
            ptrs = cp.asarray(np.array([g.ptr for g in grads], dtype=np.uint64))
            counts = cp.asarray(np.array([g.count for g in grads], dtype=np.int64))
            self._table = (key, ptrs, counts, max(g.count for g in grads))
        return self._table

    @staticmethod
    def _blocks(table: tuple) -> int:
        return int(min(max(1, -(-table[3] // 256)), 1024))

    def _partials(self, table: tuple):
        size = self._blocks(table) * len(table[0])
        if self._parts is None or self._parts.size != size:
            self._parts = self._cp.zeros(size, dtype=self._cp.float64)
        return self._parts

    def _launch(self, kernel, table: tuple, *args) -> None:
        _, ptrs, counts, largest = table
        blocks = self._blocks(table)
        with self.stream:
            kernel((blocks, len(table[0])), (256,), (ptrs, counts, *args))

    def average_gradients(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> None:
        if grads and isinstance(grads[0], np.ndarray):
            return self._average_host(grads, divisor, scalars)
        cp, nccl, stream = self._cp, self._nccl, self.stream
        table = self._tensor_table(grads)
        n = scalars.size
        host = np.zeros(self._scalars.size, dtype=np.float64)
        host[:n] = scalars
        # Sync point: the engine ran the backward pass on its own stream; NCCL must not read half-written gradients.
        cp.cuda.runtime.deviceSynchronize()
        self._scalars.set(host, stream=stream)
        average = divisor == self.size  # NCCL divides while it reduces: no extra pass over the gradients
        op = nccl.NCCL_AVG if average else nccl.NCCL_SUM
        nccl.groupStart()
        for grad in grads:
            self.comm.allReduce(grad.ptr, grad.ptr, grad.count, nccl.NCCL_FLOAT32, op, stream.ptr)
        self.comm.allReduce(self._scalars.data.ptr, self._scalars.data.ptr, n, nccl.NCCL_FLOAT64, nccl.NCCL_SUM,
                            stream.ptr)
        nccl.groupEnd()
        if not average:
            self._launch(self._scale, table, np.float32(1.0 / divisor))
        partials = self._partials(table)
        self._launch(self._sum_squares, table, partials)
        with stream:
            self._sum_in_order((1,), (256,), (partials, np.int64(partials.size), self._scalars[n : n + 1]))
        # Sync point: the engine's optimizer runs on its own stream and must see the averaged gradients; the wait is
        # where a stalled rank shows, so it runs under the watchdog.
        self.group.watched("gradient all-reduce (nccl)", stream.synchronize)
        result = self._scalars.get()
        scalars[:] = result[:n]
        self._norm_sq = float(result[n])

    def _average_host(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> None:
        cp, nccl, stream = self._cp, self._nccl, self.stream
        sizes = [g.size for g in grads]
        total = sum(sizes) + scalars.size
        if self._host is None or self._host.size != total:
            self._host = np.empty(total, dtype=np.float32)
            self._device_flat = cp.empty(total, dtype=cp.float32)
        flat, offset = self._host, 0
        for grad in grads:
            flat[offset : offset + grad.size] = grad.reshape(-1)
            offset += grad.size
        flat[offset:] = scalars
        self._device_flat.set(flat, stream=stream)
        self.comm.allReduce(self._device_flat.data.ptr, self._device_flat.data.ptr, total, nccl.NCCL_FLOAT32,
                            nccl.NCCL_SUM, stream.ptr)
        self._device_flat.get(stream=stream, out=flat)
        # Sync point: the host reads the sums next.
        self.group.watched("gradient all-reduce (nccl, staged)", stream.synchronize)
        scale, offset = np.float32(1.0 / divisor), 0
        for grad in grads:
            np.multiply(flat[offset : offset + grad.size].reshape(grad.shape), scale, out=grad)
            offset += grad.size
        scalars[:] = flat[offset:]

    def gradient_norm(self, grads: Sequence) -> float:
        if grads and isinstance(grads[0], np.ndarray):
            return gradient_norm(grads)
        return float(np.sqrt(self._norm_sq))  # summed on the device by average_gradients, in the same wait

    def scale_gradients(self, grads: Sequence, factor: float) -> None:
        if grads and isinstance(grads[0], np.ndarray):
            return scale_gradients(grads, factor)
        self._launch(self._scale, self._tensor_table(grads), np.float32(factor))
        # Sync point: the engine's optimizer (its own stream) must read the clipped gradients.
        self.stream.synchronize()

    # -- everything else runs on the process group ----------------------------------------------------------------
    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.group.allreduce_sum(values, label)

    def broadcast(self, obj: object, label: str) -> object:
        return self.group.broadcast(obj, label)

    def barrier(self, label: str) -> None:
        self.group.barrier(label)

    def watched(self, label: str, call: Callable[[], object]) -> object:
        return self.group.watched(label, call)

    def abort(self, code: int) -> None:
        self.group.abort(code)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream.synchronize()
            self.group.close()


def attach_nccl(group: Communicator, device_index: int) -> NCCLComm:
    """Join this rank to NCCL on GPU ``device_index`` (after the process group is up and the device is chosen)."""
    return NCCLComm(group, device_index)
