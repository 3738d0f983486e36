"""Gradients averaged, and a CUDA pipeline stage's messages sent, with NCCL through CuPy: the only module that
imports CuPy."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.trainer.comm.adasum import adasum_allreduce
from ortflow.trainer.comm.block_sum import BLOCK_SUM_SRC
from ortflow.trainer.comm.communicator import Communicator, gradient_norm, scale_gradients
from ortflow.trainer.comm.device_pipe import DevicePipe, PipeLink
from ortflow.trainer.comm.packed_allreduce import PackedAllReduce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceBuffer:
    """A float32 tensor the engine owns on the GPU: its device address and element count (no host copy)."""

    ptr: int
    count: int
    name: str = ""


#: One launch for a whole list of tensors (like apex's multi-tensor kernels): one block per chunk of a tensor.
_MULTI_TENSOR_SRC = BLOCK_SUM_SRC + (Path(__file__).parent / "multi_tensor.cu").read_text()
#: Elements per block of the multi-tensor launches (multi_tensor.cu, packed_allreduce.cu): 64 per thread.
CHUNK = 16384


class TensorTable:
    """The device tables of one multi-tensor launch over a list of device buffers: each buffer's address and count,
    and the chunks (tensor index, first element) that the launch's blocks take, one each, in a fixed order; the norm's
    partial sums come one per chunk, summed in that order.

    Args:
        cupy: The cupy module.
        key: ``(device address, element count)`` of each buffer, in order.
    """

    def __init__(self, cupy, key: tuple):
        self.key = key
        counts = np.array([c for _, c in key], dtype=np.int64)
        per = np.maximum(1, -(-counts // CHUNK))  # an empty tensor gets one (empty) chunk: every partial is written
        tensor = np.repeat(np.arange(len(key), dtype=np.int32), per)
        first = np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
        start = (np.arange(int(per.sum()), dtype=np.int64) - np.repeat(first, per)) * CHUNK
        self.chunks = int(per.sum())
        self.offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # a packed buffer's layout
        self.total = int(counts.sum())
        self.ptrs = cupy.asarray(np.array([p for p, _ in key], dtype=np.uint64))
        self.counts = cupy.asarray(counts)
        #: The leading kernel arguments of every multi-tensor launch (multi_tensor.cu's order; the first chunk follows).
        self.args = (self.ptrs, self.counts, cupy.asarray(tensor), cupy.asarray(start), np.int64(CHUNK))
        self._host = (tensor, start)

    def buckets(self, size: int) -> list[Bucket]:
        """The chunks cut into consecutive buckets of about ``size`` elements each (a cut falls between chunks, so
        every bucket but the last holds at least ``size``); ``size`` 0 or at least the total: one bucket."""
        tensor, start = self._host
        counts = np.array([c for _, c in self.key], dtype=np.int64)
        lengths = np.minimum(start + CHUNK, counts[tensor]) - start  # elements per chunk
        ends = np.cumsum(lengths)
        cuts = [0]
        while size > 0:  # each bucket ends with the first chunk that brings it to size
            done = int(ends[cuts[-1] - 1]) if cuts[-1] else 0
            c = int(np.searchsorted(ends, done + size, side="left")) + 1
            if c >= self.chunks:
                break
            cuts.append(c)
        cuts.append(self.chunks)
        out = []
        for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
            lo = int(self.offsets[tensor[c0]] + start[c0])
            hi = int(self.offsets[tensor[c1 - 1]] + start[c1 - 1] + lengths[c1 - 1])
            pieces = []
            for t in range(int(tensor[c0]), int(tensor[c1 - 1]) + 1):
                a = max(lo, int(self.offsets[t])) - int(self.offsets[t])
                b = min(hi, int(self.offsets[t] + counts[t])) - int(self.offsets[t])
                if b > a:
                    pieces.append((self.key[t][0] + 4 * a, b - a))
            out.append(Bucket(c0, c1 - c0, lo, hi, tuple(pieces)))
        return out


@dataclass(frozen=True)
class Bucket:
    """One step of the bucketed exchange: the chunks ``first .. first + chunks - 1`` of a :class:`TensorTable`, which
    are the elements ``lo .. hi - 1`` of the packed layout and the (device address, count) ``pieces`` of the tensors."""

    first: int
    chunks: int
    lo: int
    hi: int
    pieces: tuple[tuple[int, int], ...]


class EngineStream:
    """A CUDA stream that a rank owns and hands to the engine's separate forward and backward calls
    (:class:`ortflow.engine.ForwardBackward`: the CUDA provider's ``user_compute_stream``), so that ortflow's work on
    their outputs runs on the engine's own stream: the gradient sums into the training module's buffers are queued
    behind the backward with no wait between them.

    The engine does not wait for a user stream at the end of a call; the host does, where it reads what the calls
    wrote (:meth:`synchronize`). A host array becomes an engine tensor through a copy on the legacy default stream,
    which a non-blocking stream does not wait for by itself: :meth:`after_host_copies` orders it.

    Args:
        cupy: The cupy module.
        device_index: This rank's GPU among the visible ones.
    """

    def __init__(self, cupy, device_index: int):
        self._cp, self.device_index = cupy, device_index
        with cupy.cuda.Device(device_index):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._held: list = []  # temporaries that work queued behind this stream still reads (freed by synchronize)

    def hold(self, value) -> None:
        """Keep ``value`` (a temporary that queued work reads, possibly on another stream ordered before this one's
        next work) alive until the host next waits for this stream."""
        self._held.append(value)

    def provider_options(self) -> dict[str, str]:
        """The CUDA provider's options that put a session's work on this stream."""
        return {"device_id": str(self.device_index), "has_user_compute_stream": "1",
                "user_compute_stream": str(self.stream.ptr)}

    def after_host_copies(self) -> None:
        """The stream's next work waits, on the GPU, for the copies the legacy default stream holds so far (a host
        array copied into an engine tensor): an event, no host wait."""
        self.stream.wait_event(self._cp.cuda.Stream.null.record())

    def sum_into(self, buffers: Sequence[DeviceBuffer], values: Sequence, fresh: bool) -> None:
        """Engine tensors ``values`` (float32, on this GPU) copied (``fresh``) or added in float32 into the device
        ``buffers``, queued on this stream (after the engine call that wrote them; :meth:`synchronize` waits)."""
        cp = self._cp
        with self.stream:
            for buffer, value in zip(buffers, values, strict=True):
                count = int(np.prod(value.shape(), dtype=np.int64))
                if value.data_type() != "tensor(float)" or count != buffer.count:
                    raise TypeError(f"gradient of {buffer.name}: {value.data_type()} of {count} values for a float32 "
                                    f"buffer of {buffer.count}")
                if count == 0:
                    continue
                source = _float_view(cp, value.data_ptr(), count, value, self.device_index)
                target = _float_view(cp, buffer.ptr, count, self, self.device_index)
                if fresh:
                    cp.copyto(target, source)
                else:
                    cp.add(target, source, out=target)

    def synchronize(self) -> None:
        """The host waits for everything queued on this stream (engine calls and sums); the held temporaries go."""
        self.stream.synchronize()
        self._held.clear()

    def record(self):
        """An event after everything queued on this stream so far (another stream waits for it on the GPU)."""
        return self.stream.record()

    def add(self, a_ptr: int, b_ptr: int, out_ptr: int, count: int) -> None:
        """``out = a + b`` for ``count`` float32 at device addresses, queued on this stream (no wait)."""
        if count:
            cp = self._cp
            with self.stream:
                cp.add(self._view(a_ptr, count), self._view(b_ptr, count), out=self._view(out_ptr, count))

    def scale(self, x_ptr: int, out_ptr: int, count: int, factor: float) -> None:
        """``out = x * factor`` for ``count`` float32 at device addresses, queued on this stream (no wait)."""
        if count:
            cp = self._cp
            with self.stream:
                cp.multiply(self._view(x_ptr, count), cp.float32(factor), out=self._view(out_ptr, count))

    def zero(self, ptr: int, count: int) -> None:
        """``count`` float32 at a device address set to 0, queued on this stream (no wait)."""
        if count:
            with self.stream:
                self._view(ptr, count).fill(0)

    def pack(self, buffers: Sequence[DeviceBuffer], ptr: int) -> None:
        """The device ``buffers`` copied one after another into the float32 tensor at ``ptr``, on this stream."""
        start = 0
        with self.stream:
            for b in buffers:
                if b.count:
                    self._view(ptr + 4 * start, b.count)[...] = self._view(b.ptr, b.count)
                start += b.count

    def unpack(self, ptr: int, buffers: Sequence[DeviceBuffer]) -> None:
        """The float32 tensor at ``ptr`` copied back into the device ``buffers`` (:meth:`pack`'s order)."""
        start = 0
        with self.stream:
            for b in buffers:
                if b.count:
                    self._view(b.ptr, b.count)[...] = self._view(ptr + 4 * start, b.count)
                start += b.count

    def _view(self, ptr: int, count: int):
        return _float_view(self._cp, ptr, count, self, self.device_index)


#: Every NCCL communicator this process has made, in the order it made them (:func:`destroy_communicators`).
_COMMUNICATORS: list = []


def _join(nccl, size: int, uid, rank: int):
    """A new NCCL communicator (``ncclCommInitRank``: the host waits for all ``size`` ranks), recorded for
    :func:`destroy_communicators`."""
    comm = nccl.NcclCommunicator(size, uid, rank)
    _COMMUNICATORS.append(comm)
    return comm


def destroy_communicators(first: int = 0) -> None:
    """Destroy the communicators made from the ``first``-th on, in the order they were made. A rank's communicators
    left to the garbage collector at exit go in no set order, and NCCL's destroy waits for the communicator's other
    ranks: two stages that destroy their two pipeline links in opposite orders wait on each other forever. Every rank
    makes its communicators in one order (each join waits for its members, so that order has no cycle); destroying
    them in it has none either."""
    made = _COMMUNICATORS[first:]
    del _COMMUNICATORS[first:]
    for comm in made:
        comm.destroy()


def _float_view(cupy, ptr: int, count: int, owner: object, device_index: int):
    """A CuPy float32 view of ``count`` values at device address ``ptr`` (no copy)."""
    memory = cupy.cuda.UnownedMemory(ptr, count * 4, owner, device_index)
    return cupy.ndarray((count,), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(memory, 0))


class NCCLComm:
    """Gradients averaged with NCCL; every other collective goes to the wrapped MPI (or single-process) group.

    * Engine on CUDA: ``grads`` are :class:`DeviceBuffer` s, the engine's own gradient buffers. One NCCL group call
      all-reduces each of them in place (``ncclAvg`` when the divisor is the world size, else a sum and one scaling
      launch), the loss/stop scalars ride in the same group, and one multi-tensor launch sums the squares for the
      norm (one read of the gradients). With ``allreduce_dtype`` float16/bfloat16 the gradients are packed into one
      buffer of that type instead (:mod:`ortflow.trainer.comm.packed_allreduce`): half the bytes; with
      ``packed=True`` into one float32 buffer (one NCCL call instead of one per tensor). The NCCL calls run on their
      own stream (``wire``), the launches on ``stream``; with ``bucket_mb`` the work is cut into buckets of chunks
      (:meth:`TensorTable.buckets`) so that NCCL reduces one while the launches pack and unpack the others, computing
      every element and partial sum as with one bucket. The host waits once per update, under the watchdog.
    * Engine on the CPU: ``grads`` are host views; they are packed into one host buffer, copied to the GPU,
      all-reduced there and copied back (staging through device memory).

    Args:
        group: The process group (rank, size, broadcast of the NCCL id, the watchdog).
        device_index: This rank's GPU among the visible ones.
        allreduce_dtype: ``distributed.allreduce_dtype``: float32, or float16/bfloat16 for the device gradients'
            all-reduce (:mod:`ortflow.trainer.comm.packed_allreduce`).
        packed: float32 gradients all-reduced as one packed buffer (``PACKED_ENV``).
        bucket_mb: ``distributed.nccl_bucket_mb``: the exchange in buckets of about this many MB sent (0: one).
    """

    #: The mean's scale is applied on the device, in the exchange's own launches: never left to the caller.
    can_defer_scale = False
    defer_scale = False
    #: NCCL's buckets are ``bucket_mb`` (the host exchange's ``bucket_values`` do not apply).
    bucket_values = 0

    def __init__(self, group: Communicator, device_index: int, allreduce_dtype: str = "float32",
                 packed: bool = False, bucket_mb: float = 0.0):
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
        self._first = len(_COMMUNICATORS)  # close() destroys this communicator and every one made after it
        self.comm = group.watched("nccl init", lambda: _join(nccl, self.size, uid, self.rank))
        self.stream = cupy.cuda.Stream(non_blocking=True)  # the exchange's kernels and the update
        self.wire = cupy.cuda.Stream(non_blocking=True)  # the bucketed exchange's NCCL calls
        self.bucket_mb = bucket_mb
        self._bucket_key: tuple | None = None
        self._bucket_list: list[Bucket] = []
        self._events: list = []
        try:
            module = cupy.RawModule(code=_MULTI_TENSOR_SRC)
            self._sum_squares, self._scale = module.get_function("sum_squares"), module.get_function("scale")
            self._sum_in_order = module.get_function("sum_in_order")
            module.compile()
            self.allreduce_dtype = allreduce_dtype
            self.packed = packed
            pack = allreduce_dtype != "float32" or packed
            self._packed = PackedAllReduce(cupy, nccl, allreduce_dtype) if pack else None
        except Exception as err:  # noqa: BLE001 - CuPy raises several kinds for a missing or broken NVRTC
            raise RuntimeError(
                f"CuPy cannot compile kernels on GPU {device_index} ({type(err).__name__}: {err}); it needs NVRTC: "
                "install the `cuda` extra (cupy with its [ctk] libraries) or set CUDA_PATH to a CUDA toolkit"
            ) from None
        self._scalars = cupy.zeros(8, dtype=cupy.float64)  # [scalars..., sum of squares]
        self._table: TensorTable | None = None
        self._parts = None  # per-chunk partial sums of squares
        self._subset: tuple | None = None  # sum_squares: (its chunk table, partials, total)
        self._host: np.ndarray | None = None
        self._device_flat = None
        self._norm_sq = 0.0
        self._closed = False
        self._engine_stream: EngineStream | None = None

    # -- the gradient path ----------------------------------------------------------------------------------------
    def _tensor_table(self, grads: Sequence[DeviceBuffer]) -> TensorTable:
        key = tuple((g.ptr, g.count) for g in grads)
        if self._table is None or self._table.key != key:
            self._table = TensorTable(self._cp, key)
        return self._table

    def _partials(self, table: TensorTable):
        if self._parts is None or self._parts.size != table.chunks:
            self._parts = self._cp.zeros(table.chunks, dtype=self._cp.float64)
        return self._parts

    def _launch(self, kernel, table: TensorTable, *args, bucket: Bucket | None = None) -> None:
        """One multi-tensor launch on the compute stream over the whole table, or over one bucket's chunks."""
        first, chunks = (bucket.first, bucket.chunks) if bucket else (0, table.chunks)
        with self.stream:
            kernel((chunks,), (256,), (*table.args, np.int32(first), *args))

    def _buckets(self, table: TensorTable) -> list[Bucket]:
        """The exchange's buckets for this gradient list: about ``bucket_mb`` of what NCCL sends each (one bucket on a
        single rank, which sends nothing)."""
        wire = 2 if self._packed is not None and self._packed.half else 4
        size = int(self.bucket_mb * (1 << 20) / wire) if self.size > 1 else 0
        if self._bucket_key != (table.key, size):
            self._bucket_list, self._bucket_key = table.buckets(size), (table.key, size)
            if self.size > 1:
                log.info("gradient exchange in %d bucket(s) of up to %.2f MB sent (distributed.nccl_bucket_mb %g)",
                         len(self._bucket_list), max(b.hi - b.lo for b in self._bucket_list) * wire / 2**20,
                         self.bucket_mb)
            events = self._cp.cuda.Event
            self._events = [(events(block=False, disable_timing=True), events(block=False, disable_timing=True))
                            for _ in self._bucket_list]
        return self._bucket_list

    def average_gradients(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> None:
        if grads and isinstance(grads[0], np.ndarray):
            return self._average_host(grads, divisor, scalars)
        cp, nccl, stream, wire = self._cp, self._nccl, self.stream, self.wire
        table = self._tensor_table(grads)
        buckets = self._buckets(table)
        n = scalars.size
        host = np.zeros(self._scalars.size, dtype=np.float64)
        host[:n] = scalars
        # Sync point: the engine ran the backward pass on its own stream; NCCL must not read half-written gradients.
        cp.cuda.runtime.deviceSynchronize()
        self._scalars.set(host, stream=stream)
        average = divisor == self.size  # NCCL divides while it reduces: no extra pass over the gradients
        op = nccl.NCCL_AVG if average else nccl.NCCL_SUM
        packed = self._packed if self.size > 1 else None  # one rank: nothing to reduce, only the scale and norm
        partials = self._partials(table)
        if self.size > 1:
            # The buckets overlap: NCCL reduces bucket k on its own stream while the compute stream packs bucket k + 1
            # (fp16/bf16, packed float32) and unpacks (or scales) bucket k - 1 with the norm's partial sums.
            if packed:  # fp16/bf16: pre-scaled by 1/ranks and summed; float32: copied as is, the per-tensor path's op
                pre = 1.0 / self.size if packed.half else 1.0
                for bucket, (ready, _) in zip(buckets, self._events, strict=True):
                    packed.pack(table, pre, stream, bucket)
                    ready.record(stream)
            else:
                self._events[0][0].record(stream)  # the scalars are on the device
            flat_op = nccl.NCCL_SUM if packed and packed.half else op
            for k, (bucket, (ready, reduced)) in enumerate(zip(buckets, self._events, strict=True)):
                if packed or k == 0:
                    wire.wait_event(ready)
                nccl.groupStart()
                if packed:  # one contiguous range of the packed buffer (comm/packed_allreduce.py)
                    ptr = packed.address(bucket.lo)
                    self.comm.allReduce(ptr, ptr, bucket.hi - bucket.lo, packed.nccl_type, flat_op, wire.ptr)
                else:
                    for ptr, count in bucket.pieces:
                        self.comm.allReduce(ptr, ptr, count, nccl.NCCL_FLOAT32, op, wire.ptr)
                if k == 0 and n:  # a pipeline stage's exchange carries no scalars (the world's MPI all-reduce does)
                    self.comm.allReduce(self._scalars.data.ptr, self._scalars.data.ptr, n, nccl.NCCL_FLOAT64,
                                        nccl.NCCL_SUM, wire.ptr)
                nccl.groupEnd()
                reduced.record(wire)
        for bucket, (_, reduced) in zip(buckets, self._events, strict=True):
            if self.size > 1:
                stream.wait_event(reduced)
            if packed:  # back into the fp32 buffers times what remains of 1 / divisor, with the norm's partial sums
                post = self.size / divisor if packed.half else 1.0 if average else 1.0 / divisor
                packed.unpack(table, post, partials, stream, bucket)
            else:
                if not average:
                    self._launch(self._scale, table, np.float32(1.0 / divisor), bucket=bucket)
                self._launch(self._sum_squares, table, partials, bucket=bucket)
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

    def engine_stream(self) -> EngineStream:
        """The stream this rank's separate engine calls run on (:class:`EngineStream`: one per rank, made on first
        use)."""
        if self._engine_stream is None:
            self._engine_stream = EngineStream(self._cp, self.device_index)
        return self._engine_stream

    # -- Adasum (comm/adasum.py's schedule on device buffers) -------------------------------------------------------
    def _device_view(self, buffer: DeviceBuffer):
        cp = self._cp
        if buffer.count == 0:  # an empty tensor may have a null address, which CuPy cannot wrap
            return cp.empty(0, dtype=cp.float32)
        memory = cp.cuda.UnownedMemory(buffer.ptr, buffer.count * 4, self, self.device_index)
        return cp.ndarray((buffer.count,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(memory, 0))

    def sendrecv(self, send, peer: int, recv, label: str) -> None:
        """Exchange device buffers with ``peer`` on the NCCL stream (callers run inside ``with self.stream``)."""
        nccl = self._nccl
        if send.size == 0 and recv.size == 0:  # both sides of the pair see the same (empty) halves
            return
        nccl.groupStart()
        self.comm.send(send.data.ptr, send.size, nccl.NCCL_FLOAT32, peer, self.stream.ptr)
        self.comm.recv(recv.data.ptr, recv.size, nccl.NCCL_FLOAT32, peer, self.stream.ptr)
        nccl.groupEnd()

    def group_allreduce_sum(self, values: np.ndarray, group_size: int, label: str) -> np.ndarray:
        return self.group.group_allreduce_sum(values, group_size, label)

    def adasum_tensors(self, tensors: Sequence, divisor: float, scalars: np.ndarray, peers=None) -> None:
        if peers is not None:
            raise RuntimeError("Adasum over tensor-parallel slices runs on CPU ranks only (device cpu)")
        if tensors and isinstance(tensors[0], np.ndarray):
            raise RuntimeError("Adasum with use_nccl needs device: cuda (CPU ranks: set use_nccl: false)")
        cp = self._cp
        total = sum(t.count for t in tensors)
        if self._device_flat is None or self._device_flat.size != total:
            self._device_flat = cp.empty(total, dtype=cp.float32)
        flat, views = self._device_flat, [self._device_view(t) for t in tensors]
        # Sync point: the engine wrote the gradients (or the optimizer the deltas) on its own stream.
        cp.cuda.runtime.deviceSynchronize()
        with self.stream:
            offset = 0
            for view in views:
                cp.multiply(view, cp.float32(1.0 / divisor), out=flat[offset : offset + view.size])
                offset += view.size
            adasum_allreduce(flat, [t.count for t in tensors], self, xp=cp)
            offset = 0
            for view in views:
                view[...] = flat[offset : offset + view.size]
                offset += view.size
            table = self._tensor_table(tensors)
            partials = self._partials(table)
            self._launch(self._sum_squares, table, partials)
            self._sum_in_order((1,), (256,), (partials, np.int64(partials.size), self._scalars[0:1]))
        # Sync point: the update reads the combined tensors next, on the engine's stream.
        self.group.watched("adasum (nccl)", self.stream.synchronize)
        self._norm_sq = float(self._scalars[0:1].get()[0])  # the same on every rank: the tensors are identical
        if scalars.size:
            scalars[:] = self.group.allreduce_sum(scalars, "adasum scalars")

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

    # -- pipeline: sub-groups and point-to-point. On the process group (MPI), host arrays: a CPU-engine rank's
    # messages, a pipeline x tensor-parallel stage's, and the tied-gradient sums (``host``). A CUDA stage's
    # activations and their gradients go device to device instead (:meth:`device_pipe`, :class:`DevicePipe`): each
    # direction between two neighbouring stages is a 2-rank NCCL communicator with a stream of its own on both ranks, so
    # every stream carries only sends to one peer or only receives from one peer, in schedule order on both sides. (On
    # one NCCL stream, the sends and receives of several micro-batches in flight make two stages' kernels wait on each
    # other: an activation's send queued before a gradient's receive on one stage, the opposite on the other; the
    # stand-in GPU of tests/trainer/test_device_pipe_order.py finds that stall and none with a stream per direction.)

    def split(self, color: int, label: str) -> NCCLComm:
        """The ranks sharing ``color`` as their own NCCL group (on this rank's GPU)."""
        return NCCLComm(self.group.split(color, label), self.device_index, self.allreduce_dtype, self.packed,
                        self.bucket_mb)

    @property
    def host(self) -> Communicator:
        """The process group: host arrays go over it, not through the GPU (a tied gradient's sum; the pipeline messages
        of a pipeline x tensor-parallel stage, and the headers of :meth:`device_pipe`'s)."""
        return self.group

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        self.group.send(array, dest, tag)

    def recv(self, source: int, tag: int, label: str) -> np.ndarray:
        return self.group.recv(source, tag, label)

    def pending_send_bytes(self) -> int:
        return self.group.pending_send_bytes()

    def wait_sends(self, label: str) -> None:
        self.group.wait_sends(label)

    def gather_object(self, obj: object, label: str) -> list | None:
        return self.group.gather_object(obj, label)

    def device_pipe(self, engine: EngineStream | None) -> DevicePipe:
        """This pipeline group's messages device to device (this rank's stage is its rank here): for each neighbouring
        pair of stages ``(s, s + 1)``, the 2-rank NCCL communicators ``act`` (``s`` sends, ``s + 1`` receives) and
        ``grad`` (the other way), each with a stream of its own on both ranks. Collective over the group: rank 0 makes
        the ids and the group broadcasts them; every rank joins its pairs in ascending order (a join waits for the
        pair's two ranks only, so the joins chain along the pipeline without a cycle). ``engine``: the rank's engine
        stream (:class:`EngineStream`; None where no engine call runs on it). Each link sends one value once, so
        that NCCL connects its two ranks here, not in the schedule."""
        nccl, stage = self._nccl, self.rank
        ids = [(nccl.get_unique_id(), nccl.get_unique_id()) for _ in range(self.size - 1)] if stage == 0 else None
        ids = self.group.broadcast(ids, "nccl pipeline link ids")
        sends, receives = {}, {}
        with self._cp.cuda.Device(self.device_index):
            for pair, (act, grad) in enumerate(ids):
                if stage not in (pair, pair + 1):
                    continue
                me = stage - pair  # 0: the lower stage of the pair
                for uid, sender in ((act, 0), (grad, 1)):
                    name = f"nccl pipeline link {'act' if sender == 0 else 'grad'} {pair}<->{pair + 1}"
                    peer = pair + 1 - me
                    comm = self.group.watched_peer(name, lambda uid=uid, me=me: _join(nccl, 2, uid, me), peer)
                    link = PipeLink(comm, self._cp.cuda.Stream(non_blocking=True), peer=1 - me, name=name)
                    (sends if me == sender else receives)[peer] = link
                    # NCCL connects a peer on its first send or receive, the host waiting for the other rank: one
                    # value now, in the joins' order, so that no send of the schedule waits on the host for its peer.
                    probe = self._cp.zeros(1, dtype=self._cp.float32)
                    op = link.comm.send if me == sender else link.comm.recv
                    op(probe.data.ptr, 1, nccl.NCCL_FLOAT32, link.peer, link.stream.ptr)
                    self.group.watched_peer(f"{name} connect", link.stream.synchronize, peer)
        return DevicePipe(self._cp, nccl, self.group, sends, receives, engine, self.device_index)

    # -- everything else runs on the process group ----------------------------------------------------------------
    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.group.allreduce_sum(values, label)

    def allgather_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        return self.group.allgather_sum(values, label)

    def reduce_scatter_device(self, send_ptr: int, recv_ptr: int, count: int, dtype: str = "float32") -> None:
        """ZeRO-1 on the GPU: ``recv`` (``count`` elements of ``dtype``: float32, float16 or bfloat16) = sum over ranks
        of this rank's range of ``send``."""
        nccl = self._nccl
        kind = {"float32": nccl.NCCL_FLOAT32, "float16": getattr(nccl, "NCCL_FLOAT16", 6),
                "bfloat16": getattr(nccl, "NCCL_BFLOAT16", 9)}[dtype]  # nccl.h's enum where CuPy lacks the name
        self.comm.reduceScatter(send_ptr, recv_ptr, count, kind, nccl.NCCL_SUM, self.stream.ptr)

    def all_gather_device(self, send_ptr: int, recv_ptr: int, count: int) -> None:
        """ZeRO-1 on the GPU: every rank's ``count`` floats into ``recv`` (in place when send = recv + rank x count)."""
        self.comm.allGather(send_ptr, recv_ptr, count, self._nccl.NCCL_FLOAT32, self.stream.ptr)

    def tensor_sum(self, src_ptr: int, dst_ptr: int, count: int, label: str,
                   engine: EngineStream | None = None) -> None:
        """``count`` float32 at device address ``src_ptr`` summed over the group into ``dst_ptr``, the ranks' parts
        added in rank order: bitwise the same on every rank (tensor parallelism's activation and input-gradient sums).

        Two ranks: one NCCL all-reduce. Each element is then one float32 add of the two parts, and a float add is
        commutative (``a + b`` and ``b + a`` round alike), so it has the bits of the rank-order add while moving what an
        all-gather moves without the gathered copy and the add's pass over it (0.26 against 0.37 ms for 64 MiB on two
        H200s). More ranks: an all-gather, then the parts added in rank order (an all-reduce's order of adds is NCCL's
        to choose).

        The collective and the adds are queued on the NCCL stream; nothing leaves the GPU. With the rank's ``engine``
        stream, on which ``src`` was written and ``dst`` is read next, the GPU orders the three: the NCCL stream waits
        for an event of the engine stream, and the engine stream for one of the NCCL stream, with no host wait (a stall
        shows where the host next waits for the engine stream, under the watchdog). Without it, ``src`` is complete
        (an engine call's output, or ``dst`` itself) and the host waits for the NCCL stream under the watchdog.
        """
        if count == 0:
            return
        cp, stream = self._cp, self.stream
        out = self._device_view(DeviceBuffer(dst_ptr, count, label))

        def run() -> None:
            if engine is not None:
                stream.wait_event(engine.record())  # src was written on the engine's stream
            flat = None
            with stream:
                if self.size == 2:
                    nccl = self._nccl
                    self.comm.allReduce(src_ptr, dst_ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
                else:
                    flat = cp.empty(self.size * count, dtype=cp.float32)
                    self.comm.allGather(src_ptr, flat.data.ptr, count, self._nccl.NCCL_FLOAT32, stream.ptr)
                    parts = flat.reshape(self.size, count)
                    if self.size == 1:
                        cp.copyto(out, parts[0])
                    else:
                        cp.add(parts[0], parts[1], out=out)
                    for part in parts[2:]:
                        cp.add(out, part, out=out)
            if engine is not None:
                engine.stream.wait_event(stream.record())  # the engine's next work reads dst
                if flat is not None:
                    engine.hold(flat)  # read by the NCCL stream after this returns
            else:
                stream.synchronize()  # Sync point: the engine's next call reads the sum on its own stream

        if engine is not None:
            run()
        else:
            self.group.watched(label, run)

    def add_device(self, a_ptr: int, b_ptr: int, out_ptr: int, count: int) -> None:
        """``out = a + b`` for ``count`` float32 at device addresses, on the NCCL stream (tensor parallelism's
        gradients of a tensor that several pieces read)."""
        if count == 0:
            return
        view = lambda ptr: self._device_view(DeviceBuffer(ptr, count))  # noqa: E731
        with self.stream:
            self._cp.add(view(a_ptr), view(b_ptr), out=view(out_ptr))
        self.stream.synchronize()  # Sync point: the engine's next call reads the sum on its own stream

    def scale_device(self, x_ptr: int, out_ptr: int, count: int, factor: float) -> None:
        """``out = x * factor`` for ``count`` float32 at device addresses, on the NCCL stream (tensor parallelism's
        gradients of a replicated tensor that a parallel piece sends)."""
        if count == 0:
            return
        view = lambda ptr: self._device_view(DeviceBuffer(ptr, count))  # noqa: E731
        with self.stream:
            self._cp.multiply(view(x_ptr), self._cp.float32(factor), out=view(out_ptr))
        self.stream.synchronize()  # Sync point: the engine's next call reads the product on its own stream

    def sum_squares(self, buffers: Sequence[DeviceBuffer]) -> float:
        """The sum of squares of some device buffers' values, in float64 (a subset of the gradients: the norm that
        :meth:`average_gradients` sums covers all of them, before any later change such as a tied-gradient sum).
        The exchange's multi-tensor kernels over this subset's own chunk table (cached), partials summed in order.
        Host gradients (an engine on the CPU): the host norm, squared."""
        if not buffers:
            return 0.0
        if isinstance(buffers[0], np.ndarray):
            return gradient_norm(buffers) ** 2
        key = tuple((b.ptr, b.count) for b in buffers)
        if self._subset is None or self._subset[0].key != key:
            table = TensorTable(self._cp, key)
            self._subset = (table, self._cp.zeros(table.chunks, dtype=self._cp.float64), self._cp.zeros(1, "float64"))
        table, partials, total = self._subset
        # Sync point: the buffers were written on other streams (the engine's, the exchange's, a copy from the host).
        self._cp.cuda.runtime.deviceSynchronize()
        self._launch(self._sum_squares, table, partials)
        with self.stream:
            self._sum_in_order((1,), (256,), (partials, np.int64(table.chunks), total))
        self.group.watched("sum of squares (nccl)", self.stream.synchronize)  # Sync point: the host reads it next
        return float(total.get()[0])

    def copy_to_host(self, buffer: DeviceBuffer | np.ndarray) -> np.ndarray:
        """A host copy of a device buffer (a tied weight's gradient, summed over pipeline stages on the host), or of
        a host buffer (an engine on the CPU)."""
        if isinstance(buffer, np.ndarray):
            return np.array(buffer, copy=True)
        # Sync point: the engine or the exchange wrote the buffer on another stream.
        self._cp.cuda.runtime.deviceSynchronize()
        return self._cp.asnumpy(self._device_view(buffer))

    def copy_from_host(self, buffer: DeviceBuffer | np.ndarray, values: np.ndarray) -> None:
        """``values`` (as many float32 as ``buffer`` holds) into a device buffer (or a host one), done when this
        returns."""
        if isinstance(buffer, np.ndarray):
            buffer[...] = values
            return
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        if values.size != buffer.count:
            raise ValueError(f"{buffer.name}: {values.size} values for a buffer of {buffer.count}")
        self._device_view(buffer).set(values)
        # Sync point: the update reads the buffer on the NCCL stream next.
        self._cp.cuda.runtime.deviceSynchronize()

    def reduce_scatter(self, flat: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        self.group.reduce_scatter(flat, out, counts)  # host ZeRO-1 over the process group (CPU engine)

    def all_gather(self, flat: np.ndarray, counts: Sequence[int], label: str = "zero-1 parameter all-gather") -> None:
        self.group.all_gather(flat, counts, label)

    def broadcast(self, obj: object, label: str) -> object:
        return self.group.broadcast(obj, label)

    def barrier(self, label: str) -> None:
        self.group.barrier(label)

    def watched(self, label: str, call: Callable[[], object]) -> object:
        return self.group.watched(label, call)

    def abort(self, code: int) -> None:
        self.group.abort(code)

    def close(self) -> None:
        """Wait for this rank's queued GPU work, destroy the NCCL communicators made since this one (its sub-groups' and
        pipeline links', in the order they were made), then close the process group."""
        if not self._closed:
            self._closed = True
            self.wire.synchronize()
            self.stream.synchronize()
            def finish() -> None:
                self._cp.cuda.runtime.deviceSynchronize()  # the sub-groups' and pipeline links' streams too
                destroy_communicators(self._first)

            self.group.watched("nccl communicators destroyed", finish)
            self.group.close()


#: ``1``: the float32 gradient all-reduce packs the gradients into one buffer (one NCCL call); ``0``: one call per
#: gradient in one NCCL group (bench/bench_gpu.py ``grads`` and bench_mixed's ``-packed`` variant compare the two).
PACKED_ENV = "ORTFLOW_PACKED_ALLREDUCE"


def attach_nccl(group: Communicator, device_index: int, allreduce_dtype: str = "float32",
                bucket_mb: float = 0.0) -> NCCLComm:
    """Join this rank to NCCL on GPU ``device_index`` (after the process group is up and the device is chosen)."""
    return NCCLComm(group, device_index, allreduce_dtype, packed=os.environ.get(PACKED_ENV, "0") == "1",
                    bucket_mb=bucket_mb)
