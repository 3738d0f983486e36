"""Ranks under an MPI launcher: the only module that imports mpi4py."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ortflow.trainer.comm.adasum import adasum_allreduce
from ortflow.trainer.comm.buckets import Bucket, plan_buckets
from ortflow.trainer.comm.communicator import Communicator, SingleProcessComm, gradient_norm, scale_gradients
from ortflow.trainer.comm.launcher_match import launcher_abi, launcher_mismatch
from ortflow.trainer.comm.memory_runs import RunPlan, plan_key
from ortflow.trainer.comm.watchdog import Heartbeats, Watchdog
from ortflow.trainer.lifeline import continued_signal, launcher_processes

#: Dimensions a point-to-point header holds (unused ones are -1).
_HEADER = 8

#: Environment variables that MPI launchers set in every rank (MPICH/Hydra, Open MPI, Slurm's PMI).
_LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


class MPIComm:
    """Ranks started by an MPI launcher."""

    #: Gradient values per bucket of the exchange (distributed.exchange_bucket_mb); 0: large gradients in place and
    #: the small ones packed, one all-reduce per memory run.
    bucket_values: int = 0
    #: True: the runs exchange leaves the sums in place and ``average_gradients`` returns the mean's scale, which the
    #: caller's norm and update apply on the fly (comm/pending.py); the bucket exchange always scales.
    defer_scale: bool = False
    can_defer_scale = True

    def __init__(self, heartbeat_dir: Path, timeout_s: float):
        # A rank that waits in MPI (in MPI_Init for a slower rank, at a barrier while rank 0 verifies the data or writes
        # a checkpoint) sleeps between polls instead of spinning a core that the rank doing the work could use: MPICH's
        # setting, read at MPI_Init (other MPIs ignore it); MPIR_CVAR_ENABLE_HEAVY_YIELD=0 in the environment spins.
        os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
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
        self._groups: dict[int, object] = {}  # group size -> MPI sub-communicator of consecutive ranks
        self.heartbeats = Heartbeats(heartbeat_dir, self.rank, self.size)
        self.watchdog = Watchdog(timeout_s, self.heartbeats, self._timed_out, launchers=launcher_processes(),
                                 on_launcher_stopped=self._launcher_stopped, continued=continued_signal(),
                                 stacks=True)
        self._runs: RunPlan | None = None  # the runs exchange's plan, made at its first call
        self._pending: list[tuple[tuple, list]] = []  # started sends: (buffers that must outlive them, requests)
        self._world_of: dict[int, int] = {}
        self._closed = False

    def _timed_out(self, message: str) -> None:
        # The message must outlive the abort: a file the launcher replays, then the job output, then a moment for the
        # launcher's proxy to forward it before MPI kills everything.
        try:
            self.heartbeats.leave_message(f"ERROR: {message}")
        except OSError:
            pass
        try:
            sys.stderr.write(f"ERROR: {message}\n")  # relayed (trainer/output.py): never blocks on the launcher
            sys.stderr.flush()
        except OSError:
            pass
        # A moment for the launcher's proxy, and for the other ranks to answer the watchdog's request for their stacks
        # (at their next beat).
        time.sleep(0.5 + self.watchdog.beat_s)
        # MPI's abort goes through the launcher's proxy and mpiexec; a stopped or blocked one holds it (and the GIL)
        # for ever, so the kernel ends the rank 2 s later whatever happens (SIGALRM's default action; the stall file
        # tells the story).
        signal.alarm(2)
        self.comm.Abort(3)

    def _launcher_stopped(self, message: str) -> None:
        # MPI's abort would have to pass through the stopped launcher: every rank on this host watches the same
        # launchers and leaves on its own (ranks elsewhere time out at their next collective with these).
        try:
            self.heartbeats.leave_message(f"ERROR: {message}")
            sys.stderr.write(f"ERROR: {message}\n")
            sys.stderr.flush()
        except OSError:
            pass
        os._exit(3)

    def _collective(self, label: str, call: Callable[[], object]) -> object:
        self.watchdog.enter(label)
        try:
            return call()
        finally:
            self.watchdog.leave()

    #: Run a blocking call (a collective, or a wait on one) under the watchdog.
    watched = _collective

    def watched_peer(self, label: str, call: Callable[[], object], peer: int | None = None) -> object:
        """``call`` under the watchdog as a point-to-point wait: not counted among the collectives (only some ranks
        make it); ``peer``: the rank of this group it waits for, named in a stall report."""
        return self._point_to_point(label, call, self._world_rank(peer) if peer is not None else None)

    # -- sub-groups and point-to-point (pipeline parallelism) --------------------------------------------------------

    def split(self, color: int, label: str) -> MPIComm:
        """The ranks with the same ``color`` as a communicator of their own (same watchdog, ranks ordered by rank)."""
        sub = object.__new__(MPIComm)
        sub.__dict__.update(self.__dict__)
        sub.comm = self._collective(label, lambda: self.comm.Split(color, key=self.rank))
        sub.rank, sub.size = sub.comm.Get_rank(), sub.comm.Get_size()
        sub._flat, sub._slices, sub._pending, sub._groups = None, [], [], {}
        sub._runs = None  # agreed among this group's ranks at its first exchange
        sub.defer_scale = False  # a sub-group's exchange (pipeline, tensor parallelism) scales eagerly
        sub._closed, sub._world_of = True, {}  # the parent owns the watchdog
        return sub

    @property
    def host(self) -> MPIComm:
        """Host arrays go over this group itself."""
        return self

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Start sending ``array`` (float32, any shape) to ``dest`` of this group; completes in :meth:`wait_sends`.

        A small header with the shape goes first, so a receiver needs no shape in advance (eval batches may be short).
        """
        self.release_sent()
        array = np.ascontiguousarray(array, dtype=np.float32)
        header = np.full(_HEADER, -1, dtype=np.int64)
        header[: array.ndim] = array.shape
        requests = [self.comm.Isend(header, dest=dest, tag=2 * tag), self.comm.Isend(array, dest=dest, tag=2 * tag + 1)]
        self._pending.append(((header, array), requests))  # the buffers must live until the sends complete

    def release_sent(self) -> None:
        """Drop the buffers of the sends that have completed (a non-blocking test), so that a pipeline stage holds only
        the tensors still in flight, not every activation or gradient it sent since the last :meth:`wait_sends`
        (measured on the 2-core CPU host)."""
        self._pending = [(buffers, requests) for buffers, requests in self._pending
                         if not self._mpi.Request.Testall(requests)]

    def pending_send_bytes(self) -> int:
        """Bytes of the send buffers this rank still holds (tensors sent and not yet known to be received)."""
        return sum(b.nbytes for buffers, _ in self._pending for b in buffers)

    def recv(self, source: int, tag: int, label: str) -> np.ndarray:
        """Receive an array sent by :meth:`send` from ``source``, under the watchdog (``label`` names the peer)."""
        header = np.empty(_HEADER, dtype=np.int64)
        peer = self._world_rank(source)
        self._point_to_point(label, lambda: self.comm.Recv(header, source=source, tag=2 * tag), peer)
        array = np.empty(tuple(int(d) for d in header if d >= 0), dtype=np.float32)
        self._point_to_point(label, lambda: self.comm.Recv(array, source=source, tag=2 * tag + 1), peer)
        self.release_sent()  # a peer that answered has often taken what was sent to it: drop those buffers now
        return array

    def _world_rank(self, rank: int) -> int:
        """World rank of this group's ``rank`` (stall reports name world ranks)."""
        if rank not in self._world_of:
            mine, world = self.comm.Get_group(), self._mpi.COMM_WORLD.Get_group()
            self._world_of[rank] = self._mpi.Group.Translate_ranks(mine, [rank], world)[0]
            mine.Free()
            world.Free()
        return self._world_of[rank]

    def send_object(self, obj: object, dest: int, tag: int) -> None:
        """Start sending a small picklable object (a shape) to ``dest``; completes in :meth:`wait_sends`."""
        self._pending.append(((), [self.comm.isend(obj, dest=dest, tag=2 * tag)]))

    def recv_object(self, source: int, tag: int, label: str) -> object:
        """Receive what :meth:`send_object` sent, under the watchdog."""
        return self._point_to_point(label, lambda: self.comm.recv(source=source, tag=2 * tag), self._world_rank(source))

    def wait_sends(self, label: str) -> None:
        """Wait until every started send has been received."""
        requests = [r for _, pending in self._pending for r in pending]
        self._point_to_point(label, lambda: self._mpi.Request.Waitall(requests))
        self._pending = []

    def _point_to_point(self, label: str, call: Callable[[], object], peer: int | None = None) -> object:
        self.watchdog.enter(label, count=False, peer=peer)
        try:
            return call()
        finally:
            self.watchdog.leave()

    def gather_object(self, obj: object, label: str) -> list | None:
        """Every rank's ``obj`` on rank 0 of this group (None elsewhere)."""
        return self._collective(label, lambda: self.comm.gather(obj, root=0))

    def gradient_norm(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads)

    def scale_gradients(self, grads: Sequence[np.ndarray], factor: float) -> None:
        scale_gradients(grads, factor)

    def sum_squares(self, grads: Sequence[np.ndarray]) -> float:
        return gradient_norm(grads) ** 2  # the host norm, squared: the same bits as the exchange's own norm

    def _layout(self, grads: Sequence[np.ndarray], num_scalars: int) -> np.ndarray:
        sizes = [g.size for g in grads]
        if self._flat is None or len(self._slices) != len(sizes) or self._flat.size != sum(sizes) + num_scalars:
            offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self._slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            self._flat = np.empty(offsets[-1] + num_scalars, dtype=np.float32)
        return self._flat

    def average_gradients(self, grads: Sequence[np.ndarray], divisor: float, scalars: np.ndarray) -> np.float32:
        for grad in grads:
            if grad.dtype != np.float32:
                raise TypeError(f"gradients must be float32, got {grad.dtype}: mixed precision is not supported yet")
        scale = np.float32(1.0 / divisor)
        if self.size == 1:  # `mpiexec -n 1`: nothing to exchange, so no packing copies (only the mean's scale)
            if self.defer_scale:
                return scale
            if divisor != 1.0:
                scale_gradients(grads, scale)
            return np.float32(1)
        if self.bucket_values:  # cache-sized buckets (distributed.exchange_bucket_mb, comm/buckets.py): scaled here
            self._collective("gradient all-reduce", lambda: self._exchange_buckets(grads, divisor, scalars))
            return np.float32(1)
        # Memory runs in place, small ones packed: the fastest measured (docs/layouts.md).
        owed, applied = (scale, np.float32(1)) if self.defer_scale else (np.float32(1), scale)
        self._collective("gradient all-reduce", lambda: self._exchange_runs(grads, applied, scalars))
        return owed

    def _exchange_runs(self, grads: Sequence[np.ndarray], scale: np.float32, scalars: np.ndarray) -> None:
        """Runs of gradients that lie back to back in the engine's memory all-reduced in place as one buffer each, on
        huge pages (comm/memory_runs.py; the bench GPT's 69 gradients are 1 run with the trainer's arena,
        trainer/arena.py), the small runs and the scalars packed into one more, each run times ``scale`` as soon as it
        is reduced (the mean's ``float32(1/divisor)``; 1 when the scale is deferred: no pass at all, the pack is copied
        back as is).

        Blocking ``Allreduce`` calls, one after another: Open MPI 4.1's non-blocking collectives (libnbc) took 1.6x
        its blocking ``Allreduce`` of the same bytes on the device's 32 CPUs, and MPICH measured the same either way
        (docs/layouts.md)."""
        mpi = self._mpi
        plan = self._runs
        if plan is None or plan.key != plan_key(grads, scalars.size):
            # Sync point (once per set of gradient buffers): the ranks agree on the runs they all hold alike.
            plan = self._runs = RunPlan(grads, scalars.size, self.comm.allgather)
        plan.fill(scalars)
        allreduce, in_place, op = self.comm.Allreduce, mpi.IN_PLACE, mpi.SUM
        allreduce(in_place, plan.pack, op=op)
        for view in plan.views:
            allreduce(in_place, view, op=op)
            if scale != 1:
                np.multiply(view, scale, out=view)
        plan.drain(scalars, scale)

    def _bucket_plan(self, grads: Sequence[np.ndarray], num_scalars: int, bucket_values: int):
        """The bucket plan and pack buffers, made once for these gradient sizes (the last pack holds the scalars)."""
        key = (tuple(g.size for g in grads), num_scalars, bucket_values)
        if getattr(self, "_plan_key", None) != key:
            plan = plan_buckets(key[0], bucket_values)
            if not any(b.packed for b in plan):
                plan.append(Bucket((), packed=True))
            last = max(i for i, b in enumerate(plan) if b.packed)
            packs = [np.empty(b.size + (num_scalars if i == last else 0), np.float32) if b.packed else None
                     for i, b in enumerate(plan)]  # fmt: skip
            self._plan_key, self._plan = key, (plan, packs, last)
        return self._plan

    def _exchange_buckets(self, grads, divisor: float, scalars: np.ndarray, bucket_values: int = 0) -> None:
        """Bucket by bucket: pack (small gradients) or take in place (slices of large ones), all-reduce, scale."""
        values = bucket_values or self.bucket_values or sum(g.size for g in grads) + 1  # 0 here: one pack
        plan, packs, last = self._bucket_plan(grads, scalars.size, values)
        flats, scale = [g.reshape(-1) for g in grads], np.float32(1.0 / divisor)
        allreduce, in_place, op = self.comm.Allreduce, self._mpi.IN_PLACE, self._mpi.SUM
        for i, (bucket, pack) in enumerate(zip(plan, packs, strict=True)):
            if not bucket.packed:  # a slice of one large gradient: no copies, reduced where it lies
                piece = bucket.pieces[0]
                view = flats[piece.index][piece.start : piece.stop]
                allreduce(in_place, view, op=op)
                np.multiply(view, scale, out=view)
                continue
            at = 0
            for piece in bucket.pieces:
                pack[at : at + piece.size] = flats[piece.index][piece.start : piece.stop]
                at += piece.size
            if i == last:
                pack[at:] = scalars
            allreduce(in_place, pack, op=op)
            at = 0
            for piece in bucket.pieces:
                np.multiply(pack[at : at + piece.size], scale, out=flats[piece.index][piece.start : piece.stop])
                at += piece.size
            if i == last:
                scalars[:] = pack[at:]

    def adasum_tensors(self, tensors: Sequence[np.ndarray], divisor: float, scalars: np.ndarray, peers=None) -> None:
        flat = self._layout(tensors, 0)
        scale = np.float32(1.0 / divisor)
        for tensor, part in zip(tensors, self._slices, strict=True):
            np.multiply(tensor.reshape(-1), scale, out=flat[part])
        adasum_allreduce(flat, [t.size for t in tensors], peers or self)
        for tensor, part in zip(tensors, self._slices, strict=True):
            tensor.reshape(-1)[:] = flat[part]
        if scalars.size:
            scalars[:] = self.allreduce_sum(scalars, "adasum scalars")

    def allreduce_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        buffer = np.array(values, dtype=np.float64, copy=True)
        self._collective(label, lambda: self.comm.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM))
        return buffer

    # -- point to point and sub-groups (Adasum's tree) --------------------------------------------------------------
    def sendrecv(self, send: np.ndarray, peer: int, recv: np.ndarray, label: str) -> None:
        """Exchange buffers with ``peer`` (both sides call this with each other's rank)."""
        self._collective(label, lambda: self.comm.Sendrecv(send, dest=peer, sendtag=7, recvbuf=recv, source=peer,
                                                           recvtag=7))

    def group_allreduce_sum(self, values: np.ndarray, group_size: int, label: str) -> np.ndarray:
        """Sum of a small float64 array over the ``group_size`` consecutive ranks that include this one."""
        if group_size == self.size:
            return self.allreduce_sum(values, label)
        if group_size not in self._groups:  # made once per size, by every rank in the same order
            self._groups[group_size] = self._collective(
                "split group", lambda: self.comm.Split(color=self.rank // group_size, key=self.rank))
        sub = self._groups[group_size]
        buffer = np.array(values, dtype=np.float64, copy=True)
        self._collective(label, lambda: sub.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM))
        return buffer

    def allgather_sum(self, values: np.ndarray, label: str) -> np.ndarray:
        mine = np.array(values, dtype=np.float64, copy=True)
        parts = np.empty((self.size, mine.size), dtype=np.float64)
        self._collective(label, lambda: self.comm.Allgather(mine, parts))
        total = parts[0].copy()
        for row in parts[1:]:  # rank order, so every rank adds the same numbers in the same order
            total += row
        return total

    def reduce_scatter(self, flat: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        mpi = self._mpi
        if len(set(counts)) == 1 and flat.size == counts[0] * self.size:  # the block variant: much faster in MPICH
            call = lambda: self.comm.Reduce_scatter_block(flat, out, op=mpi.SUM)  # noqa: E731
        else:
            call = lambda: self.comm.Reduce_scatter(flat, out, list(counts), op=mpi.SUM)  # noqa: E731
        self._collective("zero-1 gradient reduce-scatter", call)

    def all_gather(self, flat: np.ndarray, counts: Sequence[int], label: str = "zero-1 parameter all-gather") -> None:
        mpi = self._mpi
        if len(set(counts)) == 1 and flat.size == counts[0] * self.size:
            # In place over equal ranges: MPICH's Allgatherv measured 42x slower (bench: zero.shard_bounds).
            call = lambda: self.comm.Allgather(mpi.IN_PLACE, flat)  # noqa: E731
        else:
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
            call = lambda: self.comm.Allgatherv(mpi.IN_PLACE, [flat, list(counts), displs, mpi.FLOAT])  # noqa: E731
        self._collective(label, call)

    def broadcast(self, obj: object, label: str) -> object:
        return self._collective(label, lambda: self.comm.bcast(obj, root=0))

    def barrier(self, label: str) -> None:
        self._collective(label, self.comm.Barrier)

    def abort(self, code: int) -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5)  # the error line this rank just wrote must reach the launcher before MPI kills every proxy
        self.comm.Abort(code)

    def copy_to_host(self, buffer: np.ndarray) -> np.ndarray:
        return np.array(buffer, copy=True)

    def copy_from_host(self, buffer: np.ndarray, values: np.ndarray) -> None:
        buffer[...] = values

    def close(self) -> None:
        if self._closed:  # an NCCLComm wrapping this one closes it too
            return
        self._closed = True
        self.watchdog.close()
        self.heartbeats.close()


def launched_by_mpi(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process was started by an MPI launcher (so MPI must be initialized)."""
    return any(name in environ for name in _LAUNCHER_ENV)


def mpi_binding() -> dict[str, str]:
    """The MPI library mpi4py binds to (``MPI4PY_LIBMPI``, else the environment's, else the system's), without
    initializing MPI: ``{"abi": "mpich" | "openmpi" | ..., "library": its file}``."""
    try:
        from mpi4py import _mpiabi  # mpi4py's own probe: dlopens the library, does not call MPI_Init

        abi = _mpiabi._get_mpiabi()
    except Exception as err:  # noqa: BLE001 - no MPI library at all: importing mpi4py.MPI will say so itself
        return {"abi": "unknown", "library": f"none loadable ({err})".replace("\n", "; ")}
    try:
        with open("/proc/self/maps") as maps:
            library = next((line.split()[-1] for line in maps if "/libmpi.so" in line), "")
    except OSError:
        library = ""
    return {"abi": abi, "library": library or "(found by the dynamic loader)"}


def create_communicator(heartbeat_dir: Path, timeout_s: float, use_nccl: bool = False) -> Communicator:
    """The process group for this process: MPI under a launcher, else the single-process one.

    NCCL is added later, by :func:`attach_nccl`, once the rank's GPU is chosen (it needs this group to share its id).

    Args:
        heartbeat_dir: Shared folder for the watchdog's per-rank heartbeat records.
        timeout_s: Abort when one collective waits longer than this.
        use_nccl: Accepted for the call sites' sake; the group itself is the same with or without NCCL.
    """
    if launched_by_mpi():
        problem = launcher_mismatch(mpi_binding(), launcher_abi())  # before MPI_Init, which would hang or fail
        if problem:
            raise RuntimeError(problem)
        return MPIComm(heartbeat_dir, timeout_s)
    return SingleProcessComm()
