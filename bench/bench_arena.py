"""The trainer's shared gradient arena (ortflow.trainer.arena) against a session's own arena: memory runs of the
gradients, and whether the engine's forward+backward gets slower.

Both modules live in one process over the same artifacts (one with ``session.use_env_allocators`` and the shared
arena, one without), and their training steps alternate (order reversed every other round), so the machine's load
hits both alike; each step is timed with the thread's CPU time (the engine runs on the calling thread with one
intra-op thread), which other processes on the cores disturb far less than wall time. Rank 0 of nothing: one process.

    python -m bench arena --rounds 30 --out bench/results
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import interleaved_thread_times
from bench.record import write_result
from ortflow.trainer.comm.memory_runs import local_runs


def build(folder: Path):
    import onnx

    from bench.bench_exchange import bench_gpt
    from ortflow.engine import artifacts

    proto = onnx.load(str(bench_gpt(folder)))
    names = sorted(t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        artifacts.generate_artifacts(proto, requires_grad=names, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=None,
                                     artifact_directory=str(folder))  # fmt: skip
    finally:
        os.chdir(cwd)


def module(folder: Path, shared: bool):
    from ortflow.engine import api
    from ortflow.trainer.arena import use_gradient_arena
    from ortflow.trainer.runtime import session_options

    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = session_options(1)
    if shared:
        options = use_gradient_arena(options, 4 * sum(p.data.size for _, p in state.parameters if p.requires_grad))
    m = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), session_options=options)
    m.train()
    grads = [state.parameters[n].grad for n in sorted(n for n, p in state.parameters if p.requires_grad)]
    runs = local_runs([g.__array_interface__["data"][0] for g in grads], [g.size for g in grads])
    return m, state, len(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench arena")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder)
        contenders = {"session": module(folder, False), "shared": module(folder, True)}
        rng = np.random.default_rng(0)
        feeds = [rng.integers(0, 256, (args.batch, 128)), rng.integers(0, 256, (args.batch * 128,))]
        load_start = os.getloadavg()
        times = interleaved_thread_times({k: v[0] for k, v in contenders.items()}, feeds, args.rounds)
    ratio = np.array(times["shared"]) / np.array(times["session"])
    record = {"rounds": args.rounds, "batch": [args.batch, 128], "load_avg": [load_start, os.getloadavg()],
              "runs": {k: v[2] for k, v in contenders.items()},
              "ms_median": {k: float(np.median(v) * 1e3) for k, v in times.items()},
              "ratio_shared_to_session": [float(ratio.min()), float(np.median(ratio)), float(ratio.max())],
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    text = (f"# Shared gradient arena vs a session's own ({record['time']})\n\nBench GPT (ortflow.examples.gpt, d 256, "
            f"4 layers, seq 128), batch {args.batch} x 128, 1 thread, load average {record['load_avg']}.\n\n"
            f"- gradient memory runs: session arena {record['runs']['session']}, shared arena "
            f"{record['runs']['shared']}\n- forward+backward thread CPU ms (median): session "
            f"{record['ms_median']['session']:.1f}, shared {record['ms_median']['shared']:.1f}\n"
            f"- shared / session, paired within rounds (min / median / max over {args.rounds}): "
            + " / ".join(f"{x:.3f}" for x in record["ratio_shared_to_session"]) + "\n")  # fmt: skip
    print(text)
    if args.out:
        write_result(args.out / f"arena-{time.strftime('%Y%m%d-%H%M', time.gmtime())}", record, text)

if __name__ == "__main__":
    main()
