"""The gradient exchange: MPIComm.average_gradients and its alternatives against a bare mpi4py Allreduce.

Run under the launcher (2 ranks here, 16 on the device machine's CPUs)::

    .venv/bin/mpiexec -n 2 python -m bench exchange --rounds 15 --out bench/out

Gradient shapes: the float initializers of the bench GPT (``ortflow.examples.gpt``, d_model 256, 4 layers, seq 128:
3.3 M parameters in ~70 tensors, ~13 MB), or ``--model FILE.onnx``. Contenders, interleaved within every round (the
order reversed every other round) and each started together on all ranks (a barrier before each call, so the
collective is timed, not the ranks' skew):

* ``bare``: ``Allreduce(IN_PLACE)`` of one contiguous float32 buffer of the same bytes (no mean, no copies);
* ``ortflow``: ``MPIComm.average_gradients`` as the trainer calls it (gradients + 2 scalars, mean over ranks; since
  2026-11-23 04:25 UTC the ``postall`` scheme below, before that one packed collective);
* ``packed``: the previous exchange (pack everything, one Allreduce, unpack with the 1/N scale);
* ``buckets-K``: cache-sized buckets of K KiB, blocking (ortflow.trainer.comm.buckets);
* ``ipipe-K``: the same buckets as a non-blocking ``Iallreduce`` pipeline two deep (pack the next bucket while the
  previous one is in flight, then wait, scale and unpack).

Every contender's result is first checked against a numpy reference. Rank 0 prints one JSON line and, with
``--out``, writes ``exchange-<host>-<ranks>r-<date>.json`` and ``.md``: per contender min / median / max over rounds
of the round's median call time, and the per-round ratio to ``bare``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write_result
from bench.exchange_runs import CONTENDERS
from ortflow.trainer.comm.buckets import plan_buckets
from ortflow.trainer.comm.memory_runs import local_runs


def library_line(version: str) -> str:
    """The first line of an MPI library's version string, without the C string's NUL (Open MPI ends it with one)."""
    return version.replace("\0", "").splitlines()[0].strip() if version.strip("\0 \n") else "unknown"


def gradient_shapes(model: Path | None) -> list[tuple[int, ...]]:
    """Float initializer shapes of ``model`` (default: the bench GPT built into a temporary folder)."""
    import onnx

    if model is None:
        model = bench_gpt(Path(tempfile.mkdtemp()))
    proto = onnx.load(str(model), load_external_data=False)
    return [tuple(t.dims) for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]


def bench_gpt(folder: Path) -> Path:
    from ortflow.examples.gpt import build_gpt

    return build_gpt(folder / "gpt.onnx", seq_len=128, d_model=256, num_layers=4, num_heads=4)


def engine_gradients(world, model: Path | None, folder: Path, arena: str) -> tuple[object, list[np.ndarray]]:
    """The engine's own gradient buffers (in sorted-name order, as the trainer takes them) for ``model``.

    Rank 0 builds the training artifacts once (the engine writes temp.onnx into the current folder); every rank then
    loads its module, with the trainer's shared arena sized for the gradients (``arena`` "trainer",
    ortflow.trainer.arena) or the session's own default arena ("session"). Returns (module, gradients): keep the
    module alive while the gradients are used.
    """
    import os

    import onnx

    from ortflow.engine import api, artifacts
    from ortflow.trainer.runtime import session_options

    folder = Path(world.bcast(str(folder) if world.Get_rank() == 0 else None, root=0))
    if world.Get_rank() == 0:
        proto = onnx.load(str(model or bench_gpt(folder)))
        names = sorted(t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
        cwd = Path.cwd()
        os.chdir(folder)
        try:
            artifacts.generate_artifacts(proto, requires_grad=names, frozen_params=[],
                                         loss=artifacts.LossType.CrossEntropyLoss, optimizer=None,
                                         artifact_directory=str(folder))  # fmt: skip
        finally:
            os.chdir(cwd)
    world.Barrier()
    from ortflow.trainer.arena import use_gradient_arena

    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = session_options(1)
    if arena == "trainer":
        options = use_gradient_arena(options, 4 * sum(p.data.size for _, p in state.parameters if p.requires_grad))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=options)  # fmt: skip
    names = sorted(n for n, p in state.parameters if p.requires_grad)
    return (state, module), [state.parameters[n].grad for n in names]


class Packed:
    """The exchange before this change: pack all, one Allreduce, unpack with the scale."""

    def __init__(self, mpi, comm, grads, num_scalars):
        self.mpi, self.comm = mpi, comm
        sizes = [g.size for g in grads]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        self.flat = np.empty(offsets[-1] + num_scalars, dtype=np.float32)

    def __call__(self, grads, divisor, scalars):
        flat = self.flat
        for grad, part in zip(grads, self.slices, strict=True):
            flat[part] = grad.reshape(-1)
        flat[flat.size - scalars.size :] = scalars
        self.comm.Allreduce(self.mpi.IN_PLACE, flat, op=self.mpi.SUM)
        scale = np.float32(1.0 / divisor)
        for grad, part in zip(grads, self.slices, strict=True):
            np.multiply(flat[part].reshape(grad.shape), scale, out=grad)
        scalars[:] = flat[flat.size - scalars.size :]


class Pipelined:
    """Buckets as a non-blocking Iallreduce pipeline ``depth`` deep."""

    def __init__(self, mpi, comm, grads, num_scalars, bucket_values, depth=2):
        self.mpi, self.comm, self.depth = mpi, comm, depth
        self.plan = plan_buckets([g.size for g in grads], bucket_values)
        self.packs = [np.empty(b.size, np.float32) if b.packed else None for b in self.plan]
        self.tail = np.empty(num_scalars, np.float32)

    def _buffer(self, i, flats):
        bucket, pack = self.plan[i], self.packs[i]
        if not bucket.packed:
            p = bucket.pieces[0]
            return flats[p.index][p.start : p.stop]
        at = 0
        for p in bucket.pieces:
            pack[at : at + p.size] = flats[p.index][p.start : p.stop]
            at += p.size
        return pack

    def _finish(self, i, buf, flats, scale):
        bucket = self.plan[i]
        if not bucket.packed:
            np.multiply(buf, scale, out=buf)
            return
        at = 0
        for p in bucket.pieces:
            np.multiply(buf[at : at + p.size], scale, out=flats[p.index][p.start : p.stop])
            at += p.size

    def __call__(self, grads, divisor, scalars):
        flats, scale = [g.reshape(-1) for g in grads], np.float32(1.0 / divisor)
        inflight = []
        self.tail[:] = scalars
        tail_req = self.comm.Iallreduce(self.mpi.IN_PLACE, self.tail, op=self.mpi.SUM)
        for i in range(len(self.plan)):
            buf = self._buffer(i, flats)
            inflight.append((i, buf, self.comm.Iallreduce(self.mpi.IN_PLACE, buf, op=self.mpi.SUM)))
            if len(inflight) >= self.depth:
                j, done, req = inflight.pop(0)
                req.Wait()
                self._finish(j, done, flats, scale)
        for j, done, req in inflight:
            req.Wait()
            self._finish(j, done, flats, scale)
        tail_req.Wait()
        scalars[:] = self.tail


class PostAll:
    """Every gradient reduced in place by its own non-blocking Iallreduce, all posted at once, then the scale:
    no packing, and the ranks meet in one wait rather than once per collective. ``any``: scale each gradient as
    soon as its reduction completes (Waitany), while it is in cache."""

    def __init__(self, mpi, comm, any_order: bool):
        self.mpi, self.comm, self.any_order = mpi, comm, any_order

    def __call__(self, grads, divisor, scalars):
        mpi, comm = self.mpi, self.comm
        flats = [g.reshape(-1) for g in grads]
        reqs = [comm.Iallreduce(mpi.IN_PLACE, f, op=mpi.SUM) for f in flats]
        tail = comm.Iallreduce(mpi.IN_PLACE, scalars, op=mpi.SUM)
        scale = np.float32(1.0 / divisor)
        if self.any_order:
            for _ in range(len(reqs)):
                i = mpi.Request.Waitany(reqs)
                np.multiply(flats[i], scale, out=flats[i])
        else:
            mpi.Request.Waitall(reqs)
            for f in flats:
                np.multiply(f, scale, out=f)
        tail.Wait()


class Buckets:
    """Buckets, blocking: MPIComm with distributed.exchange_bucket_mb, parameterised by bucket size."""

    def __init__(self, comm_obj, bucket_values):
        self.comm, self.bucket_values = comm_obj, bucket_values

    def __call__(self, grads, divisor, scalars):
        self.comm._exchange_buckets(grads, divisor, scalars, self.bucket_values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench exchange")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per contender per round")
    parser.add_argument("--buckets-kib", default="256,1024,4096")
    parser.add_argument("--grads", choices=("engine", "numpy"), default="engine",
                        help="the engine's own gradient buffers (its memory layout), or numpy arrays of their shapes")
    parser.add_argument("--arena", choices=("trainer", "session"), default="trainer",
                        help="engine gradients: the trainer's shared arena (gradients back to back) or the default")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="off: the engine's gradient memory stays on its own pages (no madvise by the exchange)")
    parser.add_argument("--contenders", default=None, help="comma-separated names to run (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from ortflow.trainer.comm import MPIComm, memory_runs

    if args.huge_pages == "off":
        memory_runs.advise_huge_pages = lambda view: False  # every RunPlan (ortflow's and the run contenders') skips it

    with tempfile.TemporaryDirectory() as tmp:
        comm = MPIComm(Path(tmp) / "hb", 600.0)
        mpi, world = comm._mpi, comm.comm
        rng = np.random.default_rng(comm.rank)
        if args.grads == "engine":
            keep, grads = engine_gradients(world, args.model, Path(tmp), args.arena)
            for g in grads:
                g[...] = rng.standard_normal(g.shape)
        else:
            grads = [rng.standard_normal(s).astype(np.float32) for s in gradient_shapes(args.model)]
        scalars = np.array([1.0, 0.0], dtype=np.float32)
        flat = np.ones(sum(g.size for g in grads) + scalars.size, dtype=np.float32)
        contenders = {"bare": lambda g, d, s: world.Allreduce(mpi.IN_PLACE, flat, op=mpi.SUM),
                      "ortflow": comm.average_gradients,
                      "packed": Packed(mpi, world, grads, scalars.size),
                      "postall": PostAll(mpi, world, False), "postall-any": PostAll(mpi, world, True)}  # fmt: skip
        failed: dict[str, str] = {}
        for kib in map(int, args.buckets_kib.split(",")):
            contenders[f"buckets-{kib}"] = Buckets(comm, kib * 256)
            contenders[f"ipipe-{kib}"] = Pipelined(mpi, world, grads, scalars.size, kib * 256)
        for name, make in CONTENDERS.items():
            try:
                contenders[name] = make(mpi, world, grads, scalars.size)
            except Exception as err:  # noqa: BLE001 - an MPI library may refuse a scheme: record it, bench the rest
                failed[name] = f"{type(err).__name__}: {err}"
        if args.contenders:
            keep_names = {"bare", *args.contenders.split(",")}
            contenders = {k: v for k, v in contenders.items() if k in keep_names}
        failed.update(check(contenders, grads, scalars, world, comm.size))
        times = {name: [] for name in contenders}
        fastest = {name: [] for name in contenders}
        names = list(contenders)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                calls = []
                for _ in range(args.calls + 1):
                    world.Barrier()
                    t0 = time.perf_counter()
                    contenders[name](grads, comm.size, scalars)
                    calls.append(time.perf_counter() - t0)
                times[name].append(float(np.median(calls[1:])))
                fastest[name].append(float(np.min(calls[1:])))
        comm.close()
    if comm.rank == 0:
        num_runs = len(local_runs([g.__array_interface__["data"][0] for g in grads], [g.size for g in grads]))
        report(times, fastest, comm.size, int(flat.nbytes), len(grads), args, failed, num_runs)


def check(contenders, grads, scalars, world, size) -> dict[str, str]:
    """Every contender but ``bare`` must leave the mean over ranks in the gradients (the sum times float32(1/N), as
    the trainer's exchange computes it), bit-identical on every rank, and the sum in the scalars.

    Returns the contenders that failed, with why (and removes them from ``contenders``); each one's count of values
    that differ from the reference at all (the sum's order may differ between MPI algorithms beyond 2 ranks) is printed.
    """
    from mpi4py import MPI

    originals = [g.copy() for g in grads]
    expected = [np.empty_like(g) for g in grads]
    for g, e in zip(originals, expected, strict=True):
        world.Allreduce(g, e, op=MPI.SUM)
        np.multiply(e, np.float32(1.0 / size), out=e)
    failed = {}
    for name, fn in list(contenders.items()):
        if name.startswith("bare"):  # the yardstick and its diagnostic variants compute no mean
            continue
        for g, o in zip(grads, originals, strict=True):
            g[...] = o
        local = scalars.copy()
        try:
            fn(grads, size, local)
        except Exception as err:  # noqa: BLE001 - an MPI library may refuse a scheme when called: record it
            failed[name] = f"{type(err).__name__}: {err}"
            continue
        mine = np.concatenate([g.reshape(-1) for g in grads])
        first = world.bcast(mine if world.Get_rank() == 0 else None, root=0)
        differ = int(sum(np.count_nonzero(g != e) for g, e in zip(grads, expected, strict=True)))
        try:
            for g, e in zip(grads, expected, strict=True):
                np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7, err_msg=name)
            np.testing.assert_allclose(local, scalars * size, err_msg=name)
            if not np.array_equal(mine, first):
                raise AssertionError(f"{name}: ranks differ")
        except AssertionError as err:
            failed[name] = str(err).splitlines()[0]
        if world.Get_rank() == 0:
            print(f"check {name}: {differ} values differ from the reference sum x float32(1/N)", flush=True)
    failed = world.bcast(failed if world.Get_rank() == 0 else None, root=0)
    for name in failed:
        contenders.pop(name, None)
    for g, o in zip(grads, originals, strict=True):
        g[...] = o
    return failed


def _spread(values) -> list[float]:
    return [float(np.min(values)), float(np.median(values)), float(np.max(values))]


def report(times: dict, fastest: dict, ranks: int, nbytes: int, tensors: int, args, failed: dict, runs: int) -> None:
    """Print and write min / median / max per contender and the per-round ratio to bare.

    Two statistics per round: the median call (what a run sees on this machine, other processes included) and the
    fastest call (the closest to the exchange's own cost when other processes share the cores).
    """
    bare, bare_fast = np.array(times["bare"]), np.array(fastest["bare"])
    rows = {}
    for name, values in times.items():
        fast = np.array(fastest[name])
        rows[name] = {
            "ms": _spread(np.array(values) * 1000), "ratio_to_bare": _spread(np.array(values) / bare),
            "fastest_ms": _spread(fast * 1000), "fastest_ratio_to_bare": _spread(fast / bare_fast),
        }  # fmt: skip
    record = {"host": socket.gethostname(), "cores": os.cpu_count(), "ranks": ranks, "bytes": nbytes,
              "tensors": tensors, "rounds": args.rounds, "calls": args.calls, "load_avg": os.getloadavg(),
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "mpi": library_line(__import__("mpi4py.MPI").MPI.Get_library_version()), "contenders": rows,
              "grads": args.grads, "arena": args.arena, "huge_pages": args.huge_pages,
              "memory_runs": runs, "failed": failed}  # fmt: skip
    print("BENCH_RESULT " + json.dumps(record), flush=True)
    record["command"] = (f"mpiexec -n {ranks} python -m bench exchange --rounds {args.rounds} --calls {args.calls}"
                         + (f" --contenders {args.contenders}" if args.contenders else "")
                         + (" --grads numpy" if args.grads == "numpy" else "")
                         + (" --arena session" if args.arena == "session" else "")
                         + (" --huge-pages off" if args.huge_pages == "off" else ""))  # fmt: skip
    lines = [f"# Gradient exchange, {ranks} ranks, {nbytes / 1e6:.1f} MB in {tensors} tensors ({record['time']})", "",
             f"Host {record['host']}, {record['cores']} cores, load average {record['load_avg']}. "
             "Gradients: "
             f"{'the engine buffers' if args.grads == 'engine' else 'numpy arrays'}, in {runs} memory run(s) "
             f"(arena: {args.arena}); {record['mpi']}.", "",
             "Per round: the median call and the fastest call of each contender; figures are min / median / max "
             "over rounds; ratios are taken within a round.", "",
             "| contender | median call ms | ratio to bare | fastest call ms | ratio to bare |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, row in rows.items():
        cells = [" / ".join(f"{x:.2f}" for x in row[key])
                 for key in ("ms", "ratio_to_bare", "fastest_ms", "fastest_ratio_to_bare")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [f"\nFailed: {name}: {why}" for name, why in failed.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        arena = "-session-arena" if args.arena == "session" else ""
        arena += "-4k-pages" if args.huge_pages == "off" else ""
        stem = f"exchange-{record['host']}-{ranks}r{arena}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        write_result(args.out / stem, record, text)


if __name__ == "__main__":
    main()
