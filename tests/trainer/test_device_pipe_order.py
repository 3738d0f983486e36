"""The order a CUDA pipeline's device messages take on their streams (:class:`DevicePipe`, made by
:meth:`NCCLComm.device_pipe`), with stand-ins for CuPy's streams and events, NCCL's 2-rank communicators and the
process group: every stage runs the real schedule (:func:`pipeline_step`, :func:`stage_eval_sums`) in a thread of its
own, and a simulated GPU runs what they queue. A stream runs its operations in order; an NCCL send and its receive
complete only together, once both are at the head of their streams (a transfer that needs its peer); a wait for an
event only once the event's stream has passed it; an engine stream's calls run only as far as a wait for its event
needs or when its host waits for it (as late as a GPU may run them). A host wait (a stream's synchronize, a header's
receive) that nothing can ever satisfy, with every stage waiting, is a deadlock. The calls are made on the GPU by
tests/gpu/test_gpu_pipeline.py; here, which streams carry what, in which order, and that nothing waits forever (and,
last, which stages take the device path and how their engine calls go)."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from ortflow.trainer.comm.device_pipe import DevicePipe
from ortflow.trainer.comm.nccl import NCCLComm
from ortflow.trainer.parallel.schedule import pipeline_step, stage_eval_sums


class Deadlock(Exception):
    pass


class _Gpu:
    """The simulated device of every rank and the hosts' waits (one condition guards it all)."""

    def __init__(self, ranks: int):
        self.cond = threading.Condition()
        self.streams: list[_Stream] = []
        self.alive, self.waiting, self.deadlock = ranks, {}, False
        self.transfers: list[tuple] = []  # (link name, sender rank, receiver rank, what)
        self.ptrs = itertools.count(1)

    def progress(self, engine=None) -> bool:
        """Run what can run. An engine stream runs only as far as another stream's wait for its event needs, or all of
        it when its host waits for it (``engine``): engine work lags its host as much as it may on a GPU, so an NCCL
        op that did not wait for it finds its tensor unwritten."""
        moved, any_moved = True, False
        while moved:
            moved = False
            for stream in self.streams:
                if stream.name.endswith("engine") and stream is not engine:
                    continue
                while stream.ops and self._run(stream):
                    moved = any_moved = True
        return any_moved

    def _run(self, stream) -> bool:
        kind, *args = stream.ops[0]
        if kind == "wait":
            event = args[0]
            while not event.done and event.stream.name.endswith("engine") and event.stream.ops:
                self._run(event.stream)  # the engine's work this wait needs (it depends on nothing remote)
            if not event.done:
                return False
        elif kind in ("send", "recv"):
            link, tensor, rank = args
            other = "recv" if kind == "send" else "send"
            peer = link.heads(other, stream)
            if peer is None:
                return False
            send_op, recv_op = (stream, peer) if kind == "send" else (peer, stream)
            _, _, src, src_rank = send_op.ops[0]
            _, _, dst, dst_rank = recv_op.ops[0]
            assert src.written, f"{link.name}: a send ran before the GPU wrote its tensor {src.what}"
            assert src.what == "probe" or any(p[0] is src for p in link.pipes[src_rank]._pending), \
                f"{link.name}: the sender let go of {src.what} before its send ran"
            dst.what, dst.written = src.what, True
            self.transfers.append((link.name, src_rank, dst_rank, src.what))
            send_op.ops.pop(0)
            send_op.done += 1
            recv_op.ops.pop(0)
            recv_op.done += 1
            return True
        elif kind == "engine":
            reads, writes = args
            for t in reads:
                assert t.written, f"the engine read {t.what} before it arrived"
            for t in writes:
                t.written = True
        stream.ops.pop(0)
        stream.done += 1
        return True

    def block_until(self, ready, engine=None) -> None:
        """Wait until ``ready()``; a deadlock when every live rank waits and no wait can be met."""
        me = threading.get_ident()
        with self.cond:
            try:
                while True:
                    if self.deadlock:
                        raise Deadlock()
                    self.progress(engine)
                    if ready():
                        self.cond.notify_all()
                        return
                    self.waiting[me] = ready
                    if len(self.waiting) == self.alive and not any(r() for r in self.waiting.values()):
                        self.deadlock = True
                        self.cond.notify_all()
                        raise Deadlock()
                    self.cond.wait(timeout=5)
            finally:
                self.waiting.pop(me, None)

    def queued(self) -> None:
        with self.cond:
            self.progress()
            self.cond.notify_all()

    def exit(self) -> None:
        with self.cond:
            self.alive -= 1
            self.cond.notify_all()


class _Event:
    def __init__(self, stream, position: int):
        self.stream, self.position = stream, position

    @property
    def done(self) -> bool:
        return self.stream.done >= self.position


class _Stream:
    """A CUDA stream stand-in: its operations in order; ``log`` keeps what was queued."""

    def __init__(self, gpu: _Gpu, name: str, rank: int):
        self.gpu, self.name, self.rank, self.ops, self.done, self.queued, self.log = gpu, name, rank, [], 0, 0, []
        self.ptr = next(gpu.ptrs)
        gpu.streams.append(self)

    def _queue(self, op) -> None:
        with self.gpu.cond:
            self.ops.append(op)
            self.queued += 1
            self.log.append(op[0] if op[0] in ("wait", "engine") else (op[0], op[1].name, op[2].what))
        self.gpu.queued()

    def wait_event(self, event) -> None:
        self._queue(("wait", event))

    def record(self):
        with self.gpu.cond:
            return _Event(self, self.queued)

    def synchronize(self) -> None:
        self.gpu.block_until(lambda: self.done >= self.queued, self)

    def engine(self, reads, writes) -> None:
        self._queue(("engine", reads, writes))


class _Tensor:
    def __init__(self, shape, what: str = "", written: bool = False):
        self._shape, self.what, self.written = list(shape), what, written

    def shape(self):
        return self._shape

    def data_type(self):
        return "tensor(float)"

    def data_ptr(self):
        return id(self)


class _Link:
    """One 2-rank NCCL communicator (both ranks' handles): the ops its two ranks queued, by stream."""

    def __init__(self, name: str):
        self.name, self.streams, self.pipes, self.ranks = name, {}, {}, {}

    def heads(self, kind: str, other_stream) -> _Stream | None:
        for stream in self.streams.values():
            if stream is not other_stream and stream.ops and stream.ops[0][0] == kind and stream.ops[0][1] is self:
                return stream
        return None


class _Handle:
    """What ``NcclCommunicator(2, uid, me)`` returns on one rank: ops go on the stream given by its pointer."""

    def __init__(self, gpu: _Gpu, link: _Link, me: int, rank: int, tensors: dict):
        self.gpu, self.link, self.me, self.rank, self.tensors = gpu, link, me, rank, tensors
        link.ranks[me] = rank

    def _op(self, kind, ptr, count, dtype, peer, stream_ptr) -> None:
        assert peer == 1 - self.me and dtype == 7
        stream = next(s for s in self.gpu.streams if s.ptr == stream_ptr)
        assert self.link.streams.setdefault(self.rank, stream) is stream, f"{self.link.name}: two streams on a rank"
        tensor = self.tensors.get(ptr) or _Tensor([count], "probe", written=True)
        stream._queue((kind, self.link, tensor, self.rank))

    def send(self, *args) -> None:
        self._op("send", *args)

    def recv(self, *args) -> None:
        self._op("recv", *args)


class _World:
    """Every rank's process group (headers, the broadcast, the watchdog) and NCCL's links, over one simulated GPU."""

    def __init__(self, ranks: int, shared_stream: bool = False):
        self.gpu, self.ranks, self.shared_stream = _Gpu(ranks), ranks, shared_stream
        self.mail: dict[tuple, list] = {}
        self.bcast: dict = {}
        self.links: dict[object, _Link] = {}
        self.tensors: dict[int, _Tensor] = {}  # data_ptr -> tensor (the send and receive calls pass addresses)
        self.watched: dict[int, list[str]] = {r: [] for r in range(ranks)}
        self.uids = itertools.count(100)

    def group(self, rank: int):
        world, gpu = self, self.gpu

        def send_object(obj, dest, tag):
            with gpu.cond:
                world.mail.setdefault((rank, dest, tag), []).append(obj)
            gpu.queued()

        def recv_object(source, tag, label):
            box = world.mail.setdefault((source, rank, tag), [])
            gpu.block_until(lambda: bool(box))
            with gpu.cond:
                return box.pop(0)

        def broadcast(obj, label):
            if rank == 0:
                with gpu.cond:
                    world.bcast[label] = obj
                gpu.queued()
            gpu.block_until(lambda: label in world.bcast)
            return world.bcast[label]

        def watched(label, call):
            world.watched[rank].append(label)
            return call()

        return SimpleNamespace(rank=rank, size=self.ranks, send_object=send_object, recv_object=recv_object,
                               broadcast=broadcast, watched=None, wait_sends=lambda label: None,
                               watched_peer=lambda label, call, peer=None: watched(label, call))

    def nccl_comm(self, rank: int, engine) -> NCCLComm:
        """An NCCLComm over stand-ins (only what :meth:`NCCLComm.device_pipe` reads)."""
        world, gpu = self, self.gpu
        streams: list[_Stream] = []

        def new_stream(non_blocking):
            assert non_blocking
            if world.shared_stream and streams:  # what stalls: one stream for both directions
                return streams[0]
            streams.append(_Stream(gpu, f"rank {rank} link stream {len(streams)}", rank))
            return streams[-1]

        def communicator(size, uid, me):
            assert size == 2
            with gpu.cond:
                link = world.links.setdefault(uid, _Link(f"link {uid}"))
            return _Handle(gpu, link, me, rank, world.tensors)

        nccl = SimpleNamespace(get_unique_id=lambda: next(world.uids), NcclCommunicator=communicator,
                               NCCL_FLOAT32=7)
        null = _Stream(gpu, f"rank {rank} legacy", rank)
        cuda = SimpleNamespace(Stream=new_stream, Device=lambda i: _Nothing())
        cuda.Stream.null = null
        cupy = SimpleNamespace(cuda=cuda, float32=np.float32,
                               zeros=lambda n, dtype: SimpleNamespace(data=SimpleNamespace(ptr=0)))
        comm = NCCLComm.__new__(NCCLComm)
        comm._cp, comm._nccl, comm.group = cupy, nccl, self.group(rank)
        comm.rank, comm.size, comm.device_index = rank, self.ranks, 0
        comm.null = null
        return comm


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class _Engine:
    """The rank's engine stream: synchronize, record (and the stage stand-in queues its calls on it)."""

    def __init__(self, gpu, rank):
        self.stream = _Stream(gpu, f"rank {rank} engine", rank)

    def record(self):
        return self.stream.record()

    def synchronize(self):
        self.stream.synchronize()


class _Stage:
    """A stage's body stand-in on the device path: each call is one engine-stream operation that reads its device
    inputs (what arrived) and writes its outputs, returned before the GPU ran it (as a kept call's are)."""

    def __init__(self, world: _World, rank: int, num_stages: int, pipe: DevicePipe, engine: _Engine):
        self.world, self.stage, self.num_stages, self.messages, self.engine = world, rank, num_stages, pipe, engine
        self.receives = ("h",) if rank > 0 else ()
        self.sends = ("h",) if rank < num_stages - 1 else ()
        self.forwards = 0
        self.backwards = 0
        self.counts_loss = True

    @property
    def last(self):
        return self.stage == self.num_stages - 1

    def _new(self, what):
        tensor = _Tensor([2, 3], what)
        self.world.tensors[tensor.data_ptr()] = tensor
        return tensor

    def forward(self, feeds, train=True):
        out = self._new(f"act {'t' if train else 'e'}{self.forwards} of stage {self.stage}")
        self.forwards += 1
        self.engine.stream.engine([feeds[n] for n in self.receives], [out])
        return [out]

    def backward(self, feeds, grads):
        outs = [self._new(f"grad {self.backwards} of stage {self.stage}") for _ in self.receives]
        self.backwards += 1
        self.engine.stream.engine([feeds[n] for n in self.receives] + list(grads or []), outs)
        return 0.0, outs

    def eval_loss(self, feeds):
        self.engine.stream.engine([feeds[n] for n in self.receives], [])
        return 0.0

    def train_mode(self):
        pass


def _run(num_stages: int, m: int, shared_stream: bool = False, evals: int = 0):
    world = _World(num_stages, shared_stream)
    results, errors = {}, {}

    def rank_main(rank):
        try:
            engine = _Engine(world.gpu, rank)
            comm = world.nccl_comm(rank, engine)
            pipe = comm.device_pipe(engine)
            pipe._new = lambda shape, dtype: world.tensors.setdefault(id(t := _Tensor(shape)), t)
            stage = _Stage(world, rank, num_stages, pipe, engine)
            batches = iter([{} for _ in range(m)])
            stats = pipeline_step(stage, batches, m)
            held_after = list(pipe._pending)
            sums = None
            if evals:
                batches = SimpleNamespace(num_batches=evals, weighted_batches=lambda: (
                    (k, {}, 1.0, 1) for k in range(evals)))
                sums = stage_eval_sums(stage, batches)
            results[rank] = SimpleNamespace(pipe=pipe, stage=stage, stats=stats, held_after=held_after, sums=sums,
                                            engine=engine)
        except Deadlock:
            errors[rank] = "deadlock"
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors[rank] = err
            with world.gpu.cond:
                world.gpu.deadlock = True
                world.gpu.cond.notify_all()
        finally:
            world.gpu.exit()

    # The links' owner pipes are known once made; the simulated GPU checks a send's tensor is still held by its pipe.
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stage never finished"
    return world, results, errors


@pytest.fixture(autouse=True)
def _pipes_seen_by_links(monkeypatch):
    """Each link learns its ranks' pipes (the simulated GPU asserts that a send's tensor is still held)."""
    made = DevicePipe.__init__

    def init(self, cupy, nccl, group, sends, receives, engine, device_index, new_tensor=None):
        made(self, cupy, nccl, group, sends, receives, engine, device_index, new_tensor)
        for link in (*sends.values(), *receives.values()):
            link.comm.link.pipes[group.rank] = self

    monkeypatch.setattr(DevicePipe, "__init__", init)


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_each_link_stream_carries_one_direction_in_the_same_order_on_both_stages_and_nothing_stalls(num_stages, m):
    world, results, errors = _run(num_stages, m)
    assert not errors, errors
    links = {link.name: link for link in world.links.values()}
    assert len(links) == 2 * (num_stages - 1)  # act and grad for each neighbouring pair
    for link in links.values():
        assert sorted(link.streams) == sorted(link.ranks.values()) and len(link.streams) == 2
        sender, receiver = link.ranks[0], link.ranks[1]
        if any(op[0] == "recv" for op in link.streams[sender].log if op != "wait"):  # the grad links: rank 1 sends
            sender, receiver = receiver, sender
        kinds = {s: {op[0] for op in link.streams[s].log if op not in ("wait", "engine")} for s in (sender, receiver)}
        assert kinds == {sender: {"send"}, receiver: {"recv"}}, kinds  # one direction per stream
        assert {op[1] for s in (sender, receiver) for op in link.streams[s].log if op != "wait"} == {link.name}
        sent = [op[2] for op in link.streams[sender].log if op != "wait"]
        got = [what for name, src, dst, what in world.gpu.transfers if name == link.name]
        assert got == sent and abs(sender - receiver) == 1  # the receiver took them in the order they were sent
    # What crossed each cut, in schedule order: the activations forward, then their gradients back.
    for s in range(num_stages - 1):
        acts = [what for _, src, dst, what in world.gpu.transfers if (src, dst) == (s, s + 1) and what != "probe"]
        grads = [what for _, src, dst, what in world.gpu.transfers if (src, dst) == (s + 1, s) and what != "probe"]
        assert acts == [f"act t{i} of stage {s}" for i in range(m)]
        assert grads == [f"grad {i} of stage {s + 1}" for i in range(m)]
    for rank, r in results.items():
        assert r.held_after == [] and r.engine.stream.done == r.engine.stream.queued  # wait_sends let go after
        assert r.pipe.sent == m * ((rank < num_stages - 1) + (rank > 0))
        assert r.pipe.received == m * ((rank < num_stages - 1) + (rank > 0))


def test_a_receive_returns_only_after_its_stream_is_waited_for_under_the_watchdog():
    world, results, errors = _run(2, 2)
    assert not errors, errors
    labels = world.watched[1]
    assert "recv act mb0 <- stage 0" in labels and "recv act mb1 <- stage 0" in labels
    assert "recv grad mb0 <- stage 1" in world.watched[0]
    assert any(label.startswith("pipeline sends of stage 0 (nccl pipeline link act 0<->1)") for label in
               world.watched[0])


def test_eval_batches_go_the_same_way():
    world, results, errors = _run(3, 2, evals=3)
    assert not errors, errors
    for s in range(2):
        acts = [what for _, src, dst, what in world.gpu.transfers if (src, dst) == (s, s + 1)]
        assert acts[-3:] == [f"act e{2 + i} of stage {s}" for i in range(3)]
    assert all(r.pipe._pending == [] for r in results.values())


def test_one_stream_for_both_directions_stalls_with_two_micro_batches_in_flight():
    """The simulated GPU finds the stall of one stream per rank for both directions (send a1 before recv g0 on stage
    0, send g0 before recv a1 on stage 1): the checks above can fail."""
    _, _, errors = _run(2, 2, shared_stream=True)
    assert errors and set(errors.values()) == {"deadlock"}, errors


def test_sent_tensors_are_held_until_their_send_ran_and_counted_as_pending():
    world, results, errors = _run(2, 8)
    assert not errors, errors
    # Stage 0 sends 8 activations before it waits for its sends; the GPU ran each while its tensor was held (asserted
    # by the simulated GPU), and the most bytes held at once was at least one message.
    assert results[0].stats.sent_bytes >= 2 * 3 * 4


def test_cuda_stages_of_one_module_with_nccl_take_the_device_path_and_others_keep_host_arrays(monkeypatch):
    """pipeline_messages: device messages for a CUDA rank's whole-stage body over an NCCL pipeline group (its calls
    then go through DeviceTensors, waited for as point-to-point work); host arrays on CPU ranks, over an MPI group, and
    for a pipeline x tensor-parallel stage."""
    from ortflow.trainer.parallel import build
    from ortflow.trainer.parallel.whole_model import WholeModel

    engine = object()
    pipe = NCCLComm.__new__(NCCLComm)
    pipe.device_index = 0
    monkeypatch.setattr(NCCLComm, "device_pipe", lambda self, stream: ("device pipe", stream))
    on_gpu = SimpleNamespace(on_device=True, engine_stream=lambda: engine)
    body = WholeModel.__new__(WholeModel)
    body.tensors = None
    assert build.pipeline_messages(pipe, body, on_gpu) == ("device pipe", engine)
    assert body.tensors.engine is engine and body.tensors._collective is False
    other = WholeModel.__new__(WholeModel)
    other.tensors = None
    assert build.pipeline_messages(pipe, other, SimpleNamespace(on_device=False)) is None and other.tensors is None
    assert build.pipeline_messages(SimpleNamespace(), other, on_gpu) is None and other.tensors is None
    assert build.pipeline_messages(pipe, SimpleNamespace(), on_gpu) is None  # tensor-parallel pieces


def test_a_whole_stage_on_the_device_path_calls_its_module_on_device_tensors():
    """With DeviceTensors a stage's recomputing forward, training call and eval loss go through it (device outputs,
    the loss read back as a scalar); without, the module's own call on host arrays."""
    from ortflow.trainer.parallel.whole_model import WholeModel

    calls = []
    tensors = SimpleNamespace(call=lambda part, train, feeds: calls.append((train, sorted(feeds))) or ["out0", "out1"],
                              scalar=lambda x: calls.append(("scalar", x)) or 2.5)
    body = WholeModel.__new__(WholeModel)
    body.kept, body.tensors, body._batch_statistics = None, tensors, False
    body._parts = [SimpleNamespace(call=lambda train, feeds: calls.append(("host", train)) or [1.0, "g"])]
    assert body.stage_forward({"x": 1}, ("y",), train=True) == ["out0"]
    assert body.stage_backward({"x": 1}, ["gy"], ("y",), ("x",)) == (2.5, ["out1"])
    assert body.eval_loss({"x": 1}) == 2.5
    assert calls == [(False, ["x"]), (True, ["x", "y.grad_in"]), ("scalar", "out0"), (False, ["x"]), ("scalar", "out0")]
    body.tensors, calls[:] = None, []
    assert body.stage_backward({"x": 1}, None, ("y",), ("x",)) == (1.0, ["g"]) and calls == [("host", True)]


def test_communicators_are_destroyed_in_the_order_they_were_made_from_the_closing_ones_on(monkeypatch):
    """NCCL's destroy waits for the communicator's other ranks: two stages whose pipeline links the garbage collector
    destroys in opposite orders at exit both wait forever. close() destroys its communicator and every one made
    after it (sub-groups, pipeline links) in the order they were made, which is the same on every rank."""
    from ortflow.trainer.comm import nccl as nccl_module

    events: list[tuple[str, int]] = []

    class Communicator:
        def __init__(self, size, uid, rank):
            self.uid = uid
            events.append(("made", uid))

        def destroy(self):
            events.append(("destroyed", self.uid))

    monkeypatch.setattr(nccl_module, "_COMMUNICATORS", [])
    stand_in = SimpleNamespace(NcclCommunicator=Communicator)
    world = nccl_module._join(stand_in, 2, 0, 0)
    first = len(nccl_module._COMMUNICATORS)
    made = [nccl_module._join(stand_in, 2, uid, 0) for uid in (1, 2, 3)]
    nccl_module.destroy_communicators(first)
    assert events[-3:] == [("destroyed", 1), ("destroyed", 2), ("destroyed", 3)]
    assert nccl_module._COMMUNICATORS == [world] and all(c not in nccl_module._COMMUNICATORS for c in made)
    nccl_module.destroy_communicators(0)
    assert events[-1] == ("destroyed", 0) and nccl_module._COMMUNICATORS == []


def test_the_held_bytes_of_received_device_tensors_count_their_shapes_and_types():
    """A stage's held inputs are device tensors here: their bytes come from shape and element type (2 x 3 float32 =
    24 bytes a message), at most P - s micro-batches of them on stage s (stage 0 holds its batches, no message)."""
    world, results, errors = _run(3, 8)
    assert not errors, errors
    assert [(r.stats.most_held, r.stats.held_bytes) for _, r in sorted(results.items())] == [(3, 0), (2, 48), (1, 24)]
