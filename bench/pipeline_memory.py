"""Where a pipeline stage's engine memory goes: one process per variant, peak RSS growth over the engine calls.

Run: ``python -m bench pipeline-memory [--batch 4 32] [--allocators ...]`` (configures the bench GPT as
bench_pipeline does, pp 1 and pp 2, measures every cell in a fresh process and writes the table to
bench/out/pipeline-memory-<host>.md). A cell is (model: unsplit / stage 0 / stage 1; calls: the training call
alone, the eval forward alone, or the eval forward then the training call as a middle stage runs them; allocator):
``trainer`` = the sessions as ortflow makes them; ``default`` = an arena per session (the engine's default);
``shared`` = one process-wide arena used by both sessions; ``-same`` = that arena extended by what is requested
instead of the next power of two; ``-nopattern`` = ``enable_mem_pattern = False``; ``none`` = no arena
(``enable_cpu_mem_arena = False``); ``none-mmap`` = no arena and glibc's mmap threshold fixed at 128 KiB (freed large
blocks go back to the system at once: the calls' own working set). ``--timing ROUNDS`` instead compares the CPU time
per call of stage 0 under the given allocators.

The number is VmHWM after the calls minus VmRSS before them (after /proc/self/clear_refs): what the calls add above
the loaded sessions (parameters are already resident), i.e. activations + engine workspace + what the allocator keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_pipeline import ROOT, _configure, _rss_kb
from bench.common import write_result

ALLOCATORS = ("trainer", "default", "shared", "shared-same", "none", "none-mmap", "shared-nopattern",
              "shared-same-nopattern", "default-nopattern")
CALLS = ("train", "eval", "eval+train")


def _options(allocator: str, stage: int | None):
    import onnxruntime

    from ortflow.trainer.runtime import session_options

    if allocator == "trainer":  # as the trainer makes them (stages: stage_session_options; unsplit: session_options)
        from ortflow.trainer.comm.engine_buffers import HostBuffers
        from ortflow.trainer.parallel.pipeline_stage import stage_session_options

        return session_options(1) if stage is None else stage_session_options(1, HostBuffers())
    options = session_options(1)
    if allocator.endswith("-nopattern"):  # no memory pattern: per-tensor blocks, which the two sessions can share
        options.enable_mem_pattern = False
        allocator = allocator.removesuffix("-nopattern")
    if allocator.startswith("shared"):  # arena_extend_strategy -1: the default (next power of two), 1: as requested
        info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         onnxruntime.OrtMemType.DEFAULT)
        strategy = 1 if allocator == "shared-same" else -1
        onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, strategy, -1, -1))
        options.add_session_config_entry("session.use_env_allocators", "1")
    elif allocator.startswith("none"):
        options.enable_cpu_mem_arena = False
        if allocator == "none-mmap":  # glibc: a fixed mmap threshold, so freed large blocks go back to the system
            import ctypes

            ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    return options


def probe(run_dir: Path, stage: int | None, calls: str, allocator: str, batch: int, repeats: int) -> dict:
    """One variant in this process: peak RSS growth (bytes) over ``repeats`` rounds of ``calls``."""
    import onnx

    from ortflow.artifacts_folder import GRAD_IN_SUFFIX, read_stages_record, stage_dir
    from ortflow.config import load_run_config
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import api

    cfg = load_run_config(run_dir)
    folder = cfg.artifacts_dir if stage is None else stage_dir(cfg.artifacts_dir, stage)
    started_kb = _rss_kb("VmRSS")
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cpu",
                        session_options=_options(allocator, stage))
    feeds = dict(TrainLoader(cfg.data_dir, batch, 0, 1, prefetch=0).batch(0, 0))
    info = None if stage is None else read_stages_record(cfg.artifacts_dir)["stages"][stage]
    graph = onnx.load(str(folder / "training_model.onnx"), load_external_data=False).graph
    for i in graph.input:  # received tensors and arriving gradients: random, of the declared shape
        if info is None or i.name in feeds or not (i.name in info["receives"] or i.name.endswith(GRAD_IN_SUFFIX)):
            continue
        dims = [d.dim_value or batch for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmRSS")
    rounds, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        if "eval" in calls:
            module.eval()
            out = module(*(feeds[n] for n in module.input_names()))
            del out
        if "train" in calls:
            module.train()
            out = module(*(feeds[n] for n in module.input_names()))
            del out
        rounds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return {"peak_growth": 1024 * (_rss_kb("VmHWM") - before), "rss_growth": 1024 * (_rss_kb("VmRSS") - before),
            "sessions": 1024 * (before - started_kb),
            "round_s": min(rounds[1:] or rounds), "round_cpu_s": min(cpu[1:] or cpu)}


def _measure(run_dir: Path, stage: int | None, calls: str, allocator: str, batch: int) -> dict:
    cmd = [sys.executable, "-m", "bench.pipeline_memory", "--probe", str(run_dir), "--calls", calls, "--allocator",
           allocator, "--batch", str(batch)] + ([] if stage is None else ["--stage", str(stage)])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing(run_dir: Path, rounds: int, allocators: list[str]) -> list[str]:
    """Call time of stage 0's eval forward + training call per allocator: wall and CPU time (1 thread, so CPU time
    is what the calls cost, whatever else runs) of a process's fastest round, one process per (round, allocator, b),
    allocators alternating so a busy machine slows them alike."""
    times: dict = {}
    for _ in range(rounds):
        for b, repeats in ((4, 16), (32, 4)):
            for allocator in allocators:
                cmd = [sys.executable, "-m", "bench.pipeline_memory", "--probe", str(run_dir), "--stage", "0",
                       "--calls", "eval+train", "--allocator", allocator, "--batch", str(b), "--repeats", str(repeats)]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
                got = json.loads(out.stdout.strip().splitlines()[-1])
                times.setdefault((b, allocator), []).append((got["round_s"], got["round_cpu_s"]))
    return [f"| {b} | {allocator} | {1e3 * min(w for w, _ in v):.1f} | {1e3 * min(c for _, c in v):.1f} | "
            + ", ".join(f"{1e3 * c:.1f}" for _, c in v) + " |" for (b, allocator), v in sorted(times.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calls", default="train", choices=CALLS, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", default="default", choices=ALLOCATORS, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 32], help="micro-batch sizes (sequences)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of calls per measurement")
    parser.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    parser.add_argument("--timing", type=int, default=0, metavar="ROUNDS",
                        help="instead of the table: stage 0's call time per allocator over ROUNDS alternating rounds")
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe, args.stage, args.calls, args.allocator, args.batch[0], args.repeats)))
        return
    if args.timing:
        with tempfile.TemporaryDirectory(prefix="pipeline-memory-") as tmp:
            rows = timing(_configure(Path(tmp), "pp2", 2, 2, 2), args.timing, args.allocators)
        print(f"load average {os.getloadavg()}\n"
              "| b | allocator | fastest wall ms | fastest CPU ms | CPU ms per process (its fastest round) |\n"
              "|---|---|---|---|---|\n" + "\n".join(rows))
        return
    mb = 1 / 2**20
    lines = [f"# Pipeline stage memory probe on {socket.gethostname()}", "",
             "Peak RSS growth (MiB) over 3 rounds of the calls, one fresh process per cell (bench/pipeline_memory.py).",
             "", "| model | calls | allocator | " + " | ".join(f"b={b}" for b in args.batch) + " |",
             "|---|---|---|" + "---|" * len(args.batch)]
    with tempfile.TemporaryDirectory(prefix="pipeline-memory-") as tmp:
        pp1 = _configure(Path(tmp), "pp1", 1, 1, 2)
        pp2 = _configure(Path(tmp), "pp2", 2, 2, 2)
        cells = [("unsplit", pp1, None, "train")]
        cells += [(f"stage {s}", pp2, s, c) for s in (0, 1) for c in CALLS if not (s == 1 and c == "eval+train")]
        for name, run_dir, stage, calls in cells:
            for allocator in args.allocators:
                got = [_measure(run_dir, stage, calls, allocator, b)["peak_growth"] * mb for b in args.batch]
                lines.append(f"| {name} | {calls} | {allocator} | " + " | ".join(f"{g:.1f}" for g in got) + " |")
                print(lines[-1], flush=True)
    write_result(ROOT / "bench" / "out" / f"pipeline-memory-{socket.gethostname()}", {"table": lines},
                 "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
