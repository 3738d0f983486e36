"""The update on CUDA buffers: fused multi-tensor CuPy kernels (``update.cu``), one launch per step for AdamW and SGD.

:class:`DeviceUpdate` has the interface of :class:`~ortflow.trainer.optim.segments.Update` (``step``, ``segments``,
``rule``, ``state_views``, ``step_count``, ``state_bytes``) over device addresses: the engine's parameter buffers and
gradient buffers (:class:`~ortflow.trainer.comm.DeviceBuffer`), optimizer state in CuPy arrays. Kernels run on the
communicator's NCCL stream, after the gradient exchange on the same stream, and the step ends with one stream
synchronize (the engine's next forward runs on its own stream and must see the new parameters). Lamb takes three
launches (moments and partial norms, fixed-order sums, apply) and one small host round trip for the trust ratios,
which also gives ZeRO-1 the place for its one small sum over ranks.

:class:`Zero1Device` is ZeRO-1 on NCCL: pack, reduce-scatter of equal padded ranges (NCCL needs equal counts), scale
and norm partials in one kernel, a small host all-gather of [norm^2, scalars] in rank order, the update of this rank's
range, pack, in-place all-gather, unpack.

:class:`AdasumDevice` is Adasum (``distributed.enable_adasum``) on NCCL around this update.

Written to mirror the host rules operation for operation; run on the device by tests/gpu/test_gpu_optim.py and
tests/gpu/test_gpu_adasum.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ortflow.trainer.comm.block_sum import HALF_SRC
from ortflow.trainer.comm.nccl import TensorTable
from ortflow.trainer.comm.pending import Gradients
from ortflow.trainer.optim.adamw import AdamW
from ortflow.trainer.optim.adasum_update import AdasumExchange
from ortflow.trainer.optim.lamb import Lamb
from ortflow.trainer.optim.segments import Segment
from ortflow.trainer.optim.sgd import SGD
from ortflow.trainer.optim.zero import shard_segments

log = logging.getLogger(__name__)
f32 = np.float32
_SRC = HALF_SRC + (Path(__file__).parent / "update.cu").read_text()
_THREADS = 256


def _cupy():
    import cupy  # only here and in comm/nccl.py

    return cupy


class _Table:
    """Device arrays of per-tensor addresses and counts for one multi-tensor launch."""

    def __init__(self, cp, columns: Sequence[Sequence[int]], counts: Sequence[int], decay: Sequence[bool]):
        self.columns = [cp.asarray(np.asarray(c, dtype=np.uint64)) for c in columns]
        self.counts = cp.asarray(np.asarray(counts, dtype=np.int64))
        self.decay = cp.asarray(np.asarray(decay, dtype=np.int32))
        self.num = len(counts)
        self.blocks = int(min(max(1, -(-max(counts, default=1) // _THREADS)), 1024))


class DeviceUpdate:
    """The in-place update of one rank's segments on the GPU (see the module docstring).

    Args:
        rule: An AdamW, SGD or Lamb rule object (its hyper-parameters; the arithmetic is in update.cu).
        segments: This rank's segments.
        param_ptrs: Device address of each segment's first element in the engine's parameter buffers.
        decay: Per segment, whether weight decay applies.
        stream: The CuPy stream of the gradient exchange (NCCLComm.stream).
        sum_across_ranks: Sums per-tensor host sums over ranks (ZeRO-1), for Lamb.
        num_tensors: Trainable tensors in all.
    """

    def __init__(self, rule, segments: Sequence[Segment], param_ptrs: Sequence[int], decay: Sequence[bool], stream,
                 sum_across_ranks=None, num_tensors: int | None = None):
        cp = self._cp = _cupy()
        self.rule, self.segments, self.decay, self.stream = rule, list(segments), list(decay), stream
        self.param_ptrs = [int(p) for p in param_ptrs]
        self.sum_across_ranks = sum_across_ranks or (lambda v: v)
        self.num_tensors = num_tensors if num_tensors is not None else max((s.index for s in segments), default=-1) + 1
        total = sum(s.size for s in self.segments)
        self.state = {name: cp.zeros(total, dtype=cp.float32) for name in rule.state_names}
        self._host = {name: np.zeros(total, dtype=np.float32) for name in rule.state_names}
        self.step_count = 0
        module = cp.RawModule(code=_SRC, options=("--std=c++11",))
        self._k = {name: module.get_function(name) for name in
                   ("adamw_torch", "adamw_engine", "sgd", "lamb_moments", "sum_pairs", "lamb_apply")}
        self._grad_key = None
        self._table = None
        counts = [s.size for s in self.segments]
        self._state_cols = [[self.state[n].data.ptr + 4 * s.offset for s in self.segments] for n in rule.state_names]
        self._counts = counts

    @property
    def state_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state.values())

    def _launch_table(self, grad_ptrs: Sequence[int]) -> _Table:
        key = tuple(grad_ptrs)
        if self._grad_key != key:
            self._table = _Table(self._cp, [self.param_ptrs, list(grad_ptrs), *self._state_cols], self._counts,
                                 self.decay)
            self._grad_key = key
        return self._table

    def state_views(self, i: int) -> list[np.ndarray]:
        """Host mirrors of one segment's state (current after :meth:`to_host`; pushed by :meth:`to_device`)."""
        seg = self.segments[i]
        return [self._host[n][seg.offset : seg.offset + seg.size] for n in self.rule.state_names]

    def to_host(self) -> None:
        """Copy the device state into the host mirrors (before a checkpoint is written)."""
        self.stream.synchronize()
        for name, arr in self.state.items():
            arr.get(out=self._host[name])

    def to_device(self) -> None:
        """Copy the host mirrors to the device (after a checkpoint was loaded into them)."""
        for name, arr in self.state.items():
            arr.set(self._host[name])

    def step(self, grads: Sequence, lr: float) -> None:
        """One update; ``grads`` are per segment objects with ``.ptr`` (DeviceBuffer) on this rank's GPU."""
        if isinstance(grads, Gradients) and grads.pending:  # the device exchanges scale and clip in their kernels
            raise TypeError("the device update cannot apply owed gradient factors (comm/pending.py): scale them first")
        if len(grads) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} gradient segments, got {len(grads)}")
        self.step_count += 1
        table = self._launch_table([g.ptr for g in grads])
        grid, block = (table.blocks, table.num), (_THREADS,)
        rule, t, k = self.rule, self.step_count, self._k
        with self.stream:
            if isinstance(rule, AdamW) and rule.rule == "torch":
                bc1, bc2 = 1.0 - rule.beta1**t, 1.0 - rule.beta2**t
                k["adamw_torch"](grid, block, (*table.columns, table.counts, table.decay,
                                               f32(1.0 - lr * rule.weight_decay), f32(1.0 - rule.beta1),
                                               f32(rule.beta1), f32(1.0 - rule.beta2), f32(rule.beta2),
                                               f32(rule.eps * np.sqrt(bc2)), f32(lr * np.sqrt(bc2) / bc1)))
            elif isinstance(rule, AdamW):
                b1, b2, lr32 = f32(rule.beta1), f32(rule.beta2), f32(lr)
                alpha_c, beta_c = f32(1) - f32(float(b1) ** t), f32(1) - f32(float(b2) ** t)
                lr_c = f32(lr32 * (np.sqrt(beta_c) / alpha_c))
                k["adamw_engine"](grid, block, (*table.columns, table.counts, table.decay, f32(1) - b1, b1,
                                                f32(1) - b2, b2, f32(rule.eps), lr_c, lr32 * f32(rule.weight_decay)))
            elif isinstance(rule, SGD):
                momentum = table.columns[2] if rule.momentum > 0 else table.columns[0]
                k["sgd"](grid, block, (table.columns[0], table.columns[1], momentum, table.counts, table.decay,
                                       f32(rule.weight_decay), f32(lr), f32(rule.momentum),
                                       f32(1.0 - rule.dampening), np.int32(rule.nesterov), np.int32(t == 1),
                                       np.int32(rule.momentum > 0)))
            elif isinstance(rule, Lamb):
                self._lamb(table, grid, block, lr)
            else:
                raise TypeError(f"no device kernel for {type(rule).__name__}")
        # Sync point: the engine's next forward (its own stream) must read the updated parameters.
        self.stream.synchronize()

    def _lamb(self, table: _Table, grid, block, lr: float) -> None:
        cp, rule, t = self._cp, self.rule, self.step_count
        bc1, bc2 = 1.0 - rule.beta1**t, 1.0 - rule.beta2**t
        partials = cp.zeros(table.num * table.blocks * 2, dtype=cp.float64)
        self._k["lamb_moments"](grid, block, (*table.columns, table.counts, table.decay, f32(1.0 - rule.beta1),
                                              f32(rule.beta1), f32(1.0 - rule.beta2), f32(rule.beta2),
                                              f32(rule.eps * np.sqrt(bc2)), f32(np.sqrt(bc2) / bc1),
                                              f32(rule.weight_decay), partials))
        sums = cp.zeros(2 * self.num_tensors, dtype=cp.float64)
        index = cp.asarray(np.array([s.index for s in self.segments], dtype=np.int32))
        self._k["sum_pairs"]((table.num,), block, (partials, np.int32(table.blocks), np.int32(self.num_tensors),
                                                   index, sums))
        host = sums.get(stream=self.stream)
        self.stream.synchronize()
        ratios = rule.trust_ratios(self.sum_across_ranks(host))
        factor = cp.asarray(np.array([f32(lr * ratios[s.index]) for s in self.segments], dtype=np.float32))
        self._k["lamb_apply"](grid, block, (table.columns[0], table.columns[1], table.counts, factor))


class Zero1Device:
    """ZeRO-1 over NCCL for CUDA ranks (see the module docstring); the interface of :class:`~.zero.Zero1`.

    Args:
        comm: An NCCLComm (``stream``, ``reduce_scatter_device``, ``all_gather_device``, ``allgather_sum``).
        names: Trainable names, sorted (the packed order).
        params: DeviceBuffers of every trainable parameter (the engine's buffers).
        dtype: The reduce-scatter's element type (``distributed.allreduce_dtype`` resolved): float32, or
            float16/bfloat16 as the packed all-reduce sends them (comm/packed_allreduce.py: each gradient times
            ``1 / ranks`` rounded to the half type, summed in it, back to float32 in the shard). The parameters'
            all-gather stays float32: every rank's engine needs the update's own bits.
    """

    sharded = True
    per_rank_state = True
    averages = False

    def __init__(self, comm, names: Sequence[str], params: Sequence, rank: int, world: int, dtype: str = "float32"):
        cp = self._cp = _cupy()
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"distributed.allreduce_dtype: {dtype!r} is not float32, float16 or bfloat16")
        self.dtype, self.half, self._bf16 = dtype, dtype != "float32", np.int32(dtype == "bfloat16")
        self.comm, self.rank, self.world, self.params = comm, rank, world, list(params)
        sizes = [p.count for p in self.params]
        total = int(sum(sizes))
        self.chunk = -(-total // world)  # NCCL's reduce-scatter takes equal counts: ranges padded to world x chunk
        bounds = [min(r * self.chunk, total) for r in range(world + 1)]
        self.segments = shard_segments(names, sizes, rank, world, bounds)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.flat = cp.zeros(self.chunk * world, dtype=cp.float32)
        self.shard = cp.zeros(self.chunk, dtype=cp.float32)
        if self.half:  # the padding stays +0 (never written), a finite term of every sum
            self.flat_half = cp.zeros(self.chunk * world, dtype=cp.uint16)
            self.shard_half = cp.zeros(self.chunk, dtype=cp.uint16)
            log.info("zero-1 reduce-scatter in %s, pre-scaled by 1/ranks (distributed.allreduce_dtype)", dtype)
        module = cp.RawModule(code=_SRC, options=("--std=c++11",))
        self._pack, self._scale_square = module.get_function("pack"), module.get_function("scale_square")
        self._pack_half, self._widen_square = module.get_function("pack_half"), module.get_function("widen_square")
        self._sum, self._scale = module.get_function("sum_in_order"), module.get_function("scale")
        self._blocks = int(min(max(1, -(-self.chunk // _THREADS)), 1024))
        self._partials = cp.zeros(self._blocks, dtype=cp.float64)
        self._norm = cp.zeros(1, dtype=cp.float64)
        self._norm_sq = 0.0
        # Chunk tables (one block per 16384-element chunk of a tensor) and each tensor's place in the flat buffer.
        self._all = TensorTable(cp, tuple((p.ptr, p.count) for p in self.params))
        self._all_offsets = cp.asarray(self._all.offsets)
        base = bounds[rank]
        mine = [(self.params[s.index].ptr + 4 * s.lo, int(self.offsets[s.index]) + s.lo, s.size) for s in self.segments]
        # This rank's segments lie back to back from ``base``: their packed layout is their place in its range.
        self._mine = TensorTable(cp, tuple((m[0], m[2]) for m in mine)) if mine else None
        self._mine_offsets = cp.asarray(self._mine.offsets) if mine else None
        self._grad_views = [_Ptr(self.shard.data.ptr + 4 * (m[1] - base), m[2]) for m in mine]
        self._grads: TensorTable | None = None

    def param_ptrs(self) -> list[int]:
        """Device addresses of this rank's segments in the engine's parameter buffers."""
        return [self.params[s.index].ptr + 4 * s.lo for s in self.segments]

    def _launch_pack(self, table: TensorTable, offsets, flat, to_tensors: bool) -> None:
        self._pack((table.chunks,), (_THREADS,), (*table.args, np.int32(0), offsets, flat, np.int32(to_tensors)))

    def _grad_table(self, grads: Sequence) -> TensorTable:
        key = tuple((g.ptr, g.count) for g in grads)
        if self._grads is None or self._grads.key != key:
            if [c for _, c in key] != [p.count for p in self.params]:
                raise ValueError("zero-1: the gradients do not match the parameters' sizes")
            self._grads = TensorTable(self._cp, key)
        return self._grads

    def reduce(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> list:
        cp, stream = self._cp, self.comm.stream
        table = self._grad_table(grads)  # the parameters' layout: the same offsets in the flat buffer
        # Sync point: the engine wrote the gradients on its own stream.
        cp.cuda.runtime.deviceSynchronize()
        with stream:
            if self.half:  # pre-scaled by 1/ranks, summed in the half type, then times ranks / divisor
                self._pack_half((table.chunks,), (_THREADS,), (*table.args, np.int32(0), self._all_offsets,
                                                               self.flat_half, f32(1.0 / self.world), self._bf16))
                self.comm.reduce_scatter_device(self.flat_half.data.ptr, self.shard_half.data.ptr, self.chunk,
                                                self.dtype)
                self._widen_square((self._blocks,), (_THREADS,), (self.shard_half, self.shard, np.int64(self.chunk),
                                                                  f32(self.world / divisor), self._bf16,
                                                                  self._partials))
            else:
                self._launch_pack(table, self._all_offsets, self.flat, False)
                self.comm.reduce_scatter_device(self.flat.data.ptr, self.shard.data.ptr, self.chunk)
                self._scale_square((self._blocks,), (_THREADS,), (self.shard, np.int64(self.chunk),
                                                                  f32(1.0 / divisor), self._partials))
            self._sum((1,), (_THREADS,), (self._partials, np.int64(self._blocks), self._norm))
        norm_sq = self._norm.get(stream=stream)
        stream.synchronize()
        small = np.concatenate([norm_sq.astype(np.float64), scalars.astype(np.float64)])
        # Sync point: the global norm and the loss/stop scalars, summed in rank order on every rank.
        total = self.comm.allgather_sum(small, "zero-1 norm and scalars (nccl)")
        self._norm_sq = float(total[0])
        scalars[:] = total[1:]
        return self._grad_views

    def norm(self, mine) -> float:
        return float(np.sqrt(self._norm_sq))

    def scale(self, mine, factor: float) -> None:
        with self.comm.stream:
            self._scale((self._blocks,), (_THREADS,), (self.shard, np.int64(self.chunk), f32(factor)))

    def gather(self) -> None:
        stream = self.comm.stream
        with stream:
            if self._mine is not None:  # into this rank's range of the flat buffer
                self._launch_pack(self._mine, self._mine_offsets, self.flat[self.rank * self.chunk :], False)
            start = self.flat.data.ptr + 4 * self.rank * self.chunk
            self.comm.all_gather_device(start, self.flat.data.ptr, self.chunk)
            self._launch_pack(self._all, self._all_offsets, self.flat, True)
        # Sync point: the engine's next forward reads every parameter.
        self.comm.watched("zero-1 parameter all-gather (nccl)", stream.synchronize)

    def sum_across_ranks(self, values: np.ndarray) -> np.ndarray:
        return self.comm.allgather_sum(values, "zero-1 lamb norms")

    def names(self, trainable: Sequence[str]) -> list[str]:
        return [s.name for s in self.segments]


class _Ptr:
    """A device address and element count (the DeviceBuffer shape) for a segment of the shard."""

    def __init__(self, ptr: int, count: int):
        self.ptr, self.count = int(ptr), int(count)


def device_update(opt, segments: Sequence[Segment], param_ptrs: Sequence[int], stream, sum_across_ranks=None,
                  num_tensors: int | None = None):
    """The device update of the ``optimizer`` section over ``segments``: one :class:`DeviceUpdate`, or one per
    parameter group behind the same interface (``optim/groups.py``, the host's grouping)."""
    from ortflow.trainer.optim import build_rule, decays, grouped_update, regroup

    decay = decays([s.name for s in segments], opt.no_weight_decay)
    count = num_tensors if num_tensors is not None else len(segments)
    if not opt.groups:
        return DeviceUpdate(build_rule(opt), segments, param_ptrs, decay, stream, sum_across_ranks, count)

    def make(group, idx):
        return DeviceUpdate(build_rule(opt, group), regroup(segments, idx), [param_ptrs[i] for i in idx],
                            [decay[i] for i in idx], stream, sum_across_ranks, count)

    return grouped_update(segments, opt, make)


def _view(cp, buffer, device: int):
    """A CuPy float32 view of a device buffer (no copy); empty tensors may have a null address."""
    if buffer.count == 0:
        return cp.empty(0, dtype=cp.float32)
    memory = cp.cuda.UnownedMemory(buffer.ptr, buffer.count * 4, buffer, device)
    return cp.ndarray((buffer.count,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(memory, 0))


class AdasumDevice(AdasumExchange):
    """Adasum on CUDA ranks: :class:`~ortflow.trainer.optim.adasum_update.AdasumExchange` over the engine's device
    buffers.

    The combination is the communicator's NCCL Adasum (``NCCLComm.adasum_tensors``: the tree of comm/adasum.py on
    device buffers); gradients and parameters never leave the GPU. ``deltas`` mode keeps each parameter's value
    before the local step in a device copy (one model's worth of memory), as the host exchange does in host memory.

    Args:
        comm: An NCCLComm.
        params: DeviceBuffers of every trainable parameter (the engine's buffers, trainable order).
        mode: ``gradients`` (sgd) or ``deltas`` (adamw, lamb).
    """

    def __init__(self, comm, params: Sequence, mode: str):
        cp = self._cp = _cupy()
        super().__init__(comm, [], mode)
        self.params = list(params)
        self._views = [_view(cp, p, comm.device_index) for p in self.params]
        self._start = [cp.empty_like(v) for v in self._views] if mode == "deltas" else []

    def reduce(self, grads: Sequence, divisor: float, scalars: np.ndarray) -> list:
        local = divisor / self.comm.size  # the loop's divisor is micro-batches x ranks; a rank's own mean is local
        if self.mode == "gradients":
            # Sync point: the update's collective - Adasum of the ranks' mean gradients, plus loss and stop.
            self.comm.adasum_tensors(grads, local, scalars)
            return list(grads)
        self.comm.scale_gradients(grads, 1.0 / local)
        # Sync point: loss and stop must agree on every rank before anyone steps.
        scalars[:] = self.comm.allreduce_sum(scalars, "loss and stop")
        # Sync point: the engine's last writes to the parameters (its own stream) precede the copy.
        self._cp.cuda.runtime.deviceSynchronize()
        for start, view in zip(self._start, self._views, strict=True):
            start[...] = view
        return list(grads)

    def norm(self, mine: Sequence) -> float:
        if self.mode == "gradients":
            return self.comm.gradient_norm(mine)  # summed on the device with the Adasum result
        cp = self._cp
        total = cp.zeros((), dtype=cp.float64)
        # this rank's own gradients: the local step clips alone
        for view in (_view(cp, g, self.comm.device_index) for g in mine):
            wide = view.astype(cp.float64)
            total += cp.dot(wide, wide)
        return float(np.sqrt(float(total)))

    def scale(self, mine: Sequence, factor: float) -> None:
        self.comm.scale_gradients(mine, factor)

    def gather(self) -> None:
        if self.mode == "gradients":
            return
        cp = self._cp
        cp.cuda.runtime.deviceSynchronize()  # Sync point: the local step's kernels wrote the parameters
        for start, view in zip(self._start, self._views, strict=True):
            view -= start  # this rank's update
        # Sync point: the ranks' updates combined per tensor; identical bytes on every rank.
        self.comm.adasum_tensors(self.params, 1.0, np.zeros(0, dtype=np.float32))
        for start, view in zip(self._start, self._views, strict=True):
            view += start
        # Sync point: the engine's next forward (its own stream) reads the combined parameters.
        cp.cuda.runtime.deviceSynchronize()
