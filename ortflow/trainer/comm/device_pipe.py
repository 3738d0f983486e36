"""A CUDA pipeline stage's messages over NCCL, device to device: each direction between two neighbouring stages is a
2-rank NCCL communicator with a stream of its own on both ranks (:meth:`ortflow.trainer.comm.nccl.NCCLComm.device_pipe`
makes them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ortflow.trainer.comm.communicator import Communicator

#: Engine tensor type -> (numpy type of a tensor allocated for it, NCCL type code from nccl.h): what a pipeline message
#: can carry (a point-to-point transfer copies bytes; the type only counts them). bfloat16 is not in it: the engine's
#: Python binding allocates tensors by numpy type only.
P2P_TYPES = {"tensor(float)": (np.float32, 7), "tensor(float16)": (np.float16, 6), "tensor(double)": (np.float64, 8),
             "tensor(int64)": (np.int64, 4), "tensor(int32)": (np.int32, 2), "tensor(int8)": (np.int8, 0),
             "tensor(uint8)": (np.uint8, 1), "tensor(bool)": (np.bool_, 1)}


@dataclass
class PipeLink:
    """One direction between two neighbouring stages on one of its ranks: the pair's 2-rank NCCL communicator, this
    rank's stream for it (only sends, or only receives), and the other rank's place in the communicator."""

    comm: object
    stream: object
    peer: int
    name: str = ""


class DevicePipe:
    """A CUDA pipeline stage's messages (activations forward, their gradients back) over NCCL, device to device.

    The schedule calls it as it calls the process group (:mod:`ortflow.trainer.parallel.schedule`), with the same host
    semantics: :meth:`send` queues and returns; :meth:`recv` returns once the tensor has arrived (the host waits under
    the watchdog as for a point-to-point message, so a stalled peer is named); :meth:`wait_sends` waits for every
    queued send. A message's header (shape, type) goes over the process group first, so the receiver has a device
    tensor of that shape and type for the payload to land in.

    Ordering on the GPU: a send's stream waits for an event of the rank's engine stream (a kept call's outputs are
    written there), then sends; a host array or a training module's host output becomes a device tensor through the
    engine's binding, whose copy has completed when it returns (a copy and a wait on the legacy default stream), so
    the NCCL streams never wait for the legacy stream (which waits for every blocking stream of the device). A
    receive's stream waits for an event of the engine stream before NCCL writes into its tensor (a new one, or one
    handed back by :meth:`recycle`, which queued engine work may still read). A sent tensor is held until its send
    stream has passed it: dropped once its event is done, else at :meth:`wait_sends`, which synchronizes the
    send streams and then the engine stream (the step's queued engine work: before the exchange and before any other
    session's call).

    Args:
        cupy: The cupy module (its streams, events and the legacy default stream).
        nccl: ``cupy.cuda.nccl``.
        group: The pipeline's process group (headers, the watchdog, its rank is the stage).
        sends: Next or previous stage -> the :class:`PipeLink` this rank sends to it on.
        receives: Previous or next stage -> the :class:`PipeLink` this rank receives from it on.
        engine: The rank's :class:`~ortflow.trainer.comm.nccl.EngineStream` (None: no engine call is queued on one).
        device_index: This rank's GPU.
        new_tensor: ``(shape, numpy type) -> device tensor`` (default: an ``OrtValue`` on this GPU).
    """

    def __init__(self, cupy, nccl, group: Communicator, sends: dict, receives: dict, engine: object | None,
                 device_index: int, new_tensor: Callable | None = None):
        self._cp, self._nccl, self.group = cupy, nccl, group
        self._sends, self._receives, self.engine = sends, receives, engine
        self.device_index = device_index
        self._new = new_tensor or self._ortvalue
        self._pending: list[tuple[object, object, int]] = []  # (sent tensor, its send's event, bytes), in send order
        self._spare: dict[tuple, list] = {}  # (shape, type) -> received tensors the schedule is done with
        #: Messages and bytes sent and received over NCCL since the start (the trainer logs them at the end).
        self.sent, self.received, self.sent_bytes, self.received_bytes = 0, 0, 0, 0

    def _ortvalue(self, shape, dtype):
        from onnxruntime import OrtValue  # the engine's tensors; ortflow.engine has imported it on every rank

        return OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cuda", self.device_index)

    @property
    def host(self) -> Communicator:
        """The process group (a tied gradient's sum goes over it, host to host)."""
        return self.group

    def _link(self, links: dict, peer: int, what: str) -> PipeLink:
        if peer not in links:
            raise RuntimeError(f"stage {self.group.rank} has no NCCL link to {what} stage {peer} (its neighbours: "
                               f"{sorted(links)})")
        return links[peer]

    def send(self, tensor, dest: int, tag: int) -> None:
        """Queue ``tensor`` (a device ``OrtValue``) to stage ``dest``; the header goes at once, the payload when the
        GPU has written it and ``dest`` receives it. The tensor is held until the send has passed it."""
        self.release_sent()
        link = self._link(self._sends, dest, "send to")
        kind = P2P_TYPES.get(tensor.data_type())
        if kind is None:
            raise TypeError(f"a pipeline message cannot carry {tensor.data_type()} (it carries {sorted(P2P_TYPES)})")
        shape = tuple(int(d) for d in tensor.shape())
        count = int(np.prod(shape, dtype=np.int64))
        self.group.send_object((shape, tensor.data_type()), dest, tag)
        progress = getattr(self.group, "release_sent", None)
        if progress is not None:  # MPI moves the header on now, not only at this rank's next MPI call
            progress()
        stream = link.stream
        if self.engine is not None:
            stream.wait_event(self.engine.record())  # a kept call wrote it on the engine stream
        if count:
            link.comm.send(tensor.data_ptr(), count, kind[1], link.peer, stream.ptr)
        nbytes = count * np.dtype(kind[0]).itemsize
        self._pending.append((tensor, stream.record(), nbytes))
        self.sent, self.sent_bytes = self.sent + 1, self.sent_bytes + nbytes

    def recv(self, source: int, tag: int, label: str):
        """The next tensor stage ``source`` sent, in a device tensor (one of its shape and type handed back by
        :meth:`recycle`, else a new one); returns once it has arrived (the host waits under the watchdog)."""
        link = self._link(self._receives, source, "receive from")
        shape, data_type = self.group.recv_object(source, tag, label)
        kind = P2P_TYPES[data_type]
        spare = self._spare.get((tuple(shape), data_type))
        # No allocation between a message's header and its receive once the tensors of the first messages are back
        # (:meth:`recycle`): an allocation may synchronize the whole GPU, waiting for this rank's send, whose peer may
        # be doing the same before it receives (tests/trainer/test_device_pipe_mpi.py).
        tensor = spare.pop() if spare else self._new(shape, kind[0])
        count = int(np.prod(shape, dtype=np.int64))
        stream = link.stream
        if self.engine is not None:
            stream.wait_event(self.engine.record())  # its memory may be a freed tensor's that queued engine work reads
        if count:
            link.comm.recv(tensor.data_ptr(), count, kind[1], link.peer, stream.ptr)
        self.group.watched_peer(label, stream.synchronize, source)  # Sync point: the engine reads it next
        self.release_sent()  # a peer that sent has often taken what was sent to it
        self.received, self.received_bytes = self.received + 1, self.received_bytes + count * np.dtype(kind[0]).itemsize
        return tensor

    def recycle(self, tensors) -> None:
        """Received tensors whose backward pass has been called (nothing reads them after it but work already queued):
        the next receives of the same shape and type write into them. Safe on the GPU: a receive's stream waits for
        the engine stream before NCCL writes, and the training modules' calls return when their work is done."""
        for tensor in tensors:
            key = (tuple(int(d) for d in tensor.shape()), tensor.data_type())
            self._spare.setdefault(key, []).append(tensor)

    def release_sent(self) -> None:
        """Drop the sent tensors whose sends have completed (a non-blocking query of their events, in send order per
        stream: a later send on a stream completes after an earlier one)."""
        self._pending = [p for p in self._pending if not p[1].done]

    def pending_send_bytes(self) -> int:
        """Bytes of the sent tensors this rank still holds (sends not known to be done)."""
        return sum(n for _, _, n in self._pending)

    def wait_sends(self, label: str) -> None:
        """Wait until every queued send has completed (each send stream synchronized, under the watchdog), then for
        the engine stream; the held tensors go."""
        for dest, link in self._sends.items():
            self.group.watched_peer(f"{label} ({link.name})", link.stream.synchronize, dest)
        if self.engine is not None:
            self.group.watched_peer(f"{label} (engine stream)", self.engine.synchronize)
        self._pending = []
        self.group.wait_sends(label)  # the headers
