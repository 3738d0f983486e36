"""The fused device update (optim/device.py) on one GPU: ms per update and GB/s against HBM peak, a plain copy of the
same bytes, and the engine's own optimizer step, interleaved in rounds.

    $PY bench/optim_gpu.py [--vocab 8192 --d-model 768 --num-layers 12] [--rounds 5] [--steps 20] [--no-engine]
        [--out DIR]

Run where the GPU engine and CuPy are installed (docs/gpu.md). The parameters are those of ortflow's example GPT
at bench_mixed's shape (97.8M parameters in 196 tensors by default), each tensor its own CuPy allocation as the
engine's buffers are; gradients random. Contenders, every round in this order:

* ``copy``: one device-to-device copy of 14 bytes/parameter (cudaMemcpyAsync), so 28 bytes/parameter move (read +
  write): the practical ceiling for AdamW's traffic;
* ``DeviceUpdate`` with AdamW ``torch`` (one launch: reads p, g, m, v; writes p, m, v: 28 B/param), AdamW
  ``engine``, SGD momentum+Nesterov (20 B/param) and Lamb (three launches and a host round trip for the trust ratios;
  28 B/param is the least it must move, its two passes move 44);
* the engine's AdamW graph (``optimizer.step()`` of onnxblock's AdamW on the CUDA provider, the step ortflow ran
  before owning the update), unless ``--no-engine`` or it cannot be built (the report says why).

Times: CUDA events around ``--steps`` calls on the update's stream (each ``DeviceUpdate.step`` ends with a stream
synchronize, as in the loop), min and median over rounds. GB/s = bytes the rule must move / time; % peak against the
GPU's theoretical HBM bandwidth (from the device's memory clock and bus width when the runtime reports them, else
the datasheet value for the name), % copy against the measured copy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write_result

#: Datasheet HBM bandwidth (bytes/s) where the runtime does not report memory clock and bus width (CUDA 13).
DATASHEET = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.04e12}
#: Bytes per parameter each contender must move.
BYTES = {"copy": 28, "adamw torch": 28, "adamw engine rule": 28, "sgd momentum+nesterov": 20, "lamb": 28,
         "engine AdamW graph (optimizer.step)": 28}


def gpt_sizes(vocab: int, d_model: int, num_layers: int, seq_len: int = 256) -> tuple[list[str], list[int]]:
    """Sorted trainable names and element counts of ortflow's example GPT at this shape (bench_mixed's by default)."""
    import onnx

    from ortflow.examples import build_gpt

    with tempfile.TemporaryDirectory() as tmp:
        model = onnx.load(str(build_gpt(Path(tmp) / "gpt.onnx", vocab_size=vocab, seq_len=seq_len, d_model=d_model,
                                        num_layers=num_layers, num_heads=max(1, d_model // 64))))
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer}
    names = sorted(sizes)
    return names, [sizes[n] for n in names]


def peak_bandwidth(cp) -> tuple[float | None, str]:
    """Theoretical HBM bytes/s of device 0 and where the figure comes from."""
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    clock, width = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    if clock and width:
        return 2.0 * clock * 1e3 * width / 8, f"{name}: 2 x {clock / 1e6:.2f} GHz x {width} bit (runtime)"
    for key, value in DATASHEET.items():
        if key in name:
            return value, f"{name}: datasheet {value / 1e12:.2f} TB/s"
    return None, f"{name}: unknown peak"


def contenders(cp, names, sizes, stream):
    """name -> callable running one update (or copy) on ``stream``."""
    from ortflow.config import OptimizerConfig
    from ortflow.trainer.optim import build_rule, whole_segments
    from ortflow.trainer.optim.device import DeviceUpdate

    rng = cp.random.RandomState(0)
    params = [rng.standard_normal(s, dtype=cp.float32) for s in sizes]
    grads = [rng.standard_normal(s, dtype=cp.float32) * cp.float32(1e-3) for s in sizes]

    class Buf:
        def __init__(self, a):
            self.ptr, self.count = a.data.ptr, a.size

    bufs = [Buf(g) for g in grads]
    segs = whole_segments(names, sizes)
    rules = {"adamw torch": OptimizerConfig(weight_decay=0.01),
             "adamw engine rule": OptimizerConfig(rule="engine", weight_decay=0.01),
             "sgd momentum+nesterov": OptimizerConfig(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
             "lamb": OptimizerConfig(name="lamb", weight_decay=0.01)}
    total = int(sum(sizes))
    src = cp.ones(total * 7 // 2, dtype=cp.float32)  # 14 bytes per parameter
    dst = cp.empty_like(src)
    out = {"copy": lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, 3, stream.ptr)}
    for label, opt in rules.items():
        update = DeviceUpdate(build_rule(opt), segs, [p.data.ptr for p in params], [True] * len(segs), stream)

        # Lamb writes its direction over the gradients; the next call then updates with that (bounded, O(1) values):
        # the same work and traffic, so nothing is restored between timed calls.
        out[label] = lambda update=update: update.step(bufs, 1e-4)
    out["_keep"] = (params, grads, src, dst)
    return out


def engine_step(names, vocab: int, d_model: int, num_layers: int, folder: Path):
    """The engine's AdamW graph step on CUDA for the same GPT, after one forward/backward (gradients in place)."""
    import onnx

    from ortflow import cuda_libs
    from ortflow.examples import build_gpt

    cuda_libs.preload()
    from ortflow.engine import api, artifacts, onnxblock

    model = onnx.load(str(build_gpt(folder / "gpt.onnx", vocab_size=vocab, seq_len=256, d_model=d_model,
                                    num_layers=num_layers, num_heads=max(1, d_model // 64))))
    cwd = Path.cwd()
    os.chdir(folder)  # generate_artifacts may write temp.onnx into the current folder
    try:
        artifacts.generate_artifacts(model, requires_grad=list(names), frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.01),
                                     artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cuda")
    optimizer = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(1e-4)
    module.train()
    ids = np.random.default_rng(0).integers(0, vocab, (2, 256)).astype(np.int64)
    module(ids, np.roll(ids, -1, axis=1).reshape(-1))

    def step(alive=(state, module)) -> None:  # the step needs its session and state alive
        optimizer.step()
    return step


def measure(args) -> dict:
    import cupy as cp

    names, sizes = gpt_sizes(args.vocab, args.d_model, args.num_layers)
    total = int(sum(sizes))
    stream = cp.cuda.Stream(non_blocking=True)
    calls = contenders(cp, names, sizes, stream)
    keep = calls.pop("_keep")
    engine_note = "not run (--no-engine)"
    if args.engine:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                calls["engine AdamW graph (optimizer.step)"] = engine_step(names, args.vocab, args.d_model,
                                                                           args.num_layers, Path(tmp))
                engine_note = f"built in {time.perf_counter() - start:.0f} s"
        except Exception as exc:  # reported, not fatal: the rest of the bench stands without it
            engine_note = f"not obtainable: {type(exc).__name__}: {exc}"[:300]
    print(f"{total:,} parameters in {len(sizes)} tensors; engine step: {engine_note}", flush=True)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for round_ in range(args.rounds + 1):  # round 0 warms up (compilation, pools) and is dropped
        for name, call in calls.items():
            stream.synchronize()
            begin, end = cp.cuda.Event(), cp.cuda.Event()
            wall = time.perf_counter()
            begin.record(stream)
            for _ in range(args.steps):
                call()
            end.record(stream)
            end.synchronize()
            wall = (time.perf_counter() - wall) / args.steps
            # The engine's step runs on the engine's own stream (synchronized by its Run): host wall time.
            ms = wall * 1e3 if name.startswith("engine") else cp.cuda.get_elapsed_time(begin, end) / args.steps
            if round_:
                times[name].append(ms)
    del keep
    peak, peak_source = peak_bandwidth(cp)
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"variant": name, "min_ms": min(t), "median_ms": med, "bytes_per_param": BYTES[name],
                     "gb_s": total * BYTES[name] / (med * 1e-3) / 1e9})
    return {"num_parameters": total, "num_tensors": len(sizes), "peak_bytes_s": peak, "peak_source": peak_source,
            "engine": engine_note, "rounds": args.rounds, "steps": args.steps, "rows": rows}


def report(result: dict) -> str:
    """The markdown table of a :func:`measure` result."""
    copy = next((r for r in result["rows"] if r["variant"] == "copy"), None)
    peak = result["peak_bytes_s"]
    lines = [
        f"# Fused device update vs HBM bandwidth - {result['num_parameters']:,} parameters, "
        f"{result['num_tensors']} tensors", "",
        f"Peak: {result['peak_source']}. Engine step: {result['engine']}. {result['rounds']} rounds x "
        f"{result['steps']} calls; GB/s = bytes the rule must move / median time.", "",
        "| variant | min ms | median ms | B/param | GB/s | % peak | % copy |", "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        of_peak = f"{100 * r['gb_s'] * 1e9 / peak:.0f}%" if peak else "-"
        of_copy = f"{100 * r['gb_s'] / copy['gb_s']:.0f}%" if copy else "-"
        lines.append(f"| {r['variant']} | {r['min_ms']:.3f} | {r['median_ms']:.3f} | {r['bytes_per_param']} | "
                     f"{r['gb_s']:.0f} | {of_peak} | {of_copy} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-engine", dest="engine", action="store_false", help="Skip the engine's optimizer step.")
    parser.add_argument("--out", type=Path, default=None, help="Folder for optim-gpu.md and .json.")
    args = parser.parse_args(argv)
    result = measure(args)
    text = report(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_result(args.out / "optim-gpu", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
