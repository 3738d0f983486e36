"""The ``ortflow`` command. Each command calls one plain function (or a flow) and reports errors without tracebacks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ortflow.config import ConfigError, find_problems, load_config

app = typer.Typer(
    name="ortflow",
    help="Train ONNX models data-parallel with ONNX Runtime's training engine, under mpirun, orchestrated by Prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, soft_wrap=True)  # messages stay whole lines: users grep them

ConfigArg = Annotated[Path, typer.Argument(help="Run config (YAML).", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config value: --set train.batch_size=8 (repeatable)."),
]


@app.callback()
def _root() -> None:
    """Train ONNX models data-parallel with ONNX Runtime's training engine, under mpirun, orchestrated by Prefect."""


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # `[rank 0]`, `[/x` stay text
    raise typer.Exit(code)


def _load(config: Path, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        _fail(str(err))


@app.command()
def validate(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Check a config and the files it names; print every problem at once (exit 1 if any)."""
    cfg, problems = find_problems(config, overrides or [])
    if cfg is not None and not problems:  # a configured run: its data's values too (labels, NaN, float32 range)
        from ortflow.dataprep.values import scan_sources

        problems = scan_sources(cfg)
    if problems:
        console.print(f"[bold red]{escape(str(config))}: {len(problems)} problem(s)[/]")
        for problem in problems:
            console.print(f"  - {escape(problem)}", highlight=False)
        raise typer.Exit(1)
    console.print(f"[green]{config}: valid[/]")


@app.command()
def train(
    run_dir: Annotated[Path, typer.Argument(help="Configured run folder (configure and prepare-data done).")],
    np_: Annotated[int | None, typer.Option("--np", "-n", help="Ranks (default: distributed.num_ranks).")] = None,
    hostfile: Annotated[Path | None, typer.Option(help="MPI host file for multi-node runs.")] = None,
    threads: Annotated[int | None, typer.Option(help="Threads per rank (default: cores / local ranks).")] = None,
    mpiexec: Annotated[str | None, typer.Option(help="Launcher (default: the bundled MPICH mpiexec).")] = None,
) -> None:
    """Launch the ranks with mpiexec and stream their output; exits with the job's status.

    SIGTERM/SIGINT stop every rank after the same update with a stop checkpoint (exit 143/130; killed after 30 s).
    """
    from ortflow.config import load_run_config
    from ortflow.trainer.launch import LaunchError, launch

    try:
        cfg = load_run_config(run_dir)
    except ConfigError as err:
        _fail(str(err))
    dist = cfg.distributed
    try:
        result = launch(
            run_dir, np_ or dist.num_ranks, hostfile=hostfile or dist.hostfile, num_hosts=dist.num_hosts,
            threads=threads or dist.threads_per_rank, mpiexec=mpiexec, forward_signals=True,
        )
    except LaunchError as err:
        _fail(str(err))
    if result.returncode in (130, 143):  # the ranks stopped together on a signal and saved a stop checkpoint
        console.print(f"[yellow]training stopped[/] by a signal; resume with `ortflow train {escape(str(run_dir))}`")
        raise typer.Exit(128 + result.signal if result.signal else result.returncode)
    if not result.ok:
        _fail(result.summary(), code=result.returncode if 0 < result.returncode < 256 else 1)
    console.print(f"[green]training finished[/]: checkpoints in {cfg.checkpoints_dir}")


@app.command(name="configure")
def configure_cmd(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Build the training artifacts into the run folder (does nothing when model and optimizer are unchanged)."""
    from ortflow.configure import configure

    cfg = _load(config, overrides)
    try:
        result = configure(cfg)
    except ConfigError as err:
        _fail(str(err))
    state = "unchanged, reused existing artifacts" if result.reused else "built artifacts"
    console.print(f"[green]configured[/] {result.run_dir}: {state}", highlight=False)
    console.print(
        f"  {result.info['num_parameters']:,} trainable parameters in {len(result.info['trainable'])} tensors, "
        f"{len(result.info['frozen'])} frozen; loss {result.info['loss']}",
        highlight=False,
    )


@app.command(name="prepare-data")
def prepare_data_cmd(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Shard the data sources into Arrow files + manifest.json in the run folder (a no-op when nothing changed)."""
    from ortflow.dataprep import DataError, prepare_data

    cfg = _load(config, overrides)
    try:
        manifest = prepare_data(cfg)
    except DataError as err:
        _fail(str(err))
    shards = sum(len(s) for s in manifest.splits.values())
    console.print(
        f"{cfg.data_dir}: {manifest.num_rows('train')} train + {manifest.num_rows('eval')} eval rows, {shards} "
        f"shard(s), {manifest.num_bytes / 1e6:.1f} MB, {'reused (unchanged)' if manifest.reused else 'written'}",
        highlight=False,
        soft_wrap=True,  # one line, whatever the terminal's width
    )


@app.command(name="retain")
def retain_cmd(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Keep the newest max_num_checkpoints, the best by eval loss and the final checkpoint; write checkpoints.json."""
    from ortflow.export.retention import retain_checkpoints

    index = retain_checkpoints(_load(config, overrides))
    for entry in index.kept:
        console.print(f"  keep   step {entry['step']}: {', '.join(entry['reasons'])}", highlight=False)
    for entry in index.deleted:
        console.print(f"  delete step {entry['step']}", highlight=False)
    for entry in index.damaged:
        console.print(f"  [yellow]damaged[/] step {entry['step']} (left in place): {entry['error']}", highlight=False)
    console.print(f"[green]index written[/] to {index.path}", highlight=False)


@app.command(name="export")
def export_cmd(
    source: Annotated[Path, typer.Argument(help="Run folder (best checkpoint, else newest) or checkpoint folder.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Model to write (default: the run's export.path).")]
    = None,
    outputs: Annotated[str | None, typer.Option(help="Comma-separated outputs (default: the model's own).")] = None,
    eval_model: Annotated[Path | None, typer.Option(help="Eval model (default: found next to the checkpoint).")]
    = None,
    optimize: Annotated[bool, typer.Option(help="ONNX Runtime offline graph optimization (basic level).")] = False,
    quantize: Annotated[bool, typer.Option(help="Dynamic int8 quantization; reports the accuracy change.")] = False,
    tolerance: Annotated[float, typer.Option(help="Max abs difference to the eval graph accepted.")] = 1e-4,
) -> None:
    """Export a verified inference model from a checkpoint and the eval model (no training session)."""
    import json

    from ortflow.config import RESOLVED_CONFIG_NAME, load_run_config
    from ortflow.export import export_model

    if out is None:
        if not (source / RESOLVED_CONFIG_NAME).exists():
            _fail(f"{source} is not a configured run folder: give the output path with -o model.onnx")
        out = load_run_config(source).export_path
    names = [n.strip() for n in outputs.split(",") if n.strip()] if outputs else []
    try:
        result = export_model(source, out, names, eval_model, optimize=optimize, quantize=quantize, tolerance=tolerance)
    except ValueError as err:  # ExportError, CheckpointError, ConfigError: each message says what to do
        _fail(str(err))
    ver = result.verification
    console.print(
        f"[green]exported[/] {result.path} from {result.checkpoint.name} (step {result.step}, eval loss "
        f"{result.eval_loss}); outputs {list(result.outputs)}; max abs diff to the eval graph {ver.max_abs_diff} "
        f"<= {ver.tolerance} on {ver.num_rows} rows ({ver.data})",
        highlight=False,
        soft_wrap=True,
    )
    if result.quantization is not None:
        console.print(f"int8: {json.dumps(result.to_dict()['quantization'])}", highlight=False, soft_wrap=True)


@app.command()
def doctor() -> None:
    """Report the engine build, CUDA libraries, GPUs, NCCL/CuPy and MPI found here, and what is missing."""
    from ortflow.trainer.cuda_libs import diagnose

    rows = diagnose()
    for item, found, detail in rows:
        mark = "[green]ok[/]     " if found else "[yellow]missing[/]"
        console.print(f"{mark} {item}: {detail}", highlight=False)
    gpu_ready = all(found for _, found, _ in rows)
    console.print("GPU training (device: cuda, use_nccl): " + ("ready" if gpu_ready else "not ready, see above"))


def _progress_bar(run_dir: Path, stop) -> None:
    """Show progress.json as a rich progress bar until ``stop`` (a threading.Event) is set."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ortflow.tasks.training import describe_progress
    from ortflow.trainer.metrics import read_progress

    start = read_progress(run_dir)
    seen = start.get("time") if start else None
    columns = (
        TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task_id = None
        while not stop.wait(0.5):
            record = read_progress(run_dir)
            if record is None or record.get("time") == seen:  # a record left by an earlier run is not this run's
                continue
            if task_id is None:
                task_id = bar.add_task("", total=record.get("total") or 1)
            bar.update(task_id, completed=record.get("step", 0), total=record.get("total") or 1,
                       description=describe_progress(record))


@app.command()
def run(
    config: ConfigArg,
    overrides: SetOpt = None,
    from_stage: Annotated[
        str | None,
        typer.Option(
            "--from", help="Rerun this stage and every later one: configure, prepare_data, train, retain, export."
        ),
    ] = None,
) -> None:
    """Run the whole pipeline as a Prefect flow (no server needed); finished stages are skipped on a rerun."""
    import threading

    from ortflow.flows import train_pipeline
    from ortflow.tasks.caching import STAGES, invalidate

    cfg = _load(config, overrides)
    if from_stage is not None:
        if from_stage not in STAGES:
            _fail(f"--from {from_stage}: unknown stage; use one of {', '.join(STAGES)}")
        console.print(f"rerunning {', '.join(invalidate(cfg, from_stage))}")
    stop = threading.Event()
    watcher = threading.Thread(target=_progress_bar, args=(cfg.output_dir, stop), daemon=True)
    watcher.start()
    try:
        # The flow runs in this (main) thread: Prefect's SIGTERM bridge and task timeouts need it, and Ctrl-C reaches
        # the launcher, which stops the ranks' process group.
        state = train_pipeline(cfg, return_state=True)
    finally:
        stop.set()
        watcher.join(timeout=5)
    if not state.is_completed():
        try:
            state.result()
        except BaseException as err:  # noqa: BLE001 - the flow's own failure, shown without a traceback
            _fail(f"pipeline {state.name.lower()}: {err}")
        _fail(f"pipeline ended in state {state.name}")
    from rich.table import Table

    table = Table(title=f"ortflow run {cfg.name}", show_header=False)
    for key, value in state.result().items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


@app.command()
def serve(
    config: ConfigArg,
    overrides: SetOpt = None,
    limit: Annotated[int | None, typer.Option(help="Most flow runs at once (default: no limit).")] = None,
) -> None:
    """Serve train-pipeline/<name> and export-only/<name> on the config's schedule until Ctrl-C."""
    from ortflow.deployments import serve_config

    serve_config(_load(config, overrides), limit=limit)


@app.command()
def sample(
    model: Annotated[Path, typer.Argument(help="Exported byte-level language model (.onnx).")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Bytes to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0, help="Softmax temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option(min=1, help="Sample among the k likeliest bytes.")] = 40,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    seq_len: Annotated[int | None, typer.Option(help="Context length if the model's is symbolic.")] = None,
) -> None:
    """Print the prompt followed by text generated by an exported model."""
    from ortflow.sample import SampleError, generate

    if not model.exists():
        _fail(f"{model} does not exist; export a model first (ortflow run CONFIG or ortflow export)")
    out = sys.stdout
    out.write(prompt)
    out.flush()

    def stream(byte: bytes) -> None:
        out.buffer.write(byte)
        out.buffer.flush()

    try:
        generate(model, prompt, max_new_tokens, temperature, top_k, seed, seq_len, on_token=stream)
    except SampleError as err:
        _fail(str(err))
    out.write("\n")


def main() -> None:
    """Entry point of the ``ortflow`` console script."""
    app(prog_name="ortflow")


if __name__ == "__main__":
    sys.exit(main())
