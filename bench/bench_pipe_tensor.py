"""Pipeline x tensor parallelism on CPU ranks: step time and per-rank parameter + optimizer memory of pp 2 x hp 2
against pp 2 and hp 2 (and the unsplit model) on the same GPT.

Run: ``python -m bench pipe-tensor [--steps 4] [--rounds 3]`` (writes
bench/out/pipe-tensor-<host>.json and .md). The driver configures the four runs with
:func:`bench.bench_tensor._configure` (the model of bench_tensor: GPT d_model 256, 8 heads, 2 layers, seq 64; batch
4 x 2 micro-batches; 1 thread per rank; AdamW) and starts each under mpiexec with this module's worker, which runs the
trainer's own pieces (``init_runtime``; the pipeline's ``pipeline_step`` or the tensor-parallel runtime's
``accumulate``, which runs pp x hp's 1F1B over its pieces; the gradient exchange; ortflow's update) for warm-up +
timed steps and writes one JSON per rank. Rounds alternate the layouts, so a busy shared machine slows them alike.

Memory per rank: trainable parameter values held by the rank (4 bytes each, its slices for split weights), their
gradient buffers (the same), and the optimizer state ortflow's update allocated (``Update.state_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_tensor import BATCH, MICRO, ROOT, SHAPE, _configure, _launch
from bench.common import write_result

#: name -> (ranks, hp, pp)
LAYOUTS = {"pp1hp1": (1, 1, 1), "pp2": (2, 1, 2), "hp2": (2, 2, 1), "pp2xhp2": (4, 2, 2)}


def worker(run_dir: Path, warmup: int, steps: int) -> None:
    """Under mpiexec: warm-up + timed updates with the trainer's own pieces; one JSON per rank."""
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.parallel.schedule import pipeline_step
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    rt = init_runtime(run_dir, cfg, comm)
    k = cfg.train.gradient_accumulation_steps
    shard, shards = rt.data_shard()
    batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=0).iter_from(0)
    tensor, stage = hasattr(rt, "accumulate"), hasattr(rt, "pipe_comm")
    grads = rt.gradient_buffers()
    times = []
    for step in range(warmup + steps):
        comm.barrier("bench step")
        started = time.perf_counter()
        if tensor:
            rt.accumulate(batches, k)
        elif stage:
            pipeline_step(rt, batches, k)
        else:
            names = rt.module.input_names()
            for _ in range(k):
                feeds = next(batches)
                rt.module(*(feeds[n] for n in names))
        mine = rt.exchange.reduce(grads, k * shards, np.zeros(0, np.float32))
        rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.reset_gradients() if tensor else rt.module.lazy_reset_grad()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    param = rt.param if tensor else (lambda n: rt.state.parameters[n])
    values = sum(int(np.prod(param(n).data.shape)) for n in rt.trainable)
    record = {"rank": comm.rank, "step_s": statistics.median(times), "samples_per_step": k * cfg.train.batch_size *
              shards, "memory": {"parameters": 4 * values, "gradients": 4 * values,
                                 "optimizer_state": int(rt.update.state_bytes)}}
    (run_dir / f"bench-rank{comm.rank}.json").write_text(json.dumps(record))
    comm.barrier("bench done")
    comm.close()


def summarize(results: dict) -> dict:
    """Per layout: median (over rounds) of the slowest rank's step, samples/s, and each rank's memory."""
    out = {}
    base = results["pp1hp1"][0][0]["memory"]
    base_static = base["parameters"] + base["optimizer_state"]
    for name, rounds in results.items():
        step = statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds)
        memory = [r["memory"] for r in rounds[0]]
        static = [m["parameters"] + m["optimizer_state"] for m in memory]
        out[name] = {"ranks": len(rounds[0]), "step_s": step,
                     "samples_per_s": rounds[0][0]["samples_per_step"] / step, "memory": memory,
                     "largest_rank_params_plus_optimizer": max(static),
                     "largest_rank_vs_unsplit": max(static) / base_static}
    return out


def report(record: dict) -> str:
    s, mib = record["summary"], 2**20
    lines = [f"# Pipeline x tensor parallelism on CPU ranks ({record['host']}, {record['cores']} cores)", "",
             f"Command: `{record['command']}`", "",
             f"GPT {record['shape']}, batch {BATCH} x {MICRO} micro-batches per update, 1 thread per rank, AdamW "
             "(ortflow's update); medians over rounds of the slowest rank's step.", "",
             "| layout | ranks | step s | samples/s | per-rank params MiB | per-rank AdamW state MiB | "
             "largest rank params+state vs unsplit |", "|---|---|---|---|---|---|---|"]
    for name, t in s.items():
        params = " / ".join(f"{m['parameters'] / mib:.2f}" for m in t["memory"])
        state = " / ".join(f"{m['optimizer_state'] / mib:.2f}" for m in t["memory"])
        lines.append(f"| {name} | {t['ranks']} | {t['step_s']:.3f} | {t['samples_per_s']:.1f} | {params} | {state} | "
                     f"{t['largest_rank_vs_unsplit']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--names-from", type=Path, help=argparse.SUPPRESS)  # bench_tensor's launcher passes it
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.warmup, args.steps)
    with tempfile.TemporaryDirectory(prefix="bench-pipe-tensor-") as tmp:
        root = Path(tmp)
        runs = {name: (_configure(root, name, ranks, hp, pp), ranks) for name, (ranks, hp, pp) in LAYOUTS.items()}
        results: dict = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (run_dir, ranks) in runs.items():
                results[name].append(_launch(run_dir, run_dir, ranks, args.warmup, args.steps,
                                             module="bench.bench_pipe_tensor"))
    command = "python -m bench pipe-tensor " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "cores": os.cpu_count(),
              "platform": platform.platform(), "load_avg": os.getloadavg(), "shape": SHAPE, "batch_size": BATCH,
              "summary": summarize(results), "raw": results}
    out = ROOT / "bench" / "out" / f"pipe-tensor-{socket.gethostname()}"
    write_result(out, record, report(record))
    print(report(record))


if __name__ == "__main__":
    main()
