"""Where a tensor-parallel rank keeps the tensors its pieces pass each other within a micro-batch: the activations,
their gradients, and the sums of both over the tensor-parallel group.

* :class:`HostTensors` (CPU ranks): numpy arrays, as the CPU engine takes and returns them; a sum all-gathers the
  ranks' parts over the process group and adds them in rank order.
* :class:`DeviceTensors` (CUDA ranks): the engine's own device tensors (``OrtValue``): the batch is copied to the GPU
  once, every engine call takes and returns device tensors, and a sum all-gathers the parts with NCCL and adds them in
  rank order on the GPU (:meth:`~ortflow.trainer.comm.nccl.NCCLComm.tensor_sum`). Nothing crosses to the host within a
  micro-batch except the loss; a pipeline x tensor-parallel stage hands what crosses its cut to the pipeline as host
  arrays (a stage of one engine module on a CUDA rank with NCCL calls its module through a DeviceTensors too, and its
  messages stay device tensors: :class:`~ortflow.trainer.comm.device_pipe.DevicePipe`). The rank's engine stream
  (:class:`~ortflow.trainer.comm.nccl.EngineStream`, where the pieces that keep their activations run their calls)
  orders the work: the adds and scalings are queued on it, a sum's NCCL stream waits for it and it for
  the sum, all on the GPU; the host waits for it (under the watchdog) before a training module's call (another
  stream, and the arena the sessions share), before it reads or copies in a tensor, and once after each backward.

Both add in the same order with float32 adds, so a sum has the same bits on every rank and on both devices.
"""

from __future__ import annotations

import numpy as np

from ortflow.engine import OrtValue, call_module
from ortflow.trainer.comm import Communicator
from ortflow.trainer.comm.nccl import DeviceBuffer
from ortflow.trainer.rank_model import EnginePart


class HostTensors:
    """CPU ranks: numpy arrays (see the module docstring)."""

    def __init__(self, comm: Communicator, rank: int, size: int):
        self.comm, self.rank, self.size = comm, rank, size

    def adopt(self, values: dict) -> dict:
        """``values`` (host arrays from the loader or the pipeline) as the engine takes them."""
        return dict(values)

    def call(self, part: EnginePart, train: bool, feeds: dict) -> list:
        return part.call(train, feeds)

    def settle(self) -> None:
        """Nothing to wait for: the CPU engine's calls return when their work is done."""

    def sum(self, x: np.ndarray, label: str) -> np.ndarray:
        """``x`` summed over the group, added in rank order."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        flat = np.zeros(self.size * x.size, np.float32)
        flat[self.rank * x.size : (self.rank + 1) * x.size] = x.reshape(-1)
        self.comm.all_gather(flat, [x.size] * self.size, label)
        parts = flat.reshape(self.size, -1)
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total.reshape(x.shape)

    def sum_into(self, buffers: list[np.ndarray], label: str) -> None:
        """Gradient buffers of the engine, each replaced in place by its sum over the group (added in rank order),
        packed into one all-gather."""
        if not buffers:
            return
        total = self.sum(np.concatenate([b.reshape(-1) for b in buffers]), label)
        start = 0
        for b in buffers:
            b[...] = total[start : start + b.size].reshape(b.shape)
            start += b.size

    def reshaped_like(self, x: np.ndarray, like: np.ndarray) -> np.ndarray:
        """``x``'s values in ``like``'s shape (row-major order)."""
        return x.reshape(like.shape)

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        """``x * factor`` in ``x``'s float type, a new array."""
        return x * np.asarray(factor, dtype=x.dtype)

    def zeros_like(self, x: np.ndarray) -> np.ndarray:
        return np.zeros_like(x)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def own(self, x: np.ndarray) -> np.ndarray:
        """A copy that later adds may not alias (an engine output can be a view of its buffers)."""
        return np.array(x)

    def scalar(self, x) -> float:
        return float(x)

    def host(self, x: np.ndarray) -> np.ndarray:
        return x


class DeviceTensors:
    """CUDA ranks: the engine's device tensors (see the module docstring).

    Args:
        comm: The NCCLComm of the tensor-parallel group, or of the pipeline for a whole stage (its stream and device).
        engine: The rank's engine stream (None: every step waits on the host).
        label: What the host waits for in :meth:`settle` (a stall report names it).
        collective: Whether every rank of ``comm`` settles alike (a tensor-parallel group: the wait counts among its
            collectives), or not (a pipeline stage: a point-to-point wait for the watchdog).
    """

    def __init__(self, comm, engine=None, label: str = "tensor-parallel work on the engine stream",
                 collective: bool = True):
        self.comm, self.device, self.engine, self.label = comm, comm.device_index, engine, label
        self._collective = collective
        self._outputs: dict[tuple, list[tuple[list[int], np.dtype]]] = {}  # call -> its outputs' shapes and types

    def settle(self) -> None:
        """The host waits for the engine stream (under the watchdog: a stalled sum queued on it shows here)."""
        if self.engine is not None:
            group = self.comm.group
            if self._collective:
                group.watched(self.label, self.engine.synchronize)
            else:
                group.watched_peer(self.label, self.engine.synchronize)

    def _new(self, shape, dtype=np.float32) -> OrtValue:
        return OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cuda", self.device)

    def call(self, part: EnginePart, train: bool, feeds: dict) -> list[OrtValue]:
        """One engine call of ``part`` on device tensors, its outputs written on the GPU.

        The engine puts an output on the device only into a tensor the caller allocated there: the first call of a
        part with given input shapes lets the engine allocate (on the host) and records its outputs' shapes and
        types, every later one hands it device tensors of those. The training and eval calls of a piece compute
        output shapes from input shapes alone (no data-dependent shape in a transformer's pieces).
        """
        module = part.prepared(train)
        self.settle()  # Sync point: the module computes on its own stream, and may reuse the arena's freed memory
        inputs = [self.to_device(feeds[name]) for name in module.input_names()]
        key = (id(module), train, tuple(tuple(x.shape()) for x in inputs))
        known = self._outputs.get(key)
        outputs = [self._new(shape, dtype) for shape, dtype in known] if known is not None else []
        results = call_module(module, train, inputs, outputs)
        if known is None:
            hosts = [r.numpy() for r in results]
            self._outputs[key] = [(list(h.shape), h.dtype) for h in hosts]
            results = [self.to_device(h) for h in hosts]
        return results

    def to_device(self, x) -> OrtValue:
        """A host array, or a tensor the engine left on the host, as a tensor on this rank's GPU."""
        if isinstance(x, OrtValue):
            if x.device_name() == "cuda":
                return x
            x = x.numpy()
        self.settle()  # Sync point: the copy runs on the legacy stream, into memory the engine stream may still read
        return OrtValue.ortvalue_from_numpy(np.asarray(x, order="C"), "cuda", self.device)  # 0-d stays 0-d

    def adopt(self, values: dict) -> dict:
        """``values`` on this rank's GPU, each copied once (the batch, or what a pipeline stage received)."""
        return {name: self.to_device(x) for name, x in values.items()}

    def sum(self, x: OrtValue, label: str) -> OrtValue:
        """``x`` summed over the group on the GPU, added in rank order: a new device tensor."""
        x = self.to_device(x)
        if x.data_type() != "tensor(float)":
            raise TypeError(f"{label}: tensor-parallel sums take float32 tensors, not {x.data_type()}")
        out = self._new(x.shape())
        count = int(np.prod(x.shape(), dtype=np.int64))
        self.comm.tensor_sum(x.data_ptr(), out.data_ptr(), count, label, self.engine)
        return out

    def sum_into(self, buffers: list, label: str) -> None:
        """Engine gradient buffers (:class:`~ortflow.trainer.comm.nccl.DeviceBuffer` s), each replaced in place by its
        sum over the group, added in rank order on the GPU: packed into one tensor on the engine stream, one sum, and
        unpacked (then the host waits); without an engine stream, one sum each (the all-gather reads a buffer before
        the adds write it)."""
        if self.engine is None or len(buffers) < 2:
            self.settle()  # Sync point: the buffers were last written on the engine stream
            for buffer in buffers:
                self.comm.tensor_sum(buffer.ptr, buffer.ptr, buffer.count, label)
            return
        total = sum(b.count for b in buffers)
        packed = self._new((total,))
        self.engine.pack(buffers, packed.data_ptr())
        self.comm.tensor_sum(packed.data_ptr(), packed.data_ptr(), total, label, self.engine)
        self.engine.unpack(packed.data_ptr(), buffers)
        self.settle()  # Sync point: the update reads the sums on other streams (and packed is read until then)

    def reshaped_like(self, x: OrtValue, like: OrtValue) -> OrtValue:
        """``x``'s values in ``like``'s shape (row-major order): ``x`` itself where the shapes agree, else a copy on
        the GPU (an engine tensor has no view in another shape)."""
        x = self.to_device(x)
        shape = list(like.shape())
        if list(x.shape()) == shape:
            return x
        if x.data_type() != "tensor(float)":
            raise TypeError(f"tensor-parallel gradients are float32 tensors, not {x.data_type()}")
        count = int(np.prod(shape, dtype=np.int64))
        if count != int(np.prod(x.shape(), dtype=np.int64)):
            raise ValueError(f"gradients of one tensor hold {x.shape()} and {shape} values")
        out = self._new(shape)
        if self.engine is not None:
            self.engine.pack([DeviceBuffer(x.data_ptr(), count, "reshaped gradient")], out.data_ptr())
        else:
            self.comm.scale_device(x.data_ptr(), out.data_ptr(), count, 1.0)  # x * 1 is x, bit for bit
        return out

    def scale(self, x: OrtValue, factor: float) -> OrtValue:
        """``x * factor`` in float32 on the GPU: a new device tensor."""
        x = self.to_device(x)
        if x.data_type() != "tensor(float)":
            raise TypeError(f"tensor-parallel gradient scaling takes float32 tensors, not {x.data_type()}")
        out = self._new(x.shape())
        count = int(np.prod(x.shape(), dtype=np.int64))
        if self.engine is not None:
            self.engine.scale(x.data_ptr(), out.data_ptr(), count, factor)
        else:
            self.comm.scale_device(x.data_ptr(), out.data_ptr(), count, factor)
        return out

    def zeros_like(self, x: OrtValue) -> OrtValue:
        if self.engine is None:
            return OrtValue.ortvalue_from_numpy(np.zeros(x.shape(), np.float32), "cuda", self.device)
        out = self._new(x.shape())
        self.engine.zero(out.data_ptr(), int(np.prod(x.shape(), dtype=np.int64)))
        return out

    def add(self, a: OrtValue, b: OrtValue) -> OrtValue:
        """``a + b`` in float32 on the GPU (NCCL stream, waited for: the engine reads it next)."""
        a, b = self.to_device(a), self.to_device(b)
        if a.shape() != b.shape() or a.data_type() != "tensor(float)" or b.data_type() != "tensor(float)":
            raise TypeError(f"gradients of one tensor differ: {a.shape()} {a.data_type()}, {b.shape()} {b.data_type()}")
        out = self._new(a.shape())
        count = int(np.prod(a.shape(), dtype=np.int64))
        if self.engine is not None:
            self.engine.add(a.data_ptr(), b.data_ptr(), out.data_ptr(), count)
        else:
            self.comm.add_device(a.data_ptr(), b.data_ptr(), out.data_ptr(), count)
        return out

    def own(self, x: OrtValue) -> OrtValue:
        return self.to_device(x)  # an engine output owns its buffer; later adds write new tensors

    def scalar(self, x: OrtValue) -> float:
        self.settle()  # Sync point: the host reads it
        return float(x.numpy().item()) if isinstance(x, OrtValue) else float(x)

    def host(self, x) -> np.ndarray:
        self.settle()  # Sync point: the host reads it
        return x.numpy() if isinstance(x, OrtValue) else np.asarray(x)


def activation_store(buffers, comm: Communicator, rank: int, size: int) -> HostTensors | DeviceTensors:
    """Where a tensor-parallel rank keeps its activations: beside its engine's buffers
    (:mod:`ortflow.trainer.comm.engine_buffers`), host arrays or the GPU's tensors."""
    return DeviceTensors(comm, buffers.engine_stream()) if buffers.on_device else HostTensors(comm, rank, size)
