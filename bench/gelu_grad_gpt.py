"""The CPU GELU gradient (ortflow/graph/gelu_grad.py) on whole models: the engine's forward+backward and its per-op
profile, GELUs as the engine's fused kernels ("engine": FastGelu/FastGeluGrad for the tanh form, Gelu/GeluGrad for
erf) against ortflow's CPU mode ("cpu": the tanh form as ``x * sigmoid(...)``, erf unchanged).

Models: the committed Hugging Face GPT-2 export (tests/fixtures/exports/gpt2.onnx: 4 layers, d 64, ``gelu_new``) at
batch 8 x 64, and the bench GPT (ortflow.examples.gpt: 4 layers, d 256, seq 128, erf GELU) at batch 8. Each model is
configured twice (configure's real pipeline; only the GELU mode differs), both modules live in one process and their
training steps alternate (order reversed every other round), timed with the calling thread's CPU time at one
intra-op thread (wall time with more). Then each runs ``--profile-steps`` steps with the engine's profiler: kernel
time per op type, and the share of the GELU's own kernels (forward and backward, listed in the report).

    python -m bench.gelu_grad_gpt --rounds 20 --out bench/results
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np

# Kernels that only a GELU puts into these models' training graphs (the attention's Softmax uses none of them;
# Mul/Add/Sum of the sigmoid form are counted by node name, below).
GELU_OPS = {"FastGelu", "FastGeluGrad", "Gelu", "GeluGrad", "BiasGelu", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX",
            "Sigmoid", "SigmoidGrad"}  # fmt: skip
GELU_GRAD_OPS = {"FastGeluGrad", "GeluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX", "SigmoidGrad"}


def configured(folder: Path, model: Path, mode: str, batch: int) -> Path:
    from ortflow.build import engine_input
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict

    cfg = config_from_dict({
        "output_dir": str(folder / mode), "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(folder / "unused.npz")]}, "train": {"batch_size": batch, "num_train_steps": 1},
    })  # fmt: skip
    chosen = engine_input.gelu_fusion
    engine_input.gelu_fusion = lambda cfg: mode  # the one difference between the two builds
    try:
        return configure(cfg).artifacts_dir
    finally:
        engine_input.gelu_fusion = chosen


def module(artifacts: Path, threads: int, profile: str | None = None):
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    options = session_options(threads)
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    m = api.Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"),
                   session_options=options)  # fmt: skip
    m.train()
    return m


def gelu_node_names(artifacts: Path) -> set[str]:
    """Names of the training graph's nodes that compute a GELU or its gradient (the engine's GELU kernels, and the
    sigmoid form's nodes and their gradient nodes: ortflow names them ``.../gelu_*``)."""
    import onnx

    graph = onnx.load(str(artifacts / "training_model.onnx"), load_external_data=False).graph
    names = {n.name for n in graph.node if n.op_type in GELU_OPS or "/gelu_" in n.name}
    made = {o for n in graph.node if n.name in names for o in n.output}
    # The engine's Sum of the GELU input's gradient contributions, when they all come from the GELU's nodes.
    names |= {n.name for n in graph.node if n.name.startswith("AccumulateGrad_") and set(n.input) <= made}
    return names


def profile(artifacts: Path, feeds: list, threads: int, steps: int) -> dict:
    """Kernel ms per step by op type, and the GELU's share (forward+backward, and backward only).

    Each node's time is its median over ``steps`` profiled steps (after one of warm-up): on a shared machine a
    kernel's wall time includes the moments its thread was descheduled, and the median drops most of those."""
    import json
    import statistics
    from collections import defaultdict

    prefix = str(artifacts.parent / f"profile-{threads}-")
    m = module(artifacts, threads, prefix)
    for _ in range(steps + 1):
        m(*feeds)
        m.lazy_reset_grad()
    del m
    gc.collect()
    files = sorted(artifacts.parent.glob(f"profile-{threads}-*.json"), key=lambda f: f.stat().st_size)
    events = json.loads(files[-1].read_text())  # the training session's trace is the big one
    for f in files:
        f.unlink()
    gelu_names = gelu_node_names(artifacts)
    calls: dict[str, list[float]] = defaultdict(list)
    op_of: dict[str, str] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            calls[node].append(e["dur"] / 1e3)
            op_of[node] = e.get("args", {}).get("op_name", "?")
    per_node = {n: statistics.median(d[1:] or d) for n, d in calls.items()}  # the first call is the warm-up step's
    total = sum(per_node.values())
    gelu = sum(v for n, v in per_node.items() if n in gelu_names)
    grad = sum(v for n, v in per_node.items() if n in gelu_names and (
        "_Grad/" in n or n.startswith("AccumulateGrad_") or op_of[n] in GELU_GRAD_OPS))  # fmt: skip
    by_op: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for n, v in per_node.items():
        by_op[op_of[n]][0] += 1
        by_op[op_of[n]][1] += v
    rows = sorted(({"op_type": op, "nodes": c, "ms": t, "share": t / total} for op, (c, t) in by_op.items()),
                  key=lambda r: -r["ms"])[:14]  # fmt: skip
    return {"kernel_ms_per_step": total, "gelu_ms": gelu, "gelu_share": gelu / total, "gelu_grad_ms": grad,
            "gelu_grad_share": grad / total, "gelu_nodes": len(gelu_names), "top_ops": rows}  # fmt: skip


def feeds_for(artifacts: Path, batch: int, seq: int, vocab: int) -> list:
    """Token ids and labels in the shapes the training graph takes (labels [B, T], or [B*T] when flattened)."""
    import onnx

    graph = onnx.load(str(artifacts / "training_model.onnx"), load_external_data=False).graph
    rng = np.random.default_rng(0)
    ids, labels = (rng.integers(0, vocab, (batch, seq)).astype(np.int64) for _ in range(2))
    feeds = []
    for value_info in graph.input:
        rank = len(value_info.type.tensor_type.shape.dim)
        if value_info.name == "input_ids":
            feeds.append(ids)
        elif value_info.name == "labels":
            feeds.append(labels.reshape(-1) if rank == 1 else labels)
    return feeds


def main(argv: list[str] | None = None) -> None:
    from bench.bench_exchange import bench_gpt
    from bench.common import host_info, interleaved_thread_times, write_result

    parser = argparse.ArgumentParser(prog="python -m bench.gelu_grad_gpt")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=9)
    parser.add_argument("--models", default="gpt2,bench")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    record = {"host": host_info(), "rounds": args.rounds, "threads": args.threads, "models": {},
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    lines = [f"# GELU gradient on CPU, whole models: the engine's kernels vs ortflow's CPU mode ({record['time']})",
             "", "```", f"python -m bench.gelu_grad_gpt --rounds {args.rounds} --threads {args.threads} "
             f"--profile-steps {args.profile_steps} --models {args.models}", "```", "",
             f"CPU {record['host']['cpu']} ({record['host']['cores']} cores), commit {record['host']['commit']}, "
             f"onnxruntime "
             f"{record['host']['versions']['onnxruntime']}, onnx {record['host']['versions']['onnx']}, numpy "
             f"{record['host']['versions']['numpy']}; {args.threads} intra-op thread(s), "
             f"{'thread CPU time' if args.threads == 1 else 'wall time'} of forward+backward, modes interleaved.",
             ""]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for which in args.models.split(","):
            folder = Path(tmp) / which
            folder.mkdir()
            if which == "gpt2":
                from tests.support.exports import export_path

                path, batch, seq, vocab = export_path("gpt2.onnx"), 8, 64, 512
            else:
                path, batch, seq, vocab = bench_gpt(folder), 8, 128, 256
            arts = {mode: configured(folder, path, mode, batch) for mode in ("engine", "cpu")}
            mods = {mode: module(a, args.threads) for mode, a in arts.items()}
            feeds = feeds_for(arts["engine"], batch, seq, vocab)
            losses = {mode: float(m(*feeds)) for mode, m in mods.items()}
            for m in mods.values():
                m.lazy_reset_grad()
            load = [os.getloadavg()]
            if args.threads == 1:
                times = interleaved_thread_times(mods, feeds, args.rounds)
            else:
                times = _interleaved_wall(mods, feeds, args.rounds)
            load.append(os.getloadavg())
            del mods
            gc.collect()
            profiles = {mode: profile(a, feeds, args.threads, args.profile_steps) for mode, a in arts.items()}
            ratio = np.array(times["cpu"]) / np.array(times["engine"])
            rec = {"batch": [batch, seq], "first_loss": losses, "load_avg": load,
                   "ms_median": {k: float(np.median(v) * 1e3) for k, v in times.items()},
                   "ms_min": {k: float(np.min(v) * 1e3) for k, v in times.items()},
                   "ratio_cpu_to_engine": [float(ratio.min()), float(np.median(ratio)), float(ratio.max())],
                   "profile": profiles}  # fmt: skip
            record["models"][which] = rec
            lines += _model_lines(which, rec)
    write_result(args.out, f"gelu-grad-gpt-{args.threads}t", record, "\n".join(lines) + "\n")


def _interleaved_wall(mods: dict, feeds: list, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in mods}
    names = list(mods)
    for r in range(rounds + 2):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            mods[name](*feeds)
            mods[name].lazy_reset_grad()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def _model_lines(which: str, rec: dict) -> list[str]:
    title = ("Hugging Face GPT-2 export (tests/fixtures/exports/gpt2.onnx, gelu_new)" if which == "gpt2"
             else "bench GPT (ortflow.examples.gpt, d 256, 4 layers, erf GELU)")  # fmt: skip
    p = rec["profile"]
    lines = [f"## {title}, batch {rec['batch'][0]} x {rec['batch'][1]}", "",
             f"Load average (1 min) at start / end: {rec['load_avg'][0][0]:.1f} / {rec['load_avg'][1][0]:.1f}. "
             f"First loss: engine {rec['first_loss']['engine']:.7f}, cpu {rec['first_loss']['cpu']:.7f}.", "",
             "| GELU mode | fwd+bwd ms median (min) | kernel ms/step (profiler) | GELU fwd+bwd share | "
             "GELU gradient share |", "|---|---|---|---|---|"]  # fmt: skip
    for mode in ("engine", "cpu"):
        lines.append(f"| {mode} | {rec['ms_median'][mode]:.1f} ({rec['ms_min'][mode]:.1f}) | "
                     f"{p[mode]['kernel_ms_per_step']:.1f} | {p[mode]['gelu_share'] * 100:.1f}% "
                     f"({p[mode]['gelu_ms']:.2f} ms) | {p[mode]['gelu_grad_share'] * 100:.1f}% "
                     f"({p[mode]['gelu_grad_ms']:.2f} ms) |")  # fmt: skip
    r = rec["ratio_cpu_to_engine"]
    lines += ["", f"Step time cpu / engine, paired within rounds (min / median / max): {r[0]:.3f} / {r[1]:.3f} / "
              f"{r[2]:.3f}.", ""]  # fmt: skip
    for mode in ("engine", "cpu"):
        lines += [f"Top kernels per step (each node's median call), mode {mode}:", "",
                  "| op type | nodes | ms/step | share |", "|---|---|---|---|"]
        lines += [f"| {t['op_type']} | {t['nodes']} | {t['ms']:.2f} | {t['share'] * 100:.1f}% |"
                  for t in p[mode]["top_ops"]]  # fmt: skip
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
