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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
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
from ortflow.trainer.optim import build_rule, build_update, decays, whole_segments
from ortflow.trainer.optim.segments import Update, default_backend


def engine_session(folder: Path, d_model: int, num_layers: int, threads: int):
    from ortflow.engine import api, artifacts, onnxblock
    from ortflow.trainer.runtime import session_options

    model = onnx.load(str(build_gpt(folder / "gpt.onnx", seq_len=64, d_model=d_model, num_layers=num_layers,
                                    num_heads=4)))
    names = sorted(t.name for t in model.graph.initializer)
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        artifacts.generate_artifacts(model, requires_grad=names, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.01),
                                     artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=session_options(threads))
    optimizer = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    module.train()
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


def report(args, argv, num: int, tensors: int, rows: dict) -> str:
    command = "python -m bench optim " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# ortflow update vs engine optimizer step (CPU, 1 rank) - {num:,} parameters, {tensors} tensors", "",
        f"Command: `{command.strip()}`  ", f"Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared; load average at the end {os.getloadavg()[0]:.1f}), numpy {np.__version__}; "
        f"{args.rounds} interleaved rounds. "
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
    text = report(args, argv, num, tensors, rows)
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

if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
