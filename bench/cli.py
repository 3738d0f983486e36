"""``python -m bench [NAME] [OPTIONS]``: the suite (``suite``, the default) or one feature benchmark by name.

Every benchmark is a module of this package with ``main(argv)``; ``python -m bench NAME --help`` shows its options.
Those that measure several ranks run under the launcher like the trainer: ``mpiexec -n 2 python -m bench exchange``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, one line). The suite itself is passed in by ``bench/__main__.py``.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "dataprep": ("bench.bench_dataprep", "prepare_data MB/s against pyarrow's own IPC write, the loader, memory"),
    "exchange": ("bench.bench_exchange", "(under mpiexec) the gradient exchange against a bare Allreduce"),
    "exchange-fold": ("bench.bench_exchange_fold", "(under mpiexec) folding the exchange into the backward"),
    "arena": ("bench.bench_arena", "forward+backward with the shared gradient arena against a session's own"),
    "overhead": ("bench.bench_overhead", "trainer overhead at 1 x 1 from per-phase counters"),
    "layout": ("bench.bench_layout", "ortflow layouts (auto, R x T) against PyTorch's at one global batch"),
    "gelu": ("bench.bench_gelu", "the GELU fused against as exported, engine forward+backward on the CPU"),
    "gelu-forms": ("bench.gelu_forms", "GELU formulations alone on the engine's CPU kernels: ns per element, error"),
    "gelu-grad-gpt": ("bench.gelu_grad_gpt", "GPTs with the engine's GELU kernels against ortflow's CPU form"),
    "embedding": ("bench.embedding_grad", "the embedding gradient: Gather, GatherND rewrite, one-hot MatMul"),
    "optim": ("bench.optim_cpu", "ortflow's host update against the engine's optimizer step"),
    "optim-zero": ("bench.optim_zero", "(under mpiexec) ZeRO-1 against ZeRO-0 on the same forward/backward"),
    "optim-zero-report": ("bench.optim_zero_report", "tabulate optim-zero results of several rank counts"),
    "optim-torch-check": ("bench.optim_torch_check", "ortflow's AdamW rule: torch against torch.optim.AdamW"),
    "optim-gpu": ("bench.optim_gpu", "(GPU) the fused device update against a copy of the same bytes"),
    "adasum": ("bench.bench_adasum", "Adasum against averaging: loss against samples at 1 and 4 ranks"),
    "pipeline": ("bench.bench_pipeline", "pipeline pp 2 against dp 2: memory per rank, throughput, idle share"),
    "pipeline-memory": ("bench.pipeline_memory", "where a pipeline stage's engine memory goes, per allocator"),
    "pipeline-breakdown": ("bench.pipeline_breakdown", "a pipeline rank's memory, component by component"),
    "pipeline-gpu": ("bench.bench_pipeline_gpu", "(GPU) pipeline pp 2 against dp 2 on 2 GPUs"),
    "tensor": ("bench.bench_tensor", "tensor parallelism hp 2 against dp 2 and hp 1"),
    "pipe-tensor": ("bench.bench_pipe_tensor", "pp x hp against pp, hp and one rank"),
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
    module = importlib.import_module(BENCHMARKS[name][0])
    sys.argv = [f"python -m bench {name}", *args[1:]]  # what the benchmark's argparse and its report show
    return module.main(args[1:]) or 0
