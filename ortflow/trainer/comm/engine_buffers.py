"""Where the engine keeps a rank's parameters and gradients, and how ortflow reads and writes them there.

The CPU engine hands out its buffers as writable host arrays; the CUDA engine keeps them on the GPU, where ortflow
addresses them as :class:`~ortflow.trainer.comm.nccl.DeviceBuffer` s and works on them with CuPy on the NCCL stream.
A rank model holds one of the two (:func:`engine_buffers`) and is written once against it: the gradient buffers the
exchange reads, the parameter buffers the update writes, checkpoint values copied in, and the in-rank passes over
them (a tied weight's gradients summed, its new value copied to the pieces that read it).

Both pin the buffers when first asked: the engine allocates them once with its module, so they stay valid for its
whole life, whatever a profiling module later makes the state return (:mod:`ortflow.trainer.profiling`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnxruntime

from ortflow.trainer import arena
from ortflow.trainer.comm.nccl import DeviceBuffer, EngineStream


class HostBuffers:
    """The CPU engine's buffers: writable host views (no copy)."""

    on_device = False

    def replica_options(self, options: onnxruntime.SessionOptions, state) -> onnxruntime.SessionOptions:
        """A whole model's session: from an arena whose first chunk holds every gradient, so the engine allocates
        them back to back and the exchange reduces them as one buffer (:func:`.arena.use_gradient_arena`)."""
        grad_bytes = 4 * sum(p.data.size for _, p in state.parameters if p.requires_grad)  # fp32 gradients
        return arena.use_gradient_arena(options, grad_bytes)

    def stage_options(self, options: onnxruntime.SessionOptions) -> onnxruntime.SessionOptions:
        """A stage's or a piece's sessions: one arena they share (:func:`ortflow.trainer.arena.use_stage_arena`)."""
        return arena.use_stage_arena(options)

    def gradients(self, state) -> dict[str, np.ndarray]:
        """Every trainable parameter's gradient buffer in ``state``, by name."""
        return {n: p.grad for n, p in state.parameters if p.requires_grad}

    def parameters(self, state, names: list[str]) -> list[np.ndarray]:
        """1-D views of the named parameters' buffers (what the update writes)."""
        return [state.parameters[n].data.reshape(-1) for n in names]

    def write(self, param, value: np.ndarray) -> None:
        """A checkpoint's value into a parameter's buffer."""
        param.data[...] = value  # the CPU engine's buffers are writable views

    @contextlib.contextmanager
    def passes(self) -> Iterator[None]:
        """Bracket in-rank work on the buffers (nothing to wait for: the engine's calls have returned)."""
        yield

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """An array to compute on in place: a host buffer is one."""
        return buffer

    def engine_stream(self) -> None:
        """None: the CPU engine's calls return when their work is done."""
        return None


class DeviceBuffers:
    """The CUDA engine's buffers: device addresses read from the engine's OrtValues, viewed through CuPy.

    Args:
        comm: The NCCL group whose stream runs the in-rank passes (the replicas' group).
        device_index: This rank's GPU among the visible ones.
    """

    on_device = True

    def __init__(self, comm, device_index: int = 0):
        self.comm = comm
        self.device_index = device_index

    def replica_options(self, options: onnxruntime.SessionOptions, state) -> onnxruntime.SessionOptions:
        return options  # the CUDA provider's own arena

    def stage_options(self, options: onnxruntime.SessionOptions) -> onnxruntime.SessionOptions:
        """A stage's or a piece's sessions: one CUDA arena for all of them
        (:func:`ortflow.trainer.arena.use_device_stage_arena`)."""
        return arena.use_device_stage_arena(options, self.device_index)

    def gradients(self, state) -> dict[str, DeviceBuffer]:
        # On CUDA ``Parameter.grad`` returns a host copy, so the addresses come from the gradients' OrtValues.
        found = {}
        for name, param in state.parameters:
            if not param.requires_grad:
                continue
            grad = state._state.get_parameter(name).grad  # the engine's C OrtValue (no copy)
            if grad.data_type() != "tensor(float)":
                raise TypeError(f"gradient of {name} is {grad.data_type()}: only float32 gradients are supported")
            found[name] = _device_buffer(grad, name)
        return found

    def parameters(self, state, names: list[str]) -> list[DeviceBuffer]:
        return [_device_buffer(state._state.get_parameter(n).data, n) for n in names]  # the engine's OrtValues

    def write(self, param, value: np.ndarray) -> None:
        param.data = np.ascontiguousarray(value)  # copied into the engine's device buffer

    @contextlib.contextmanager
    def passes(self) -> Iterator[None]:
        """Work on the device buffers on the NCCL stream, between two waits (the engines write and read those
        buffers on their own streams)."""
        comm = self.comm
        comm._cp.cuda.runtime.deviceSynchronize()  # Sync point: the engines' last writes to these buffers
        with comm.stream:
            yield
        comm.stream.synchronize()  # Sync point: the exchange or the next forward reads them on another stream

    def view(self, buffer: DeviceBuffer):
        """A CuPy view of a device buffer (no copy)."""
        return self.comm._device_view(buffer)

    def engine_stream(self) -> EngineStream:
        """The rank's stream for the engine's separate forward and backward calls and the gradient sums behind them
        (:class:`~ortflow.trainer.comm.nccl.EngineStream`)."""
        return self.comm.engine_stream()


def engine_buffers(device: str, comm) -> HostBuffers | DeviceBuffers:
    """The buffers of an engine on ``device`` (``cpu`` or ``cuda:N``); ``comm``: the NCCL group of a CUDA rank."""
    return HostBuffers() if device == "cpu" else DeviceBuffers(comm, int(device.partition(":")[2] or 0))


def _device_buffer(value, name: str) -> DeviceBuffer:
    return DeviceBuffer(value.data_ptr(), int(np.prod(value.shape(), dtype=np.int64)), name)
