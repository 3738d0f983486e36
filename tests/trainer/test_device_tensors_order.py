"""The order a CUDA tensor-parallel rank's device work takes on its streams (:class:`DeviceTensors` with the rank's
engine stream), recorded with stand-ins for the streams and the NCCL group: the calls are made on the GPU by
tests/gpu/test_gpu_tensor.py; here, which waits come before which work."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ortflow.trainer.parallel import activations
from ortflow.trainer.parallel.activations import DeviceTensors


class _Tensor:
    """A device tensor as DeviceTensors reads it: an address, a shape, a float32 type."""

    def __init__(self, shape, ptr):
        self._shape, self._ptr = list(shape), ptr

    def shape(self):
        return self._shape

    def data_ptr(self):
        return self._ptr

    def data_type(self):
        return "tensor(float)"

    def device_name(self):
        return "cuda"


def _store(monkeypatch):
    log = []
    engine = SimpleNamespace(
        synchronize=lambda: log.append("engine waits"),
        pack=lambda buffers, ptr: log.append(f"pack {len(buffers)}"),
        unpack=lambda ptr, buffers: log.append(f"unpack {len(buffers)}"),
        add=lambda *args: log.append("add on engine"), scale=lambda *args: log.append("scale on engine"),
        zero=lambda *args: log.append("zero on engine"))
    group = SimpleNamespace(watched=lambda label, run: (log.append(f"watched: {label}"), run()))
    comm = SimpleNamespace(device_index=0, group=group,
                           tensor_sum=lambda src, dst, count, label, engine=None: log.append(
                               f"sum of {count} {'after the engine' if engine is not None else 'host-waited'}"))
    store = DeviceTensors(comm, engine)
    counter = iter(range(1000, 10**6, 1000))
    monkeypatch.setattr(store, "_new", lambda shape, dtype=np.float32: _Tensor(shape, next(counter)))
    monkeypatch.setattr(activations, "OrtValue", _Tensor)
    return store, log


def test_sums_adds_and_scalings_are_queued_behind_the_engine_without_a_host_wait(monkeypatch):
    store, log = _store(monkeypatch)
    x = _Tensor([2, 3], 8)
    store.sum(x, "activation sum")
    store.add(x, x)
    store.scale(x, 0.5)
    store.zeros_like(x)
    assert log == ["sum of 6 after the engine", "add on engine", "scale on engine", "zero on engine"]


def test_the_host_waits_for_the_engine_before_a_training_module_call_and_a_host_read(monkeypatch):
    store, log = _store(monkeypatch)
    module = SimpleNamespace(input_names=lambda: ["x"])
    part = SimpleNamespace(prepared=lambda train: module)
    monkeypatch.setattr(activations, "call_module", lambda *args: log.append("module call") or [_Tensor([1], 9)])
    store._outputs[(id(module), True, ((2,),))] = [([1], np.float32)]
    store.call(part, True, {"x": _Tensor([2], 7)})
    assert log == ["watched: tensor-parallel work on the engine stream", "engine waits", "module call"]


def test_replicated_gradient_sums_are_packed_into_one_sum_then_the_host_waits(monkeypatch):
    store, log = _store(monkeypatch)
    buffers = [SimpleNamespace(ptr=16 * k, count=4) for k in range(1, 4)]
    store.sum_into(buffers, "replicated-gradient sum")
    assert log == ["pack 3", "sum of 12 after the engine", "unpack 3",
                   "watched: tensor-parallel work on the engine stream", "engine waits"]
