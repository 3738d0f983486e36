"""Test-only rank entry: the real 1F1B schedule (:func:`pipeline_step`) over a real :class:`DevicePipe`, made by the
real :meth:`NCCLComm.device_pipe` over the real MPI process group and its watchdog, where only the GPU is a stand-in.

Usage: mpiexec -n 2 python device_pipe_rank.py MODE MICRO_BATCHES FOLDER [--device-syncs] [--alloc-syncs], MODE one of:
  keep      - stage 0 keeps its activations: its calls are queued on the engine stream and return at once (the NCCL
              sends wait for the engine stream's events), as a kept forward with device sends does;
  recompute - every call of both stages first waits for the engine stream under the watchdog and computes before it
              returns, as a whole stage's engine call through ``DeviceTensors`` does.

The stand-ins: a CUDA stream is a thread that runs what is queued on it in order (a wait for an event blocks it until
the event's stream has passed the event); an NCCL 2-rank communicator is a pair of named pipes between the two
processes in FOLDER, a send's payload on one and the receiver's acknowledgement on the other, so that a send completes
only once its receive has taken it (NCCL's point-to-point kernels wait for their peer). Every stream must be made
non-blocking (a blocking stream would be ordered with the legacy default stream). Each stage checks every tensor it
received against what the other computed, and prints one line: ``rank R MODE ok: ...``.

``--device-syncs``: every engine call starts with an implicit device-wide synchronization (the host waits for every
stream of its GPU, the NCCL ones included: what a cudaFree, a lazily loaded kernel or a pinned host allocation inside a
native call does); ``--alloc-syncs``: so does every allocation of a new device tensor for a received message.
"""

import itertools
import os
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from ortflow.trainer.comm.mpi import MPIComm
from ortflow.trainer.comm.nccl import EngineStream, NCCLComm
from ortflow.trainer.parallel.schedule import pipeline_step

mode, micro, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
device_syncs, alloc_syncs = "--device-syncs" in sys.argv, "--alloc-syncs" in sys.argv
_ptrs = itertools.count(1)
_memory: dict[int, np.ndarray] = {}  # device address -> the bytes behind it
_ITEM = {7: 4, 6: 2, 8: 8, 4: 8, 2: 4, 0: 1, 1: 1}  # NCCL type code -> bytes per element


class Event:
    def __init__(self, stream, position: int):
        self.stream, self.position = stream, position

    @property
    def done(self) -> bool:
        return self.stream.done >= self.position

    def wait(self) -> None:
        with self.stream.cond:
            self.stream.cond.wait_for(lambda: self.done)


class Stream:
    """A CUDA stream stand-in: a thread runs the queued operations in order."""

    made: list = []
    by_ptr: dict = {}

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.non_blocking, self.null, self.ptr = non_blocking, null, next(_ptrs)
        self.cond = threading.Condition()
        self.ops: list = []
        self.queued = self.done = 0
        Stream.by_ptr[self.ptr] = self
        if not null:
            Stream.made.append(self)
        threading.Thread(target=self._run, daemon=True).start()

    def queue(self, op) -> None:
        with self.cond:
            self.ops.append(op)
            self.queued += 1
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.ops)
                op = self.ops[0]
            op()
            with self.cond:
                self.ops.pop(0)
                self.done += 1
                self.cond.notify_all()

    def record(self) -> Event:
        with self.cond:
            return Event(self, self.queued)

    def wait_event(self, event: Event) -> None:
        self.queue(event.wait)

    def synchronize(self) -> None:
        with self.cond:
            target = self.queued
            self.cond.wait_for(lambda: self.done >= target)

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


Stream.null = Stream(null=True)


class Device:
    def __init__(self, index: int):
        self.index = index

    def use(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class Array:
    """``cupy.zeros``'s stand-in: only ``.data.ptr``."""

    def __init__(self, count: int):
        self.values = np.zeros(count, np.float32)
        ptr = next(_ptrs)
        _memory[ptr] = self.values.view(np.uint8)
        self.data = type("Data", (), {"ptr": ptr})()


class Cupy:
    float32 = np.float32
    cuda = type("cuda", (), {"Stream": Stream, "Device": Device})

    @staticmethod
    def zeros(count: int, dtype=None) -> Array:
        return Array(count)


class Communicator:
    """``NcclCommunicator(2, uid, rank)``: named pipes between the pair in ``folder`` (payloads one way, the
    receiver's acknowledgements the other); a send completes once its receive has taken it."""

    def __init__(self, size: int, uid, rank: int):
        assert size == 2, size
        self.rank, self.direction = rank, None
        pipes = {d: folder / f"{uid}-{d}" for d in ("01", "10")}
        for path in pipes.values():
            try:
                os.mkfifo(path)
            except FileExistsError:
                pass
        mine, theirs = ("01", "10") if rank == 0 else ("10", "01")
        self._out, self._in = os.open(pipes[mine], os.O_RDWR), os.open(pipes[theirs], os.O_RDWR)
        os.write(self._out, b"h")  # NCCL's init waits for both ranks
        assert _read(self._in, 1) == b"h"

    def _one_way(self, kind: str) -> None:
        assert self.direction in (None, kind), "a pipeline link carries one direction only"
        self.direction = kind

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert peer == 1 - self.rank
        self._one_way("send")
        nbytes = count * _ITEM[dtype]

        def run():
            os.write(self._out, _memory[ptr][:nbytes].tobytes())
            assert _read(self._in, 1) == b"a"  # the receive took it

        Stream.by_ptr[stream].queue(run)

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert peer == 1 - self.rank
        self._one_way("recv")
        nbytes = count * _ITEM[dtype]

        def run():
            _memory[ptr][:nbytes] = np.frombuffer(_read(self._in, nbytes), np.uint8)
            os.write(self._out, b"a")

        Stream.by_ptr[stream].queue(run)


def _read(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += os.read(fd, n - len(data))
    return data


class Nccl:
    NCCL_FLOAT32 = 7
    NcclCommunicator = Communicator

    @staticmethod
    def get_unique_id():
        return uuid.uuid4().hex


class Tensor:
    """An engine device tensor stand-in (``OrtValue``'s calls that the pipe makes)."""

    def __init__(self, values: np.ndarray):
        self.values = np.ascontiguousarray(values, dtype=np.float32)
        self.ptr = next(_ptrs)
        _memory[self.ptr] = self.values.reshape(-1).view(np.uint8)

    def shape(self):
        return list(self.values.shape)

    def data_type(self) -> str:
        return "tensor(float)"

    def data_ptr(self) -> int:
        return self.ptr


SHAPE = (16, 1024)  # 64 KiB per message: a named pipe's whole buffer


def batch(i: int) -> np.ndarray:
    return np.full(SHAPE, float(i + 1), np.float32) + np.arange(SHAPE[1], dtype=np.float32) / SHAPE[1]


class Stage:
    """A stage's body stand-in: activation = 2 x + 1 (stage 0), loss = sum, its gradient 3 x activation (stage 1)."""

    def __init__(self, group, pipe, engine: EngineStream):
        self.stage, self.num_stages, self.messages, self.engine = group.rank, group.size, pipe, engine
        self.last = self.stage == self.num_stages - 1
        self.receives = ("h",) if self.last else ()
        self.sends = () if self.last else ("h",)
        self.group, self.checked, self.grad_sum = group, 0, 0.0

    def _call(self) -> None:
        """An engine call's start; with ``--device-syncs`` it waits for every stream of this rank first."""
        if device_syncs:
            device_synchronize()

    def _settle(self) -> None:
        self.group.watched_peer("pipeline stage work on the engine stream", self.engine.synchronize)

    def forward(self, feeds: dict) -> list:
        self._call()
        x = Tensor(feeds["x"])  # the batch copied in
        out = Tensor(np.empty(SHAPE, np.float32))
        if mode == "keep":  # queued on the engine stream, returned before it ran
            self.engine.after_host_copies()
            def compute():
                out.values[...] = 2 * x.values + 1

            self.engine.stream.queue(compute)
            return [out]
        self._settle()
        out.values[...] = 2 * x.values + 1
        return [out]

    def backward(self, feeds: dict, grads):
        i = int(feeds["i"])
        self._call()
        if self.last:
            self._settle()
            h = feeds["h"].values.copy()
            assert np.array_equal(h, 2 * batch(i) + 1), f"mb{i}: stage 1 received another activation"
            self.checked += 1
            self._settle()
            return float(h.sum()), [Tensor(3 * h)]
        (g,) = grads
        expected = 3 * (2 * batch(i) + 1)

        def check():
            assert np.array_equal(g.values, expected), f"mb{i}: stage 0 received another gradient"
            self.grad_sum += float(g.values.sum())
            self.checked += 1

        if mode == "keep":
            self.engine.stream.queue(check)
        else:
            self._settle()
            check()
        return 0.0, []


def device_synchronize() -> None:
    """What an implicit device-wide synchronization does (a cudaFree, a lazily loaded kernel, a pinned allocation):
    the host waits for every stream of this rank's GPU, the NCCL ones included. (On a GPU that is a native call outside
    the watchdog; here it waits under it, so that a stall ends the job with a message instead of the test's timeout.)"""
    def wait_all():
        for stream in Stream.made:
            stream.synchronize()

    world.watched_peer("an implicit device synchronization", wait_all)


allocated = []


def new_tensor(shape, dtype) -> Tensor:
    allocated.append(shape)
    if alloc_syncs:
        device_synchronize()
    return Tensor(np.empty(shape, dtype))


world = MPIComm(folder / ".ranks", float(os.environ.get("COLLECTIVE_TIMEOUT_S", "20")))
group = world.split(0, "pipeline group")
comm = object.__new__(NCCLComm)
comm._cp, comm._nccl, comm.group, comm.rank, comm.size, comm.device_index = Cupy, Nccl, group, group.rank, 2, 0
engine = EngineStream(Cupy, 0)
pipe = comm.device_pipe(engine)
pipe._new = new_tensor
after_links = world.watchdog.seq
stage = Stage(group, pipe, engine)
steps = 2
for step in range(steps):
    batches = iter({"x": batch(i), "i": np.array(i)} for i in range(micro))
    stats = pipeline_step(stage, batches, micro)
    engine.synchronize()
    assert stage.checked == micro * (step + 1), (stage.checked, micro)
    world.barrier(f"step {step}")
assert all(s.non_blocking for s in Stream.made), "a stream of the pipe or the engine is a blocking stream"
print(f"rank {world.rank} {mode} ok: {stage.checked} micro-batches checked, {pipe.sent} sent, {pipe.received} received,"
      f" collective #{after_links} after the links, #{world.watchdog.seq} at the end, {len(allocated)} received"
      f" tensor(s) allocated", flush=True)
world.close()
