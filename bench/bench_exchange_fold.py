"""The fold of the gradient exchange's scales (comm/pending.py): the exchange, norm, clip and update with the mean's
1/N scale and the clip factor applied on the fly, against the same sequence with passes of their own.

Run under the launcher (2 ranks here, 16 on the device machine's CPUs)::

    OPENBLAS_NUM_THREADS=1 .venv/bin/mpiexec -n 2 python -m bench exchange-fold --rounds 30 \
        --out bench/results

(``OPENBLAS_NUM_THREADS`` as ``ortflow train`` sets it for its ranks: the rank's threads; numpy's dot uses it.)

On the engine's own gradient buffers of the bench GPT (the trainer's arena, as ``bench/bench_exchange.py``), contenders
interleaved within every round (the order reversed every other round), every call started together on all ranks (a
barrier first) and every gradient refilled with the same values before every call (not timed):

* ``bare``: one blocking ``Allreduce(IN_PLACE)`` of a numpy buffer of the same bytes (no mean);
* ``exchange-eager``: ``MPIComm.average_gradients`` scaling each run by 1/N after its reduction (before the fold);
* ``exchange-fold``: the same with ``defer_scale``: the sums stay, the scale is returned;
* ``update-eager``: what the loop does per update before the fold: the exchange, the norm, the clip pass (clipping
  applies: ``--max-norm`` is far below the norm) and the AdamW step (``optim.Update``, fused kernels);
* ``update-fold``: the same through ``Zero0(fold=True)``: the exchange leaves the sums, the norm scales chunks in
  cache, the clip factor is owed, the step applies both factors as it reads each gradient;
* ``norm-whole`` / ``norm-chunked``: the gradient norm alone, one dot per tensor (the eager norm) or per 64K-value
  chunk (comm/pending.py).

Before timing, both update sequences run once from the same parameters and must give the same bits. Rank 0 prints
one JSON line and, with ``--out``, writes ``exchange-fold-<host>-<ranks>r-<date>.json`` and ``.md``: min / median /
max over rounds of each contender's round-median call, and of the per-round ratios.
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

from bench.bench_exchange import engine_gradients, gradient_shapes
from bench.record import write_result

RATIOS = (("exchange-eager", "bare"), ("exchange-fold", "bare"), ("update-fold", "update-eager"),
          ("exchange-fold", "exchange-eager"), ("norm-chunked", "norm-whole"))  # fmt: skip


def norm_whole(grads, divisor, scalars):
    """The eager norm: one float32 dot per tensor, added in float64."""
    return float(np.sqrt(sum(float(np.dot(g.reshape(-1), g.reshape(-1))) for g in grads)))


def norm_chunked(grads, divisor, scalars):
    """The norm now (nothing owed): one float32 dot per 64K-value chunk, added in float64."""
    from ortflow.trainer.comm.pending import gradient_norm

    return gradient_norm(grads)


def make_update(grads, threads: int):
    """AdamW (torch rule, the default config) over parameters of the gradients' shapes, as the trainer builds it."""
    from ortflow.config import OptimizerConfig
    from ortflow.trainer import optim

    names = [f"p{i:03d}" for i in range(len(grads))]
    params = [np.random.default_rng([5, i]).standard_normal(g.size).astype(np.float32) for i, g in enumerate(grads)]
    opt = OptimizerConfig(name="adamw", weight_decay=0.01)
    update = optim.build_update(opt, optim.whole_segments(names, [p.size for p in params]), params, threads=threads)
    return update, params


class UpdateSequence:
    """One update's gradient work as the loop does it: exchange, norm, clip, step (guards.clip_gradients)."""

    def __init__(self, comm, grads, fold: bool, max_norm: float, threads: int):
        from ortflow.trainer.optim.zero import Zero0

        self.comm, self.fold, self.max_norm = comm, fold, max_norm
        self.exchange = Zero0(comm, fold=fold)
        self.update, self.params = make_update(grads, threads)
        self.norms: list[float] = []

    def __call__(self, grads, divisor, scalars):
        from ortflow.trainer.guards import clip_gradients

        self.comm.defer_scale = self.fold
        mine = self.exchange.reduce(grads, divisor, scalars)
        norm = self.exchange.norm(mine)
        clip_gradients(self.exchange, mine, norm, self.max_norm)
        self.update.step(mine, 1e-4)
        self.norms.append(norm)


def exchange_call(comm, defer: bool):
    def call(grads, divisor, scalars):
        comm.defer_scale = defer
        comm.average_gradients(grads, divisor, scalars)
    return call


def check(comm, grads, originals, max_norm: float, threads: int) -> None:
    """Both update sequences from the same parameters give the same parameters, state and norm (or raise)."""
    results = []
    for fold in (False, True):
        seq = UpdateSequence(comm, grads, fold, max_norm, threads)
        for g, o in zip(grads, originals, strict=True):
            np.copyto(g, o)
        seq(grads, comm.size, np.zeros(2, np.float32))
        results.append(seq)
    eager, fold = results
    if eager.norms != fold.norms or not eager.norms[0] > max_norm:
        raise AssertionError(f"norms differ or clipping did not apply: {eager.norms} {fold.norms}")
    for a, b in zip(eager.params, fold.params, strict=True):
        if not np.array_equal(a, b):
            raise AssertionError("the folded update's parameters differ from the eager one's")
    for key in eager.update.state:
        if not np.array_equal(eager.update.state[key], fold.update.state[key]):
            raise AssertionError(f"the folded update's {key} differs from the eager one's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench exchange-fold")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per contender per round")
    parser.add_argument("--threads", type=int, default=1, help="the update's threads (the rank's intra-op threads)")
    parser.add_argument("--max-norm", type=float, default=1e-3, help="optimizer.max_grad_norm (below the norm)")
    parser.add_argument("--grads", choices=("engine", "numpy"), default="engine")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from ortflow.trainer.comm import MPIComm

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        comm = MPIComm(Path(tmp) / "hb", 600.0)
        mpi, world = comm._mpi, comm.comm
        if args.grads == "engine":
            keep, grads = engine_gradients(world, args.model, Path(tmp), "trainer")  # noqa: F841 - keeps buffers
        else:
            grads = [np.empty(s, np.float32) for s in gradient_shapes(args.model)]
        rng = np.random.default_rng(comm.rank)
        originals = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
        flat = np.ones(sum(g.size for g in grads) + 2, dtype=np.float32)
        check(comm, grads, originals, args.max_norm, args.threads)
        contenders = {
            "bare": lambda g, d, s: world.Allreduce(mpi.IN_PLACE, flat, op=mpi.SUM),
            "exchange-eager": exchange_call(comm, False), "exchange-fold": exchange_call(comm, True),
            "update-eager": UpdateSequence(comm, grads, False, args.max_norm, args.threads),
            "update-fold": UpdateSequence(comm, grads, True, args.max_norm, args.threads),
            "norm-whole": norm_whole, "norm-chunked": norm_chunked,
        }  # fmt: skip
        times = {name: [] for name in contenders}
        names = list(contenders)
        scalars = np.zeros(2, np.float32)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                calls = []
                for _ in range(args.calls + 1):
                    for g, o in zip(grads, originals, strict=True):
                        np.copyto(g, o)
                    flat[:] = 1.0
                    scalars[:] = (1.0, 0.0)
                    world.Barrier()
                    t0 = time.perf_counter()
                    contenders[name](grads, comm.size, scalars)
                    calls.append(time.perf_counter() - t0)
                times[name].append(float(np.median(calls[1:])))
        comm.close()
    if comm.rank == 0:
        loads = [[round(x, 2) for x in load] for load in (load_before, os.getloadavg())]
        report(times, comm.size, int(flat.nbytes), len(grads), args, loads)


def _spread(values) -> list[float]:
    return [float(np.min(values)), float(np.median(values)), float(np.max(values))]


def report(times: dict, ranks: int, nbytes: int, tensors: int, args, loads) -> None:
    """Print and write the contenders' round-median call times and the per-round ratios (min / median / max)."""
    rows = {name: _spread(np.array(v) * 1000) for name, v in times.items()}
    ratios = {f"{a} / {b}": _spread(np.array(times[a]) / np.array(times[b])) for a, b in RATIOS}
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    command = ((f"OPENBLAS_NUM_THREADS={blas} " if blas else "")
               + f"mpiexec -n {ranks} python -m bench exchange-fold --rounds {args.rounds} --calls {args.calls}"
               f" --threads {args.threads} --max-norm {args.max_norm}"
               + (" --grads numpy" if args.grads == "numpy" else ""))  # fmt: skip
    record = {"host": socket.gethostname(), "cores": os.cpu_count(), "ranks": ranks, "bytes": nbytes,
              "tensors": tensors, "rounds": args.rounds, "calls": args.calls, "threads": args.threads,
              "load_avg_before": loads[0], "load_avg_after": loads[1], "command": command,
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "grads": args.grads,
              "mpi": __import__("mpi4py.MPI").MPI.Get_library_version().splitlines()[0].strip(),
              "ms": rows, "ratios": ratios}  # fmt: skip
    print("BENCH_RESULT " + json.dumps(record), flush=True)
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [f"# Exchange fold, {ranks} ranks, {nbytes / 1e6:.1f} MB in {tensors} tensors ({record['time']})", "",
             "```", command, "```", "",
             f"Host {record['host']}, {record['cores']} cores, load average {loads[0]} before, {loads[1]} after; "
             f"{record['mpi']}; gradients: {'engine buffers (trainer arena)' if args.grads == 'engine' else 'numpy'}"
             f"; update: AdamW (torch rule), {args.threads} thread(s); clipping applies every call.", "",
             "Min / median / max over rounds of each contender's median call (ms), and of the ratios taken within "
             "each round.", "", "| contender | ms |", "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {fmt(row)} |" for name, row in rows.items()]
    lines += ["", "| ratio | min / median / max |", "|---|---|"]
    lines += [f"| {name} | **{fmt(row)}** |" for name, row in ratios.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"exchange-fold-{record['host']}-{ranks}r-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        write_result(args.out / stem, record, text)


if __name__ == "__main__":
    main()
