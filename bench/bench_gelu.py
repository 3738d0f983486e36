"""The GELU fusion (ortflow/graph/gelu.py, ``model.fuse_gelu``) against the GELU as exported: the engine's CPU
forward+backward of the bench GPT.

The bench GPT (ortflow.examples.gpt, d 256, 4 layers, seq 128) writes its GELU as ``x * ((erf(x * (1/sqrt2)) + 1) *
0.5)``, like the PyTorch GPT of bench/torch_gpt.py: a form the engine does not fuse itself. configure builds the
artifacts twice (``model.fuse_gelu`` on and off); both modules live in one process and their training steps
alternate (order reversed every other round), each timed with the thread's CPU time (one intra-op thread: the engine
runs on the calling thread), which other processes on the cores disturb far less than wall time.

    .venv/bin/python -m bench.bench_gelu --rounds 40 --out bench/results
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def configured(folder: Path, model: Path, fuse: bool) -> Path:
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict

    cfg = config_from_dict({
        "output_dir": str(folder / ("fused" if fuse else "exported")),
        "model": {"path": str(model), "loss": "cross_entropy", "fuse_gelu": fuse},
        "data": {"train": [str(folder / "unused.npz")]}, "train": {"batch_size": 8, "num_train_steps": 1},
    })  # fmt: skip
    return configure(cfg).artifacts_dir


def module(artifacts: Path):
    import onnx

    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    ops = {n.op_type for n in onnx.load(str(artifacts / "training_model.onnx"), load_external_data=False).graph.node}
    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    m = api.Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"),
                   session_options=session_options(1))
    m.train()
    return m, sorted(ops & {"Erf", "Gelu", "GeluGrad"})


def main(argv: list[str] | None = None) -> None:
    from bench.bench_exchange import bench_gpt
    from bench.common import interleaved_thread_times, write_result

    parser = argparse.ArgumentParser(prog="python -m bench.bench_gelu")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = bench_gpt(folder)
        contenders = {"exported": module(configured(folder, model, False)),
                      "fused": module(configured(folder, model, True))}
        rng = np.random.default_rng(0)
        feeds = [rng.integers(0, 256, (args.batch, 128)), rng.integers(0, 256, (args.batch * 128,))]
        losses = {k: float(m(*feeds)) for k, (m, _) in contenders.items()}
        load_start = os.getloadavg()
        times = interleaved_thread_times({k: m for k, (m, _) in contenders.items()}, feeds, args.rounds)
    ratio = np.array(times["fused"]) / np.array(times["exported"])
    record = {"rounds": args.rounds, "batch": [args.batch, 128], "load_avg": [load_start, os.getloadavg()],
              "gelu_ops": {k: v[1] for k, v in contenders.items()}, "first_loss": losses,
              "ms_median": {k: float(np.median(v) * 1e3) for k, v in times.items()},
              "ratio_fused_to_exported": [float(ratio.min()), float(np.median(ratio)), float(ratio.max())],
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    text = (f"# GELU fused vs as exported, engine forward+backward on CPU ({record['time']})\n\n```\n"
            f"python -m bench.bench_gelu --rounds {args.rounds} --batch {args.batch}\n```\n\nBench GPT (d 256, 4 "
            f"layers, seq 128, GELU as x * ((erf(x * (1/sqrt2)) + 1) * 0.5)), batch {args.batch} x 128, 1 thread, load "
            f"average {record['load_avg']}.\n\n"
            f"- GELU ops in the training graph: as exported {record['gelu_ops']['exported']}, fused "
            f"{record['gelu_ops']['fused']}\n- first loss: as exported {losses['exported']:.6f}, fused "
            f"{losses['fused']:.6f}\n- forward+backward thread CPU ms (median): as exported "
            f"{record['ms_median']['exported']:.1f}, fused {record['ms_median']['fused']:.1f}\n"
            f"- fused / as exported, paired within rounds (min / median / max over {args.rounds}): "
            + " / ".join(f"{x:.3f}" for x in record["ratio_fused_to_exported"]) + "\n")  # fmt: skip
    write_result(args.out, "gelu-cpu", record, text)

if __name__ == "__main__":
    main()
