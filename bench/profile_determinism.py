"""Which engine ops does ``distributed.deterministic_compute`` slow down? ``python bench/profile_determinism.py RUN...``

For each configured run folder (e.g. bench_mixed.py's fp16 and fp16-nondet runs), a training session made with the
run's session options plus the engine's profiler runs ``--steps`` forward+backward passes on random tokens of the bench
GPT's shape; the per-op-type table (ortflow.trainer.profiling.top_operators) of each run is printed, then the op types
whose total time changed most between the first two runs. Run it with ``CUDA_LAUNCH_BLOCKING=1`` on a GPU, so each
node's profiled time is its kernels' time rather than the launch's.

The nodes ortflow's MatMul rewrite of the leading-axis sums added (``distributed.reduce_sum_as_matmul``, names starting
``leading_sum/``; their MatMul, Expand and Reshape kernels are counted under those op types in the table) are also
totalled on their own line, so a run with the rewrite and one without (bench_mixed.py's ``fp16`` and
``fp16-plainreduce``) show what the bias-gradient sums cost either way: ReduceSum's line against this one.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

PREFIX = "leading_sum/"  # ortflow.graph.leading_sums.PREFIX (not imported: this file reads traces, nothing more)


def node_prefix_ms(trace: Path, prefix: str) -> tuple[float, int]:
    """(total kernel ms, kernel events) of the nodes whose name starts with ``prefix``, over the whole trace."""
    total, count = 0.0, 0
    for event in json.loads(trace.read_text()):
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time") and name.startswith(prefix):
            total += float(event.get("dur", 0)) / 1000.0
            count += 1
    return total, count


def profile(run_dir: Path, steps: int, batch: int, seq: int, vocab: int) -> tuple[list[dict], float]:
    """(top-operator rows, wall seconds per forward+backward) of ``steps`` passes in a profiled session; the rows
    end with a pseudo op type ``leading_sum/* (MatMul rewrite)`` when the graph holds the rewrite."""
    from ortflow.config import load_run_config
    from ortflow.engine import api
    from ortflow.trainer.comm import SingleProcessComm
    from ortflow.trainer.profiling import top_operators
    from ortflow.trainer.runtime import init_runtime, session_options

    cfg = load_run_config(run_dir)
    rt = init_runtime(run_dir, cfg, SingleProcessComm())
    options = session_options(1, cfg.distributed.deterministic_compute)
    options.enable_profiling = True
    options.profile_file_prefix = str(run_dir / "determinism-profile")
    module = api.Module(str(cfg.artifacts_dir / "training_model.onnx"), rt.state, None, device=rt.device,
                        session_options=options)  # fmt: skip
    module.train()
    names = module.input_names()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int64)
    feeds = rt.loss_scale.feed({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].reshape(-1)})
    for _ in range(3):  # warm-up outside the timing (the trace keeps them; the table is per call below)
        module(*(feeds[n] for n in names))
        module.lazy_reset_grad()
    start = time.perf_counter()
    for _ in range(steps):
        float(module(*(feeds[n] for n in names)))
        module.lazy_reset_grad()
    seconds = (time.perf_counter() - start) / steps
    del module  # the engine writes the trace when the session goes (the training API has no end_profiling)
    gc.collect()
    trace = max(run_dir.glob("determinism-profile*.json"), key=lambda p: p.stat().st_mtime)
    del rt
    rows = top_operators(trace)
    rewrite_ms, rewrite_calls = node_prefix_ms(trace, PREFIX)
    if rewrite_calls:  # already inside the op types' rows above: a separate line, not added to the shares
        rows.append({"op_type": f"{PREFIX}* (MatMul rewrite)", "calls": rewrite_calls, "total_ms": rewrite_ms,
                     "share": float("nan")})  # fmt: skip
    for row in rows:  # per forward+backward pass (the trace holds the warm-up passes too)
        row["total_ms"] /= steps + 3
        row["calls"] = round(row["calls"] / (steps + 3))
    return rows, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    tables = {}
    for run in args.runs:
        rows, seconds = profile(run, args.steps, args.batch, args.seq, args.vocab)
        tables[run.name] = {r["op_type"]: r["total_ms"] for r in rows}
        print(f"## {run.name}: {seconds * 1e3:.1f} ms per forward+backward (wall, profiler on)")
        for r in [*rows[:15], *(r for r in rows[15:] if r["op_type"].startswith(PREFIX))]:
            print(f"  {r['op_type']:<40} {r['calls']:>5} calls {r['total_ms']:8.2f} ms {r['share'] * 100:5.1f}%")
    if len(tables) >= 2:
        (a, ta), (b, tb) = list(tables.items())[:2]
        diff = sorted((tb.get(op, 0) - ta.get(op, 0), op) for op in set(ta) | set(tb))
        print(f"## ms per pass, {b} minus {a} (largest changes)")
        for delta, op in diff[:8] + diff[-8:]:
            print(f"  {op:<40} {ta.get(op, 0):8.2f} -> {tb.get(op, 0):8.2f} ({delta:+.2f})")
        print("RESULT " + json.dumps({"tables": tables}))


if __name__ == "__main__":
    main()
