"""Benchmarks: ``python -m bench [NAME] [OPTIONS]`` runs the suite (``suite``, the default) or one feature benchmark.

Every benchmark is a module of this package with ``main(argv)``; ``python -m bench NAME --help`` shows its options.
Those that measure several ranks run under the launcher like the trainer: ``mpiexec -n 2 python -m bench exchange``.
Results go to bench/out/ (ignored); the curated reports are bench/reports/.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, or module:function when not main, one line). The suite itself is passed in by ``bench/__main__.py``.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "dataprep": ("bench.bench_dataprep", "prepare_data MB/s against pyarrow's own IPC write, the loader, memory"),
    "exchange": ("bench.bench_exchange", "(under mpiexec) the gradient exchange against a bare Allreduce"),
    "overhead": ("bench.bench_overhead", "trainer overhead at 1 x 1 from per-phase counters"),
    "layout": ("bench.bench_layout", "ortflow layouts (auto, R x T) against PyTorch's at one global batch"),
    "optim": ("bench.optim_cpu", "ortflow's host update against the engine's optimizer step"),
    "optim-zero": ("bench.optim_cpu:zero_main", "(under mpiexec) ZeRO-1 against ZeRO-0 on the same forward/backward"),
    "optim-zero-report": ("bench.optim_cpu:zero_report_main", "tabulate optim-zero results of several rank counts"),
    "optim-torch-check": ("bench.optim_cpu:torch_check_main", "ortflow's AdamW rule: torch against torch.optim.AdamW"),
    "optim-gpu": ("bench.optim_gpu", "(GPU) the fused device update against a copy of the same bytes"),
    "adasum": ("bench.bench_adasum", "Adasum against averaging: loss against samples at 1 and 4 ranks"),
    "engine-calls": ("bench.engine_calls", "the engine's training call against its separate forward and backward"),
    "pipeline": ("bench.bench_pipeline", "pipeline pp 2 against dp 2: memory per rank, throughput, idle share"),
    "pipeline-memory": ("bench.pipeline_memory", "where a pipeline stage's engine memory goes, per allocator"),
    "pipeline-gpu": ("bench.bench_pipeline:gpu_main", "(GPU) pipeline pp 2 against dp 2 on 2 GPUs"),
    "tensor": ("bench.bench_tensor", "tensor parallelism hp 2 against dp 2 and hp 1"),
    "pipe-tensor": ("bench.bench_tensor:pipe_tensor_main", "pp x hp against pp, hp and one rank"),
    "exports": ("bench.bench_exports", "pp 2 and hp 2 against dp 2 on the committed GPT-2 export"),
    "mixed": ("bench.bench_mixed", "(GPU) fp32, fp16 and bf16 training steps"),
    "gpu": ("bench.bench_gpu", "(GPU) ortflow on 1 and 2 GPUs, PyTorch DDP, NCCL bandwidth"),
    "gpu-suite": ("bench.gpu_suite", "(GPU) the whole GPU suite; bench/gpu_suite.sh sets its environment"),
}


SUITE = "GEMM ceiling; ortflow against the bare engine loop and PyTorch; all-reduce; checkpoint save; dataprep"


def usage() -> str:
    """The top-level help: the suite, then every named benchmark."""
    width = max(map(len, BENCHMARKS))
    rows = "\n".join(f"  {name:<{width}}  {line}" for name, (_, line) in BENCHMARKS.items())
    return (f"{__doc__}\n  {'suite':<{width}}  {SUITE}\n{rows}\n\n"
            "Without a name the suite runs (python -m bench suite --help for its options).")  # fmt: skip


def run(argv: Sequence[str], suite: Callable[[list[str]], int | None]) -> int:
    """Dispatch ``argv`` to the suite or to the named benchmark's ``main``; returns the exit status."""
    args = list(argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not args or args[0].startswith("-") or args[0] == "suite":
        return suite(args[1:] if args[:1] == ["suite"] else args) or 0
    name = args[0]
    if name not in BENCHMARKS:
        print(f"python -m bench: no benchmark named {name!r}; choose suite or one of: {', '.join(BENCHMARKS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    module_name, _, function = BENCHMARKS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "main")
    sys.argv = [f"python -m bench {name}", *args[1:]]  # what the benchmark's argparse and its report show
    return entry(args[1:]) or 0
