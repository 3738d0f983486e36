"""``ortflow validate`` and ``ortflow doctor``: what can be checked before anything runs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from ortflow.cli.shared import ConfigArg, SetOpt, console
from ortflow.cuda_libs import OPTIONAL_FOR_OPS, diagnose


def validate(
    config: ConfigArg,
    overrides: SetOpt = None,
    deep: Annotated[
        bool, typer.Option("--deep", help="Also build the training artifacts in a temporary folder (engine errors; "
                           "with device cuda, nodes without a half-precision CUDA kernel).")
    ] = False,
) -> None:
    """Check everything checkable without training; print every problem at once (exit 1 if any).

    The config's fields and cross-field rules; the model, its loss output and rank; every data source, column and
    the first rows' dtypes and shapes at the configured batch sizes (fixed batch dims included); that the output
    and export paths can be written (an output_dir on object storage: the store reachable, the credentials accepted,
    the bucket there; nothing is created); with --deep, that the engine can build the training graph and, with
    distributed.device cuda, that the GPU engine has a kernel for every fp16/bf16 node of it. With launcher slurm,
    also the job against the cluster: the partition, its nodes' CPUs and `sbatch --test-only`. With pipeline or
    tensor-parallel sizes above 1, a valid config also prints the split plan: the cuts, which weights each
    tensor-parallel region splits how (attention by heads), what stays replicated and why, and whether the parts keep
    their activations or run the forward again in the backward call (distributed.recompute_forward).
    """
    from ortflow.config import find_problems
    from ortflow.dataprep.values import scan_sources
    from ortflow.launch.slurm_check import request_problems
    from ortflow.validate import validate as find_all

    plan: list[str] = []
    problems = find_all(config, overrides or [], deep=deep, split_plan=plan)
    cfg, _ = find_problems(config, overrides or [])
    if cfg is not None:  # with launcher slurm: the job's request against the cluster (partition, slots, --test-only)
        problems += request_problems(cfg)
    if not problems and cfg is not None:  # a configured run: every value of its data too (labels, NaN, range)
        problems = scan_sources(cfg)
    if problems:
        console.print(f"[bold red]{escape(str(config))}: {len(problems)} problem(s)[/]")
        for problem in problems:
            console.print(f"  - {escape(problem)}", highlight=False)
        raise typer.Exit(1)
    if plan:  # what the pipeline / tensor-parallel split does with the model (configure logs the same)
        console.print("split plan:")
        for line in plan:
            console.print(f"  - {escape(line)}", highlight=False, soft_wrap=True)
    console.print(f"[green]{escape(str(config))}: valid[/]")


def doctor(
    mpiexec: Annotated[str | None, typer.Option(help="The MPI launcher the ranks will be started with (e.g. "
                                                "/usr/bin/mpirun; default: the bundled MPICH's mpiexec).")] = None,
) -> None:
    """Report the engine build, CUDA libraries, GPUs, NCCL/CuPy and MPI found here, and what is missing; whether
    mpi4py's MPI is the launcher's (a mismatch starts N singletons or fails at MPI_Init) and how to fix it."""
    from ortflow.launch.mpi_check import mpi_rows

    rows = [row for row in diagnose() if row[0] not in ("mpi4py", "mpiexec")] + mpi_rows(mpiexec)
    optional = {f"cuDNN {what}" for what in OPTIONAL_FOR_OPS}
    for item, found, detail in rows:
        mark = "[green]ok[/]     " if found else "[dim]absent[/] " if item in optional else "[yellow]missing[/]"
        console.print(f"{mark} {item}: {detail}", highlight=False)
    gpu_ready = all(found for item, found, _ in rows if item not in optional and item != "MPI match")
    console.print("GPU training (device: cuda, use_nccl): " + ("ready" if gpu_ready else "not ready, see above"))
    if not all(found for item, found, _ in rows if item == "MPI match"):
        console.print("[yellow]MPI: the launcher and mpi4py do not match, see above[/]")
        raise typer.Exit(1)
