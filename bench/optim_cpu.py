"""ortflow's update vs the engine's optimizer step, 1 rank on the CPU, side by side in one run.

    .venv/bin/python -m bench.optim_cpu [--d-model 512 --num-layers 3] [--rounds 7] [--threads 1] [--out FILE.md]

The model is ortflow's example GPT (its parameter tensors are what the update touches; forward/backward is run once
to fill the engine's gradient buffers). The engine's AdamW graph (onnxblock ``AdamW``, adam_mode=1) is built for it
as ortflow built it before owning the update. Every variant updates the same engine buffers in interleaved rounds
(engine, then each variant, repeated), so a loaded machine slows all alike. ``--threads``: the engine's intra-op
threads and ortflow's update threads (the engine's AdamW kernel loops over tensors on one thread whatever its pool).
The median per variant is reported with its ratio to the engine's step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from ortflow.config import OptimizerConfig
from ortflow.examples import build_gpt
from ortflow.trainer.optim import build_rule, decays, whole_segments
from ortflow.trainer.optim.base import Update


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="Engine intra-op threads and ortflow's update threads.")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        state, module, optimizer, names = engine_session(Path(tmp), args.d_model, args.num_layers, args.threads)
        optimizer.set_learning_rate(1e-4)
        params = [state.parameters[n].data.reshape(-1) for n in names]
        grads = [state.parameters[n].grad.reshape(-1) for n in names]
        saved = [g.copy() for g in grads]
        segs = whole_segments(names, [p.size for p in params])
        num = int(sum(p.size for p in params))

        def ours(opt: OptimizerConfig, chunk: int | None = None):
            rule = build_rule(opt)
            extra = {"chunk": chunk} if chunk else {}
            update = Update(rule, segs, params, decays(names, ()), threads=args.threads, **extra)
            return lambda: update.step(grads, 1e-4)

        m = [np.zeros_like(p) for p in params]
        v = [np.zeros_like(p) for p in params]
        variants = {
            "engine AdamW graph (optimizer.step)": optimizer.step,
            "ortflow adamw torch (chunk 64K, default)": ours(OptimizerConfig(weight_decay=0.01)),
            "ortflow adamw torch (chunk 16K)": ours(OptimizerConfig(weight_decay=0.01), 16384),
            "ortflow adamw torch (chunk 256K)": ours(OptimizerConfig(weight_decay=0.01), 262144),
            "ortflow adamw torch (whole tensors)": ours(OptimizerConfig(weight_decay=0.01), 1 << 40),
            "numpy naive adamw (temporaries)": lambda: naive_adamw(params, grads, m, v, 1e-4, 1),
            "ortflow adamw engine rule": ours(OptimizerConfig(rule="engine", weight_decay=0.01)),
            "ortflow sgd momentum+nesterov": ours(OptimizerConfig(name="sgd", momentum=0.9, nesterov=True)),
            "ortflow lamb": ours(OptimizerConfig(name="lamb", weight_decay=0.01)),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds + 1):  # the first round warms up (allocations, page faults) and is dropped
            for name, call in variants.items():
                for g, s in zip(grads, saved, strict=True):
                    g[...] = s  # Lamb writes its update direction into the gradient buffers
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        del module
    base = statistics.median(times["engine AdamW graph (optimizer.step)"][1:])
    rows = [(k, statistics.median(t[1:]) * 1e3, statistics.median(t[1:]) / base) for k, t in times.items()]
    command = "python -m bench.optim_cpu " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# ortflow update vs engine optimizer step (CPU, 1 rank, {args.threads} thread(s)) - {num:,} parameters, "
        f"{len(names)} tensors",
        "", f"Command: `{command.strip()}`  ", f"Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared), numpy {np.__version__}; median of {args.rounds} interleaved rounds.", "",
        "| variant | ms / update | vs engine |", "|---|---:|---:|",
        *[f"| {k} | {ms:.1f} | {r:.2f}x |" for k, ms, r in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"num_parameters": num, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
