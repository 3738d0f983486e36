"""ortflow's update vs the engine's optimizer step, 1 rank on the CPU, side by side in one run, at equal threads.

    python -m bench optim [--d-model 512 --num-layers 3] [--rounds 15] [--threads 1,2] [--out FILE.md]

The model is ortflow's example GPT (its parameter tensors are what the update touches; forward/backward is run once
to fill the engine's gradient buffers). The engine's AdamW graph (onnxblock ``AdamW``, adam_mode=1) is built for it
as ortflow built it before owning the update, once per thread count (its session's intra-op threads). Every variant
updates the same engine buffers in interleaved rounds (each variant at every thread count back to back, then the
next variant; repeated), so a loaded machine slows all alike. Variants at each thread count: ortflow's rules with
the ``fused`` (default) and ``numpy`` backends, and a naive numpy AdamW (a temporary per operation). Reported per
variant: min and median ms, the median's ratio to the engine's step at the same threads, GB/s for the bytes the rule
must move (AdamW/Lamb: 28 bytes/parameter, SGD with momentum 20), and whether the variant gives the bits of ortflow's
numpy rule (checked on random tensors: 3 steps, 3 tensors).

Below: ZeRO-1 against ZeRO-0 at N CPU ranks (``python -m bench optim-zero``, ``ZERO_DOC``) and the check of the
``rule: torch`` AdamW against ``torch.optim.AdamW`` (``python -m bench optim-torch-check``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
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
from ortflow.trainer.optim import build_rule, build_update, decays, whole_segments
from ortflow.trainer.optim.segments import Update, default_backend
from ortflow.trainer.optim.zero import Zero0, Zero1


def _gpt_module(folder: Path, d_model: int, num_layers: int, optimizer, options):
    """A bench GPT's engine module (artifacts generated into ``folder``) and its state and parameter names."""
    from ortflow.engine import api, artifacts

    model = onnx.load(str(build_gpt(folder / "gpt.onnx", seq_len=64, d_model=d_model, num_layers=num_layers,
                                    num_heads=4)))
    names = sorted(t.name for t in model.graph.initializer)
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        artifacts.generate_artifacts(model, requires_grad=names, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer,
                                     artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=options(state))
    module.train()
    return state, module, names


def engine_session(folder: Path, d_model: int, num_layers: int, threads: int):
    from ortflow.engine import api, onnxblock
    from ortflow.trainer.runtime import session_options

    state, module, names = _gpt_module(folder, d_model, num_layers,
                                       onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.01),
                                       lambda _: session_options(threads))
    optimizer = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 64)).astype(np.int64)
    module(ids, np.roll(ids, -1, axis=1).reshape(-1))
    return state, module, optimizer, names


def naive_adamw(params, grads, m, v, lr, t, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    """The textbook numpy AdamW: whole tensors, a temporary per operation (the baseline the chunks improve on)."""
    for p, g, mi, vi in zip(params, grads, m, v, strict=True):
        p *= 1 - lr * wd
        mi[...] = b1 * mi + (1 - b1) * g
        vi[...] = b2 * vi + (1 - b2) * g * g
        p -= lr / (1 - b1**t) * mi / (np.sqrt(vi) / np.sqrt(1 - b2**t) + eps)


ADAMW = OptimizerConfig(weight_decay=0.01, epsilon=1e-8)
ENGINE_RULE = OptimizerConfig(rule="engine", weight_decay=0.01, epsilon=1e-8)
SGD = OptimizerConfig(name="sgd", momentum=0.9, nesterov=True)
LAMB = OptimizerConfig(name="lamb", weight_decay=0.01)


def ours(opt: OptimizerConfig, names, params, threads: int, backend: str, chunk: int | None = None) -> Update:
    extra = {"chunk": chunk} if chunk else {}
    return Update(build_rule(opt), whole_segments(names, [p.size for p in params]), params, decays(names, ()),
                  threads=threads, backend=backend, **extra)


def bits_of_numpy_rule(make_step, threads: int) -> bool:
    """Whether ``make_step`` (an AdamW torch variant) gives the bits of the numpy rule: 3 steps on 3 random tensors."""
    rng = np.random.default_rng(0)
    sizes = [1000, 33, 70001]
    init = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    steps = [[(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 3)).astype(np.float32) for s in sizes]
             for _ in range(3)]
    names = ["a", "b", "c"]
    ref = [p.copy() for p in init]
    update = ours(ADAMW, names, ref, 1, "numpy")
    mine, grads = [p.copy() for p in init], [np.empty_like(p) for p in init]
    step = make_step(mine, grads, threads)
    for k, gs in enumerate(steps):
        update.step([g.copy() for g in gs], 1e-3)
        for g, s in zip(grads, gs, strict=True):
            g[...] = s
        step(1e-3, k + 1)
    return all(np.array_equal(a, b) for a, b in zip(mine, ref, strict=True))


def fused_step(params, grads, threads):
    update = ours(ADAMW, [str(i) for i in range(len(params))], params, threads, "fused")
    return lambda lr, t: update.step(grads, lr)


def variants_at(threads: int, optimizer, params, grads, names) -> dict[str, tuple]:
    """name -> (call, bytes per parameter, gives the numpy rule's bits) at ``threads``."""
    def rule(opt, backend, chunk=None):
        update = ours(opt, names, params, threads, backend, chunk)
        return lambda: update.step(grads, 1e-4)

    def counted(step):
        t = [0]

        def call():
            t[0] += 1
            step(1e-4, t[0])
        return call

    fused = default_backend() == "fused"  # Numba installed (the device's carried wheels may lack it)
    out = {"engine AdamW graph (optimizer.step)": (optimizer.step, 28, None)}
    if fused:
        out["adamw torch, fused (default)"] = (rule(ADAMW, "fused"), 28, bits_of_numpy_rule(fused_step, threads))
    out |= {
        "adamw torch, numpy chunks 64K": (rule(ADAMW, "numpy"), 28, True),
        "adamw torch, numpy chunks 8K": (rule(ADAMW, "numpy", 8192), 28, True),
    }
    if threads == 1:
        m, v = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
        out["adamw torch, numpy naive (temporaries)"] = (lambda: naive_adamw(params, grads, m, v, 1e-4, 1), 28, False)
    for label, opt, nbytes in (("adamw engine rule", ENGINE_RULE, 28), ("sgd momentum+nesterov", SGD, 20),
                               ("lamb", LAMB, 28)):
        if fused:
            out[f"{label}, fused"] = (rule(opt, "fused"), nbytes, True)
        out[f"{label}, numpy"] = (rule(opt, "numpy"), nbytes, True)
    return out


def measure(args, folder: Path) -> tuple[int, int, dict]:
    engines, variants = {}, {}
    for threads in args.threads:
        sub = folder / f"t{threads}"
        sub.mkdir()
        state, module, optimizer, names = engine_session(sub, args.d_model, args.num_layers, threads)
        optimizer.set_learning_rate(1e-4)
        params = [state.parameters[n].data.reshape(-1) for n in names]
        grads = [state.parameters[n].grad.reshape(-1) for n in names]
        engines[threads] = (state, module, optimizer, grads, [g.copy() for g in grads])
        variants[threads] = variants_at(threads, optimizer, params, grads, names)
    times = {(t, k): [] for t in args.threads for k in variants[t]}
    # Each variant at every thread count back to back, so that drift of a shared machine hits a pair alike.
    order = sorted(times, key=lambda key: (list(variants[args.threads[0]]).index(key[1])
                                           if key[1] in variants[args.threads[0]] else len(times), key[0]))
    for _ in range(args.rounds + 1):  # the first round warms up (compilation, page faults) and is dropped
        for threads, name in order:
            grads, saved = engines[threads][3], engines[threads][4]
            for g, s in zip(grads, saved, strict=True):
                g[...] = s  # Lamb writes its update direction into the gradient buffers
            call = variants[threads][name][0]
            start = time.perf_counter()
            call()
            times[(threads, name)].append(time.perf_counter() - start)
    num = int(sum(g.size for g in engines[args.threads[0]][3]))
    rows = {}
    for (threads, name), t in times.items():
        _, nbytes, bits = variants[threads][name]
        rows[(threads, name)] = {"min_ms": min(t[1:]) * 1e3, "median_ms": statistics.median(t[1:]) * 1e3,
                                 "bytes_per_param": nbytes, "bits": bits}
    return num, len(engines[args.threads[0]][3]), rows


def report(args, num: int, tensors: int, rows: dict) -> str:
    lines = [
        f"# ortflow update vs engine optimizer step (CPU, 1 rank) - {num:,} parameters, {tensors} tensors", "",
        f"Load average at the end {os.getloadavg()[0]:.1f}; {args.rounds} interleaved rounds. "
        "vs engine: median over the engine step's median at the same threads. GB/s: bytes the rule must move "
        "(AdamW/Lamb 28 B/param, SGD-momentum 20) / median time. bits: gives the numpy rule's bits.", "",
        "| threads | variant | min ms | median ms | vs engine | GB/s | bits |", "|---:|---|---:|---:|---:|---:|---|",
    ]
    for (threads, name), r in rows.items():
        base = rows[(threads, "engine AdamW graph (optimizer.step)")]["median_ms"]
        gbs = num * r["bytes_per_param"] / (r["median_ms"] * 1e-3) / 1e9
        bits = {None: "-", True: "yes", False: "no"}[r["bits"]]
        lines.append(f"| {threads} | {name} | {r['min_ms']:.1f} | {r['median_ms']:.1f} | "
                     f"{r['median_ms'] / base:.2f}x | {gbs:.1f} | {bits} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                        help="Thread counts, comma-separated: the engine's intra-op threads and every variant's.")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        num, tensors, rows = measure(args, Path(tmp))
    text = report(args, num, tensors, rows)
    print(text)
    if args.out:
        data = [{"threads": t, "variant": k, **r} for (t, k), r in rows.items()]
        write_result(args.out.with_suffix(""), {"num_parameters": num, "rows": data}, text)
    return 0


# ortflow's AdamW ``rule: torch`` against the real ``torch.optim.AdamW`` on the same gradients (needs the bench extra).
#
#     python -m bench optim-torch-check [--steps 100]
#
# Both start from the same float32 parameters and see the same gradients for ``--steps`` updates (a varying learning
# rate, weight decay on all but the bias-like tensors); prints the largest absolute difference relative to the
# parameters' scale and exits 1 if it exceeds fp32 rounding accumulated over the steps (2e-5, the bound the float64
# reference test uses).

def torch_check_main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    sizes, names = (700, 33, 20000), ("w1", "b1", "w2")
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    ours = [p.copy() for p in init]
    opt = OptimizerConfig(beta1=0.9, beta2=0.99, epsilon=1e-6, weight_decay=0.1, no_weight_decay=("b*",))
    update = build_update(opt, whole_segments(names, sizes), ours)
    theirs = [torch.tensor(p, requires_grad=True) for p in init]
    groups = [{"params": [theirs[0], theirs[2]], "weight_decay": 0.1}, {"params": [theirs[1]], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, foreach=False)
    for k in range(args.steps):
        lr = 1e-2 * (0.5 + 0.5 * np.cos(k / args.steps))
        grads = [rng.standard_normal(s).astype(np.float32) for s in sizes]
        for t, g in zip(theirs, grads, strict=True):
            t.grad = torch.from_numpy(g.copy())
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        update.step([g.copy() for g in grads], lr)
    worst = max(float(np.abs(o - t.detach().numpy()).max()) / max(1.0, float(np.abs(o).max()))
                for o, t in zip(ours, theirs, strict=True))
    print(f"ortflow adamw (rule torch) vs torch.optim.AdamW {torch.__version__}, {args.steps} steps: "
          f"max |difference| / scale = {worst:.2e}")
    return 0 if worst <= 2e-5 else 1


ZERO_DOC = """ZeRO-1 vs ZeRO-0 at N CPU ranks, side by side in one run: per-rank update and step time, optimizer memory.

    .venv/bin/mpiexec -n 2 python -m bench optim-zero [--d-model 512 --num-layers 3] [--rounds 5]
        [--out bench/reports/optim-zero-cpu.md]

Every rank runs the engine's forward/backward of ortflow's example GPT (1 thread, batch 2 x 64), then that stage's
exchange + update + gather (AdamW torch rule, clipping on so the global norm is computed), stages interleaved in
rounds from the same parameters. Reported per stage, the median over rounds of the mean over ranks: gradient
exchange (all-reduce, or reduce-scatter + the small norm all-gather), the update, the parameter all-gather, the
whole step (forward/backward included), and the optimizer-state bytes each rank holds.
"""


def zero_session(folder: Path, d_model: int, num_layers: int):
    from ortflow.trainer.arena import use_gradient_arena
    from ortflow.trainer.runtime import session_options

    def options(state):  # as the trainer sets them for a run whose update is ortflow's
        return use_gradient_arena(session_options(1), 4 * sum(p.data.size for _, p in state.parameters))

    return _gpt_module(folder, d_model, num_layers, None, options)


def zero_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=ZERO_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        comm = MPIComm(Path(tmp) / ".ranks", 600.0)
        state, module, names = zero_session(Path(tmp), args.d_model, args.num_layers)
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
            f"Median over {args.rounds} interleaved rounds of the mean over ranks, ms; state: MiB per rank.", "",
            "| stage | forward+backward | exchange | update | update, slowest rank | gather | step | "
            "optimizer state |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        command = f"mpiexec -n {comm.size} python -m bench optim-zero {shlex.join(sys.argv[1:])}".strip()
        result = {"command": command, "ranks": comm.size, "num_parameters": num, "rounds": args.rounds, "stages": {}}
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

def zero_table(results: list[dict]) -> str:
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


def zero_report_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=ZERO_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("optim-zero-*ranks.json"))
    if not files:
        print(f"no optim-zero-*ranks.json in {args.folder}", file=sys.stderr)
        return 1
    runs = [json.loads(f.read_text()) for f in files]
    text = "# ZeRO-1 vs ZeRO-0 by rank count (CPU)\n\n" + zero_table(runs)
    print(text)
    write_result((args.out or args.folder / "optim-zero-scaling.md").with_suffix(""), {"runs": runs}, text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
