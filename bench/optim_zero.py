"""ZeRO-1 vs ZeRO-0 at N CPU ranks, side by side in one run: per-rank update time, step time, optimizer memory.

    .venv/bin/mpiexec -n 2 python -m bench optim-zero [--d-model 512 --num-layers 3] [--rounds 5]
        [--out bench/reports/optim-zero-cpu.md]

Every rank runs the engine's forward/backward of ortflow's example GPT (1 thread, batch 2 x 64), then that stage's
exchange + update + gather (AdamW torch rule, clipping on so the global norm is computed), stages interleaved in
rounds from the same parameters. Reported per stage, the median over rounds of the mean over ranks: gradient
exchange (all-reduce, or reduce-scatter + the small norm all-gather), the update, the parameter all-gather, the
whole step (forward/backward included), and the optimizer-state bytes each rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from bench.common import write_result
from ortflow.config import OptimizerConfig
from ortflow.examples import build_gpt
from ortflow.trainer import optim
from ortflow.trainer.comm.mpi import MPIComm
from ortflow.trainer.optim.zero import Zero0, Zero1


def session(folder: Path, d_model: int, num_layers: int):
    from ortflow.engine import api, artifacts
    from ortflow.trainer.runtime import session_options

    model = onnx.load(str(build_gpt(folder / "gpt.onnx", seq_len=64, d_model=d_model, num_layers=num_layers,
                                    num_heads=4)))
    names = sorted(t.name for t in model.graph.initializer)
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        artifacts.generate_artifacts(model, requires_grad=names, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=None,
                                     artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    from ortflow.trainer.arena import use_gradient_arena

    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = use_gradient_arena(session_options(1), 4 * sum(p.data.size for _, p in state.parameters))  # as trainer
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=options)
    module.train()
    return state, module, names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        comm = MPIComm(Path(tmp) / ".ranks", 600.0)
        state, module, names = session(Path(tmp), args.d_model, args.num_layers)
        params = [state.parameters[n].data.reshape(-1) for n in names]
        initial = [p.copy() for p in params]
        grads_engine = [state.parameters[n].grad for n in names]
        opt = OptimizerConfig(weight_decay=0.01, max_grad_norm=1.0)
        zero1 = Zero1(comm, names, params, comm.rank, comm.size)
        stages = {
            "ZeRO-0": (Zero0(comm), optim.build_update(opt, optim.whole_segments(names, [p.size for p in params]),
                                                        params)),
            "ZeRO-1": (zero1, optim.build_update(opt, zero1.segments, zero1.my_params(), zero1.sum_across_ranks,
                                                 len(names))),
        }
        rng = np.random.default_rng(comm.rank)
        times = {k: {"forward+backward": [], "exchange": [], "update": [], "gather": [], "step": []} for k in stages}
        slowest: dict[str, list[float]] = {k: [] for k in stages}
        for _ in range(args.rounds + 1):
            ids = rng.integers(0, 256, (2, 64)).astype(np.int64)
            for name, (exchange, update) in stages.items():
                for p, q in zip(params, initial, strict=True):
                    p[...] = q  # every stage starts each round from the same parameters
                t0 = time.perf_counter()
                module(ids, np.roll(ids, -1, axis=1).reshape(-1))
                t1 = time.perf_counter()
                scalars = np.zeros(2, dtype=np.float32)
                mine = exchange.reduce(grads_engine, comm.size, scalars)
                norm = exchange.norm(mine)
                if norm > 1.0:
                    exchange.scale(mine, 1.0 / (norm + 1e-6))
                t2 = time.perf_counter()
                update.step(mine, 1e-4)
                t3 = time.perf_counter()
                exchange.gather()
                t4 = time.perf_counter()
                module.lazy_reset_grad()
                total = comm.allreduce_sum(np.array([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0]), "times")
                for key, value in zip(times[name], total / comm.size, strict=True):
                    times[name][key].append(float(value))
                # The slowest rank's update (the gather waits for it): each rank's time in its own slot, summed.
                every = comm.allreduce_sum(np.eye(comm.size)[comm.rank] * (t3 - t2), "update times")
                slowest[name].append(float(every.max()))
        state_bytes = {k: comm.allreduce_sum(np.array([u.state_bytes]), "bytes") / comm.size for k, (_, u) in
                       stages.items()}
        comm.close()
    if comm.rank == 0:
        num = int(sum(p.size for p in params))
        lines = [
            f"# ZeRO-1 vs ZeRO-0 on {comm.size} CPU ranks - {num:,} parameters (AdamW torch, clipping on)", "",
            "Command: `mpiexec -n {} python -m bench optim-zero {}`  ".format(comm.size, " ".join(sys.argv[1:])),
            f"Median over {args.rounds} interleaved rounds of the mean over ranks, ms; state: MiB per rank.", "",
            "| stage | forward+backward | exchange | update | update, slowest rank | gather | step | "
            "optimizer state |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        result = {"ranks": comm.size, "num_parameters": num, "rounds": args.rounds, "stages": {}}
        for name in stages:
            med = {k: statistics.median(v[1:]) * 1e3 for k, v in times[name].items()}
            med["update_slowest"] = statistics.median(slowest[name][1:]) * 1e3
            med["state_mib"] = float(state_bytes[name][0]) / 2**20
            result["stages"][name] = med
            lines.append(f"| {name} | {med['forward+backward']:.1f} | {med['exchange']:.1f} | {med['update']:.1f} | "
                         f"{med['update_slowest']:.1f} | {med['gather']:.1f} | {med['step']:.1f} | "
                         f"{med['state_mib']:.1f} |")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            write_result(args.out.with_suffix(""), result, text)
    return 0


# One table from ``python -m bench optim-zero`` runs at several rank counts.
#
# Each run: ``mpiexec -n N python -m bench optim-zero --out DIR/optim-zero-Nranks.md``.
#
#     python -m bench optim-zero-report DIR [--out DIR/optim-zero-scaling.md]
#
# Reads ``DIR/optim-zero-<N>ranks.json``; per rank count: the ZeRO-0 and ZeRO-1 update times (mean over ranks and the
# slowest rank), ZeRO-1's update relative to the 1-rank update (goal: close to 1/N), the step times and their ratio
# (goal: ZeRO-1 not slower), and the optimizer state per rank.

def table(results: list[dict]) -> str:
    """Markdown rows for results sorted by rank count; the smallest rank count is the reference."""
    results = sorted(results, key=lambda r: r["ranks"])
    base = results[0]
    ref = base["stages"]["ZeRO-0"]["update"]
    lines = [
        f"Reference: the ZeRO-0 update at {base['ranks']} rank(s), {ref:.1f} ms; {base['num_parameters']:,} "
        "parameters. ms are medians over rounds; 'mean' over ranks, 'slowest' the slowest rank.", "",
        "| ranks | ZeRO-0 update | ZeRO-1 update mean | ZeRO-1 slowest | ZeRO-1 / reference | 1/N | ZeRO-0 step | "
        "ZeRO-1 step | step ZeRO-1/ZeRO-0 | state ZeRO-0 MiB | state ZeRO-1 MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        z0, z1, n = r["stages"]["ZeRO-0"], r["stages"]["ZeRO-1"], r["ranks"]
        lines.append(
            f"| {n} | {z0['update']:.1f} | {z1['update']:.1f} | {z1['update_slowest']:.1f} | "
            f"{z1['update_slowest'] / ref:.2f} | {1 / n:.2f} | {z0['step']:.1f} | {z1['step']:.1f} | "
            f"{z1['step'] / z0['step']:.2f} | {z0['state_mib']:.1f} | {z1['state_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def report_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("optim-zero-*ranks.json"))
    if not files:
        print(f"no optim-zero-*ranks.json in {args.folder}", file=sys.stderr)
        return 1
    runs = [json.loads(f.read_text()) for f in files]
    text = "# ZeRO-1 vs ZeRO-0 by rank count (CPU)\n\n" + table(runs)
    print(text)
    write_result((args.out or args.folder / "optim-zero-scaling.md").with_suffix(""), {"runs": runs}, text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
