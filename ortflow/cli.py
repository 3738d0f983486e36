"""The ``ortflow`` command. Each command calls one plain function (or a flow) and reports errors without tracebacks."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ortflow.config import ConfigError, apply_overrides, load_config
from ortflow.protocol import EXIT_INTERRUPTED, EXIT_STOPPED

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


@contextlib.contextmanager
def _writing(where: Path) -> Iterator[None]:
    """Report a full, read-only or forbidden disk met while writing under ``where`` as such, without a traceback."""
    from ortflow.cli_terminal import disk_problem

    try:
        yield
    except OSError as err:
        from ortflow.storage import StorageError

        message = str(err) if isinstance(err, StorageError) else disk_problem(err, where)  # a store out of reach
        if message is None:  # another system refusal (/proc, a vanished folder): named, not a traceback
            message = (f"cannot use {err.filename or where}: {err.strerror or err}; point output_dir / checkpoint.dir "
                       "/ export.path at a folder you can write, then rerun the command")
        _fail(message)


def _load(config: Path, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        _fail(str(err))


@app.command()
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
    and export paths can be written; with --deep, that the engine can build the training graph and, with
    distributed.device cuda, that the GPU engine has a kernel for every fp16/bf16 node of it. With launcher slurm,
    also the job against the cluster: the partition, its nodes' CPUs and `sbatch --test-only`. With pipeline or
    tensor-parallel sizes above 1, a valid config also prints the split plan: the cuts, which weights each
    tensor-parallel region splits how (attention by heads), and what stays replicated and why.
    """
    from ortflow.validate import validate as find_all

    plan: list[str] = []
    problems = find_all(config, overrides or [], deep=deep, split_plan=plan)
    problems += _scheduler_problems(config, overrides)
    if not problems:  # a configured run: every value of its data too (labels vs the model's classes, NaN, range)
        from ortflow.config import find_problems
        from ortflow.dataprep.values import scan_sources

        cfg, _ = find_problems(config, overrides or [])
        problems = scan_sources(cfg) if cfg is not None else []
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


def _scheduler_problems(config: Path, overrides: list[str] | None) -> list[str]:
    """With launcher slurm: the job's request against the cluster (partition, slots, ``sbatch --test-only``)."""
    from ortflow.config import find_problems
    from ortflow.launch.slurm_check import request_problems

    cfg, _ = find_problems(config, overrides or [])
    return request_problems(cfg) if cfg is not None else []


@app.command()
def train(
    run_dir: Annotated[Path, typer.Argument(help="Configured run folder (configure and prepare-data done).")],
    np_: Annotated[
        str | None, typer.Option("--np", "-n", help="Ranks, or auto for this host (default: distributed.num_ranks).")
    ] = None,
    hostfile: Annotated[Path | None, typer.Option(help="MPI host file for multi-node runs.")] = None,
    threads: Annotated[
        int | None,
        typer.Option(help="Threads per rank (default: cores / local ranks; 1 on CUDA ranks sharing a host)."),
    ] = None,
    mpiexec: Annotated[str | None, typer.Option(help="Launcher (default: the bundled MPICH mpiexec).")] = None,
    wait: Annotated[bool, typer.Option(help="If another run holds the folder, wait for it instead of failing.")]
    = False,
    profile: Annotated[
        str | None, typer.Option(help="Profile weight updates A:B per operator (traces in RUN_DIR/profile/).")
    ] = None,
    launcher: Annotated[
        str | None, typer.Option(help="local, slurm or kubernetes (default: distributed.launcher).")
    ] = None,
    accept_changed_config: Annotated[bool, typer.Option(
        "--accept-changed-config",
        help="Train with a RUN_DIR/config.yaml edited since configure wrote it, and record it (refused when the "
             "edit changes the model, precision or layout: run configure then).")] = False,
) -> None:
    """Launch the ranks (mpiexec here, or a Slurm or Kubernetes job) and stream their output; exits with the job's
    status.

    SIGTERM/SIGINT stop every rank after the same update with a stop checkpoint (exit 143/130); ranks that have not
    stopped after the grace period (30 s here, 60 s for a Slurm job) are killed.
    """
    import os

    from ortflow.config import load_run_config
    from ortflow.launch.layout import LayoutError, host_resources, launch_layout
    from ortflow.launch.local import LaunchError, launch
    from ortflow.trainer.profiling import PROFILE_ENV, parse_steps

    try:
        cfg = load_run_config(run_dir, accept_changed=accept_changed_config)
        if accept_changed_config:
            from ortflow.configure.configure import accept_config_edit

            accept_config_edit(cfg)
        if launcher is not None:
            cfg = apply_overrides(cfg, [f"distributed.launcher={launcher}"])
    except ConfigError as err:
        _fail(str(err))
    dist = cfg.distributed
    from ortflow.runlock import RunFolderLocked, hold_all, training_folders

    if dist.launcher != "local":
        if np_ is not None or hostfile is not None or threads is not None or mpiexec is not None:
            _fail(f"--np, --hostfile, --threads and --mpiexec are for launcher local; launcher {dist.launcher} takes "
                  f"them from the config (distributed.num_ranks, section {dist.launcher})")
        if profile and dist.launcher == "kubernetes":
            _fail("--profile with launcher kubernetes: set train.profile_steps in the config (the pods do not get "
                  "this command's environment)")
        if profile:
            try:
                parse_steps(profile)
            except ValueError as err:
                _fail(str(err))
            os.environ[PROFILE_ENV] = profile  # the Slurm job inherits this environment
        _train_scheduled(cfg, run_dir, wait)
        return

    if np_ is not None and np_ != "auto" and not (np_.isdigit() and int(np_) > 0):
        _fail(f"--np {np_}: give a number of ranks or auto")
    try:
        if profile:
            parse_steps(profile)
            if dist.device == "cuda":
                raise ValueError("--profile traces CPU ranks only (the engine's GPU trace is not wired up): profile a "
                                 "run with distributed.device cpu")
            os.environ[PROFILE_ENV] = profile  # the ranks inherit it (overrides train.profile_steps)
        ranks = np_ if np_ in (None, "auto") else int(np_)
        layout, plan = launch_layout(cfg, run_dir, host_resources(), ranks, threads)
    except (LayoutError, ValueError) as err:
        _fail(str(err))
    split = f"; {plan.ranks} x {plan.batch_size} x {plan.accumulation} steps = {plan.global_batch}" if plan else ""
    console.print(f"layout: {layout.ranks} rank(s) x {layout.threads} thread(s) ({layout.reason}){split}",
                  highlight=False)  # fmt: skip
    try:
        # one writer per run folder, and per checkpoint folder wherever checkpoint.dir puts it
        with _writing(run_dir), hold_all(training_folders(run_dir, cfg.checkpoints_dir), wait=wait,
                                         purpose="ortflow train"):
            result = launch(
                run_dir, layout.ranks, hostfile=hostfile or dist.hostfile, num_hosts=dist.num_hosts,
                threads=layout.threads, mpiexec=mpiexec, forward_signals=True,
            )
    except (LaunchError, RunFolderLocked) as err:
        _fail(str(err))
    # The ranks stopped together on a signal and saved a stop checkpoint (or the launcher ended them after it).
    stopped = (EXIT_INTERRUPTED, EXIT_STOPPED)
    if result.returncode in stopped or (result.signal and not result.ok):
        how = "" if result.returncode in stopped else f" (the job ended with status {result.returncode})"
        console.print(f"[yellow]training stopped[/] by a signal{how}; resume with `ortflow train "
                      f"{escape(str(run_dir))}`")
        raise typer.Exit(128 + result.signal if result.signal else result.returncode)
    if not result.ok:
        _fail(result.summary(), code=result.returncode if 0 < result.returncode < 256 else 1)
    console.print(f"[green]training finished[/]: checkpoints in {cfg.checkpoints_dir}")


def _train_scheduled(cfg, run_dir: Path, wait: bool) -> None:
    """``ortflow train`` with launcher slurm or kubernetes: submit, stream the job's output, exit with its status."""
    from ortflow.launch.local import LaunchError
    from ortflow.launch.scheduled import run_scheduled
    from ortflow.runlock import RunFolderLocked, hold

    try:
        with hold(run_dir, wait=wait, purpose="ortflow train"):
            result = run_scheduled(cfg, run_dir, forward_signals=True)
    except (LaunchError, RunFolderLocked) as err:
        _fail(str(err))
    job = f"{result.launcher} job {result.job_id}"
    if result.signal:
        console.print(f"[yellow]training stopped[/] ({job}) by a signal; resume with `ortflow train "
                      f"{escape(str(run_dir))}`")
        raise typer.Exit(128 + result.signal)
    if not result.ok:
        _fail(f"{job}: {result.summary()}", code=result.returncode if 0 < result.returncode < 256 else 1)
    console.print(f"[green]training finished[/] ({job}): checkpoints in {cfg.checkpoints_dir}")


@app.command()
def tune(
    config: ConfigArg,
    overrides: SetOpt = None,
    updates: Annotated[int, typer.Option(min=1, help="Timed weight updates per candidate.")] = 6,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed weight updates first.")] = 2,
    mpiexec: Annotated[str | None, typer.Option(help="Launcher (default: the bundled MPICH mpiexec).")] = None,
) -> None:
    """Time candidate ranks x threads layouts of CPU ranks on this host; num_ranks auto then uses the fastest."""
    import json

    from ortflow.configure.configure import configure
    from ortflow.dataprep import DataError, prepare_data
    from ortflow.launch.layout import LayoutError, host_resources
    from ortflow.launch.local import LaunchError
    from ortflow.launch.tune import check_tunable
    from ortflow.launch.tune import tune as tune_layouts

    cfg = _load(config, overrides)
    try:
        check_tunable(cfg)  # before configure and prepare-data do any work
        configure(cfg)  # both are no-ops when the run folder is up to date
        prepare_data(cfg)
        path = tune_layouts(cfg, host_resources(), updates, warmup, mpiexec)
    except (ConfigError, DataError, LayoutError, LaunchError) as err:
        _fail(str(err))
    record = json.loads(path.read_text())
    for row in record["candidates"]:
        console.print(f"  {row['ranks']} x {row['threads']}: {row['samples_per_s']:.1f} samples/s", highlight=False)
    best = record["best"]
    console.print(f"[green]fastest[/]: {best['ranks']} rank(s) x {best['threads']} thread(s), recorded in {path}",
                  highlight=False)  # fmt: skip


@app.command(name="configure")
def configure_cmd(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Build the training artifacts into the run folder (does nothing when the model is unchanged).

    A fixed batch dim the graph does not depend on is made symbolic first (configure.json 'batch' records it). The
    artifacts hold no optimizer (ortflow applies the update: docs/training.md), so only the model file, the model
    section and the layout and precision settings decide a rebuild; optimizer.groups are checked against the trained
    parameters every time.
    """
    from ortflow.checkpoints.run_store import around_stage
    from ortflow.configure.configure import configure

    cfg = _load(config, overrides)
    try:
        with _writing(cfg.output_dir):
            result = around_stage("configure", cfg, configure)(cfg)  # a remote output_dir: synced with the store
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
    from ortflow.checkpoints.run_store import around_stage
    from ortflow.dataprep import DataError, prepare_data

    cfg = _load(config, overrides)
    try:
        with _writing(cfg.data_dir):
            manifest = around_stage("prepare_data", cfg, prepare_data)(cfg)
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
    from ortflow.checkpoints.retention import reason_label, retain_checkpoints
    from ortflow.checkpoints.run_store import around_stage

    cfg = _load(config, overrides)
    with _writing(cfg.checkpoints_dir):
        index = around_stage("retain_checkpoints", cfg, retain_checkpoints)(cfg)
    for entry in index.kept:
        reasons = ", ".join(reason_label(r, index.keep_newest) for r in entry["reasons"])
        console.print(f"  keep   step {entry['step']}: {reasons}", highlight=False)
    for entry in index.deleted:
        console.print(f"  delete step {entry['step']}", highlight=False)
    for entry in index.damaged:
        console.print(f"  [yellow]damaged[/] step {entry['step']} (left in place): {entry['error']}", highlight=False)
    console.print(f"[green]index written[/] to {index.path}", highlight=False)


CheckpointOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint", "-c",
        help="Which checkpoint of a run folder: best, latest, initial (the configured weights, before training), "
        "step-N or N (default: best by eval loss, else latest).",
    ),
]  # fmt: skip


@app.command()
def evaluate(
    source: Annotated[Path, typer.Argument(help="Run folder, or a checkpoint folder of one.")],
    checkpoint: CheckpointOpt = None,
    max_rows: Annotated[int | None, typer.Option(
        min=1, help="Evaluate the eval split's first N rows (default: the run's train.max_eval_rows, else all)."
    )] = None,
) -> None:
    """Eval loss (and accuracy for cross_entropy classifiers) of a checkpoint on the run's eval split.

    Uses the engine's eval graph with the run's eval batch size, counting every eval row once, so the loss equals
    what training records for the same checkpoint (the same rows: train.max_eval_rows counts rows of the whole split,
    on any layout). `--checkpoint initial` evaluates the configured weights.
    """
    import json

    from ortflow.export.evaluate import evaluate_checkpoint

    try:
        result = evaluate_checkpoint(source, checkpoint, max_rows)
    except ValueError as err:  # ExportError, CheckpointError, DataError, ConfigError: each says what to do
        _fail(str(err))
    accuracy = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    console.print(
        f"{Path(result.checkpoint).name} (step {result.step}): eval loss {result.loss}{accuracy} over "
        f"{result.num_rows} rows",
        highlight=False,
    )
    print(json.dumps(result.to_dict()))


@app.command(name="export")
def export_cmd(
    source: Annotated[Path | None, typer.Argument(
        help="Run folder (best checkpoint, else newest), checkpoint folder, or OUTPUT_DIR/latest (newest version).",
        show_default=False)] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Model to write (default: the run's export.path).")]
    = None,
    outputs: Annotated[str | None, typer.Option(help="Comma-separated outputs (default: the model's own).")] = None,
    eval_model: Annotated[Path | None, typer.Option(help="Eval model (default: found next to the checkpoint).")]
    = None,
    optimize: Annotated[bool, typer.Option(help="ONNX Runtime offline graph optimization (basic level).")] = False,
    quantize: Annotated[bool, typer.Option(help="Dynamic int8 quantization; reports the accuracy change.")] = False,
    tolerance: Annotated[float, typer.Option(help="Max abs difference to the eval graph accepted.")] = 1e-4,
    checkpoint: CheckpointOpt = None,
    verify: Annotated[Path | None, typer.Option(
        "--verify", help="Only check an exported model against its .sha256 sidecar (exit 1 if it differs).")] = None,
    state_dict: Annotated[Path | None, typer.Option(
        "--state-dict", help="Instead of a model, write the parameters as a safetensors state dict under their "
        "torch names, for model.load_state_dict (docs/your-model.md).")] = None,
    strip_prefix: Annotated[str | None, typer.Option(
        help="With --state-dict: remove this prefix from every key (e.g. 'model.' of an export wrapper).")] = None,
    add_prefix: Annotated[str | None, typer.Option(help="With --state-dict: put this prefix before every key.")]
    = None,
) -> None:
    """Export a verified inference model from a checkpoint and the eval model (no training session).

    The model gets a sha256 sidecar (model.onnx.sha256); `ortflow export --verify model.onnx` checks it.
    With --state-dict, writes the trained parameters as a safetensors state dict PyTorch loads instead.
    """
    import json

    from ortflow.config import RESOLVED_CONFIG_NAME, load_run_config
    from ortflow.export import export_model
    from ortflow.export.checksum import verify_model
    from ortflow.versions import resolve_run

    if verify is not None:
        try:
            digest = verify_model(verify)
        except ValueError as err:
            _fail(str(err))
        console.print(f"[green]verified[/] {escape(str(verify))}: sha256 {digest} matches its sidecar", highlight=False)
        return
    if source is None:
        _fail("give the run folder (or checkpoint folder) to export, or --verify MODEL to check an exported model")

    try:
        source = resolve_run(source)  # OUTPUT_DIR/latest: the newest completed version
    except ValueError as err:
        _fail(str(err))
    if state_dict is not None:
        _export_state_dict(source, state_dict, checkpoint, strip_prefix, add_prefix)
        return
    if out is None:
        if not (source / RESOLVED_CONFIG_NAME).exists():
            _fail(f"{source} is not a configured run folder: give the output path with -o model.onnx")
        out = load_run_config(source).export_path
    names = [n.strip() for n in outputs.split(",") if n.strip()] if outputs else []
    try:
        with _writing(out.parent):
            result = export_model(source, out, names, eval_model, optimize=optimize, quantize=quantize,
                                  tolerance=tolerance, checkpoint=checkpoint)
    except ValueError as err:  # ExportError, CheckpointError, ConfigError: each message says what to do
        _fail(str(err))
    ver = result.verification
    console.print(
        f"[green]exported[/] {result.path} from {result.checkpoint.name} (step {result.step}, eval loss "
        f"{result.eval_loss}); outputs {list(result.outputs)}; max abs diff to the eval graph {ver.max_abs_diff} "
        f"<= {ver.tolerance} on {ver.num_rows} rows ({ver.data}); sha256 {result.sha256}",
        highlight=False,
        soft_wrap=True,
    )
    if result.quantization is not None:
        console.print(f"int8: {json.dumps(result.to_dict()['quantization'])}", highlight=False, soft_wrap=True)


def _export_state_dict(source: Path, out: Path, checkpoint: str | None, strip: str | None, add: str | None) -> None:
    from ortflow.export.state_dict import export_state_dict

    try:
        with _writing(out.parent):
            result = export_state_dict(source, out, checkpoint=checkpoint, strip_prefix=strip, add_prefix=add)
    except ValueError as err:  # ExportError, CheckpointError: each message says what to do
        _fail(str(err))
    console.print(f"[green]wrote[/] {result.path}: {len(result.shapes)} tensors from {result.checkpoint} (step "
                  f"{result.step}) under their torch names; left out {len(result.left_out)} (not torch parameters)",
                  highlight=False, soft_wrap=True)


@app.command()
def render(
    config: ConfigArg,
    overrides: SetOpt = None,
    launcher: Annotated[str | None, typer.Option(help="slurm or kubernetes (default: distributed.launcher).")] = None,
) -> None:
    """Print the job training would submit, submitting nothing: the sbatch script (launcher slurm) or the MPIJob
    manifest (launcher kubernetes, checked strictly against the MPI Operator's CRD schema)."""
    from ortflow.launch.job import LaunchError
    from ortflow.launch.scheduled import render_job

    cfg = _load(config, [*(overrides or []), *([f"distributed.launcher={launcher}"] if launcher else [])])
    try:
        text = render_job(cfg)
    except (ValueError, LaunchError) as err:
        _fail(str(err))
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


@app.command()
def doctor(
    mpiexec: Annotated[str | None, typer.Option(help="The MPI launcher the ranks will be started with (e.g. "
                                                "/usr/bin/mpirun; default: the bundled MPICH's mpiexec).")] = None,
) -> None:
    """Report the engine build, CUDA libraries, GPUs, NCCL/CuPy and MPI found here, and what is missing; whether
    mpi4py's MPI is the launcher's (a mismatch starts N singletons or fails at MPI_Init) and how to fix it."""
    from ortflow.cuda_libs import OPTIONAL_FOR_OPS, diagnose
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


def _stop_record(cfg, new_version: bool) -> str:
    """Where a stopped run left its work: the version and its newest complete (stop) checkpoint."""
    from ortflow.checkpoints import list_complete
    from ortflow.versions import read_registry

    folder, version = cfg.output_dir, None
    if new_version:
        try:
            entries = [e for e in read_registry(cfg.output_dir) if e.get("path")]
        except ValueError:
            entries = []
        if entries:
            folder, version = Path(entries[-1]["path"]), entries[-1]["version"]
    done = list_complete(folder / "checkpoints")
    where = f"version {version}, " if version else ""
    return f"{where}newest checkpoint {done[-1].path}" if done else f"{where}no checkpoint was written yet"


def _newest_run_dir(cfg) -> Path:
    """The folder the progress bar watches: the running version's, once plan_version registered it."""
    from ortflow.versions import read_registry

    try:
        running = [e for e in read_registry(cfg.output_dir) if e.get("status") == "running" and e.get("path")]
    except ValueError:
        running = []
    return Path(running[-1]["path"]) if running else cfg.output_dir


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
    new_version: Annotated[bool, typer.Option(
        "--new-version", help="Train a new model version under OUTPUT_DIR/versions/ (as deployments do).")] = False,
    policy: Annotated[str | None, typer.Option(
        help="With --new-version: retrain (configured weights) or continue (warm start from the latest version).")]
    = None,
    skip_unchanged: Annotated[bool | None, typer.Option(
        "--skip-unchanged/--no-skip-unchanged",
        help="With --new-version: skip when config, model, data and policy are unchanged since the latest "
        "version.")] = None,
    wait: Annotated[bool, typer.Option(help="If another run holds the folder, wait for it instead of failing.")]
    = False,
    version: Annotated[str | None, typer.Option(
        help="With --new-version --from STAGE: the version whose stages rerun (default: the newest).")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also show Prefect's, the engine's and the ranks' log lines (always in the log file).")]
    = False,
) -> None:
    """Run the whole pipeline as a Prefect flow (no server needed); finished stages are skipped on a rerun.

    The terminal shows a line per stage, training progress, warnings and errors, the summary and what to do next;
    every log line (the ranks' and the engine's too) goes to OUTPUT_DIR/logs/run-*.log.

    With --new-version --from STAGE, that stage and the later ones rerun inside an existing version (the newest, or
    --version NAME) instead of training a new one. SIGINT/SIGTERM (once or more) stop the ranks with a stop
    checkpoint; the command then exits 130/143.
    """
    import shlex
    import signal
    import threading

    cfg = _load(config, overrides)
    # A line at once: importing Prefect and starting its server take a while on a busy machine.
    console.print(f"ortflow run {cfg.name}: {'a new version in ' if new_version else ''}{cfg.output_dir}",
                  highlight=False, markup=False)
    from ortflow.cli_terminal import failure_advice, follow_progress, next_steps, terminal
    from ortflow.flows import train_pipeline
    from ortflow.tasks import crash_vanished_runs
    from ortflow.tasks.caching import STAGES

    if from_stage is not None and from_stage not in STAGES:
        _fail(f"--from {from_stage}: unknown stage; use one of {', '.join(STAGES)}")
    if policy is not None and policy not in ("retrain", "continue"):
        _fail(f"--policy {policy}: use retrain or continue")
    if version is not None and not (new_version and from_stage):
        _fail("--version names the version whose stages --from reruns: use it with --new-version --from STAGE")
    from ortflow.deployments.local_server import api_server

    received: list[int] = []

    def on_stop_signal(signum: int, _frame: object) -> None:
        # The first SIGINT/SIGTERM unwinds like Ctrl-C: the train task's launcher stops the ranks with a stop
        # checkpoint and the flow run records its final state. A repeat (a second Ctrl-C, or the same signal sent
        # to the whole process group) must not cut that stop short.
        if received:
            console.print(f"already stopping ({signal.Signals(received[0]).name}): the ranks are writing their stop "
                          "checkpoint", highlight=False)
            return
        received.append(signum)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop_signal)
    stop = threading.Event()
    watcher = threading.Thread(target=follow_progress, args=(console, lambda: _newest_run_dir(cfg), stop),
                               daemon=True)
    command = shlex.join(["ortflow", "run", *sys.argv[sys.argv.index("run") + 1:]] if "run" in sys.argv
                         else ["ortflow", "run", str(config)])
    state = None
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    history = None if PREFECT_API_URL.value() else Path(PREFECT_HOME.value())  # the temporary server's database
    with terminal(console, cfg.output_dir / "logs", quiet=not verbose, stages=True) as log_file:
        try:
            # No PREFECT_API_URL: a temporary server in a session of its own (Ctrl-C to this terminal's process
            # group never reaches it), stopped once the flow run has its final state.
            with api_server(say=lambda line: console.print(line, highlight=False, markup=False)):
                for name in crash_vanished_runs():  # runs of this host whose process is gone (a kill -9)
                    console.print(f"flow run {name} was still Running, but its process is gone: marked Crashed",
                                  highlight=False, markup=False)
                watcher.start()
                try:
                    # The flow runs in this (main) thread: Prefect's task timeouts need it, and Ctrl-C reaches the
                    # launcher, which stops the ranks' process group.
                    state = train_pipeline(cfg, from_stage=from_stage, policy=policy, skip_unchanged=skip_unchanged,
                                           new_version=new_version, wait_for_lock=wait or None, version=version,
                                           return_state=True)
                finally:
                    stop.set()
                    watcher.join(timeout=5)
        except KeyboardInterrupt:
            received.append(received[0] if received else signal.SIGINT)
        except RuntimeError as err:  # the temporary server did not start
            if state is None and not received:
                _fail(str(err))
            raise
    if received:
        name = signal.Signals(received[0]).name
        console.print(f"[yellow]stopped by {name}[/]: {escape(_stop_record(cfg, new_version))}; the log is in "
                      f"{escape(str(log_file))}", highlight=False)
        how = "to train a new version" if new_version else "to resume from the newest checkpoint"
        console.print(f"  {how}: {escape(command)}", highlight=False)
        raise typer.Exit(128 + received[0])
    if not state.is_completed():
        try:
            state.result()
        except BaseException as err:  # noqa: BLE001 - the stage's own failure, shown without a traceback
            from ortflow.cli_terminal import disk_problem

            console.print(f"error: pipeline {state.name.lower()}: {disk_problem(err) or err}", highlight=False,
                          markup=False, style="bold red")
            for line in failure_advice(err, command):
                console.print(f"  {line}", highlight=False, markup=False)
            console.print(f"  full log with tracebacks: {log_file}", highlight=False, markup=False)
            raise typer.Exit(1) from None
        _fail(f"pipeline ended in state {state.name}")
    if state.name == "Skipped":
        console.print(f"[yellow]{escape(state.message or 'skipped')}[/]; nothing was trained", highlight=False)
        return
    from rich.table import Table

    table = Table(title=f"ortflow run {cfg.name}", show_header=False)
    for key, value in state.result().items():
        table.add_row(key, "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    summary = state.result()
    exported = Path(summary["exported model"]) if summary.get("exported model") else None
    run_dir = cfg.output_dir
    if new_version:  # the version's own folder (the registry's newest entry)
        from ortflow.versions import read_registry

        with contextlib.suppress(ValueError, IndexError, KeyError):
            run_dir = Path([e for e in read_registry(cfg.output_dir) if e.get("path")][-1]["path"])
    events = cfg.tensorboard.log_dir or run_dir / "tensorboard"
    for line in next_steps(events, exported, cfg.data.format == "text", log_file, history):
        console.print(line, highlight=False, markup=False)


@app.command()
def runs(
    config: ConfigArg,
    overrides: SetOpt = None,
    prune: Annotated[bool, typer.Option(
        "--prune", help="Delete the version folders beyond versions.keep (never pinned, latest, or running ones).")]
    = False,
) -> None:
    """List the model versions in the config's output_dir (registry.json): status, parent, losses, model."""
    from ortflow.cli_terminal import version_lines
    from ortflow.runlock import RunFolderLocked, hold, holder
    from ortflow.versions import describe, prune_versions, read_registry

    cfg = _load(config, overrides)
    if prune:
        if cfg.versions.keep is None:
            _fail("--prune: versions.keep is not set; set it in the config (or --set versions.keep=3)")
        try:
            with hold(cfg.output_dir, purpose="ortflow runs --prune"):  # writers of the registry hold the lock
                result = prune_versions(cfg.output_dir, cfg.versions.keep, cfg.versions.pinned)
        except (RunFolderLocked, ValueError) as err:
            _fail(str(err))
        console.print(f"pruned {len(result.deleted)} version(s) ({result.freed_bytes / 1e6:.1f} MB freed)"
                      f"{': ' + ', '.join(result.deleted) if result.deleted else ''}; {len(result.kept)} version "
                      f"folder(s) use {result.remaining_bytes / 1e6:.1f} MB", highlight=False)
    try:
        entries = read_registry(cfg.output_dir)
    except ValueError as err:
        _fail(str(err))
    if not entries:
        console.print(f"{cfg.output_dir}: no versions yet (deployment runs and `ortflow run --new-version` add them)",
                      highlight=False)
        return
    busy = holder(cfg.output_dir) is not None
    width = min(console.width, 100)  # a terminal's width (80 when not a terminal), no wider than 100
    for line in version_lines(entries, [describe(e, busy) for e in entries], cfg.output_dir, width):
        print(line)


@app.command()
def serve(
    config: ConfigArg,
    overrides: SetOpt = None,
    limit: Annotated[int | None, typer.Option(help="Most flow runs at once (default: no limit).")] = None,
    catch_up: Annotated[bool, typer.Option(
        "--catch-up", help="Run the scheduled runs missed while nothing served the deployments (default: drop them)."
    )] = False,
) -> None:
    """Serve train-pipeline/<name> and export-only/<name> on the config's schedule until Ctrl-C or SIGTERM.

    A stop signal stops the running flow runs with a stop checkpoint, pauses both deployments' schedules and drops
    the scheduled runs they queued, then exits 130 (SIGINT) or 143 (SIGTERM). Serving again resumes the schedules;
    scheduled runs whose time passed while nothing served them are dropped unless --catch-up is given.
    """
    from ortflow.deployments import serve_config
    from ortflow.tasks import crash_vanished_runs

    cfg = _load(config, overrides)
    for name in crash_vanished_runs():  # runs of this host whose process is gone (an earlier serve killed -9)
        console.print(f"flow run {name} was still Running, but its process is gone: marked Crashed",
                      highlight=False, markup=False)
    stopped_by = serve_config(cfg, limit=limit, catch_up=catch_up)
    if stopped_by:
        console.print(f"ortflow serve stopped by a signal: schedules paused; `ortflow serve {escape(str(config))}` "
                      "resumes them", highlight=False)
        raise typer.Exit(128 + stopped_by)


@app.command()
def automations(
    webhook: Annotated[str | None, typer.Option(
        help="URL that gets a JSON POST when an ortflow deployment run fails, crashes, times out or is late.")] = None,
    late_after: Annotated[int, typer.Option(help="Seconds after its start at which a still running run is late.")]
    = 6 * 3600,
    zombie_after: Annotated[int, typer.Option(
        help="Seconds without a heartbeat after which a run is marked Crashed (at least 60).")] = 90,
) -> None:
    """Install ortflow's Prefect automations on the server PREFECT_API_URL names (replacing earlier ones).

    Always the zombie-run automation (no heartbeat for --zombie-after seconds: the run is marked Crashed); with
    --webhook also the alerts (a Webhook block named ortflow-alerts). They match flow runs tagged ortflow.
    """
    from prefect.settings import PREFECT_API_URL

    from ortflow.deployments.alerts import install

    if not PREFECT_API_URL.value():
        _fail("automations live on a Prefect server: set PREFECT_API_URL (e.g. prefect config set "
              "PREFECT_API_URL=http://127.0.0.1:4200/api) and run again")
    try:
        names = install(webhook, late_after, zombie_after)
    except ValueError as err:
        _fail(str(err))
    console.print(f"[green]installed[/] {', '.join(names)} on {escape(str(PREFECT_API_URL.value()))}",
                  highlight=False)


# `\[` in help text: rich markup would read `[batch, tokens]` as a style tag and drop it.
@app.command()
def sample(
    model: Annotated[Path, typer.Argument(
        help="Exported byte-level language model (.onnx), or OUTPUT_DIR/latest (the newest version's).")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Bytes to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0, help="Softmax temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option(min=1, help="Sample among the k likeliest bytes.")] = 40,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    seq_len: Annotated[int | None, typer.Option(help="Context length if the model's is symbolic.")] = None,
) -> None:
    """Print the prompt followed by text generated by an exported model.

    The model takes int64 token ids \\[batch, tokens] (a batch dim fixed above 1 is filled with copies of the context)
    and returns logits \\[batch, tokens, V], \\[batch*tokens, V] or \\[batch, V]; the last position's logits of row 0
    pick the next byte.
    """
    from ortflow.sample import SampleError, generate
    from ortflow.versions import resolve_model

    try:
        model = resolve_model(model)  # OUTPUT_DIR/latest: the newest completed version's exported model
    except ValueError as err:
        _fail(str(err))
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


checkpoint_app = typer.Typer(
    help="Inspect, verify or merge a checkpoint folder (HDF5; no engine needed).", no_args_is_help=True
)
app.add_typer(checkpoint_app, name="checkpoint")
CheckpointArg = Annotated[Path, typer.Argument(help="A checkpoint folder (step-NNNNNNNN).", show_default=False)]


@checkpoint_app.command("inspect")
def checkpoint_inspect(path: CheckpointArg) -> None:
    """Print a checkpoint's step, data cursor, files, parameters and optimizer state as JSON (verified first)."""
    import json

    from ortflow.checkpoints import CheckpointError
    from ortflow.checkpoints.tools import inspect

    try:
        print(json.dumps(inspect(path), indent=1))
    except CheckpointError as err:
        _fail(str(err))


@checkpoint_app.command("verify")
def checkpoint_verify(path: CheckpointArg) -> None:
    """Check meta.json's digest and every file's size and sha256; exit 1 naming the damaged file."""
    from ortflow.checkpoints import CheckpointError, verify

    try:
        info = verify(path)
    except CheckpointError as err:
        _fail(str(err))
    console.print(f"ok: {info.path} (step {info.step}, {len(info.meta['files'])} file(s) verified)", highlight=False)


@checkpoint_app.command("merge")
def checkpoint_merge(
    path: CheckpointArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="HDF5 file to write (one dataset per tensor).")],
) -> None:
    """Gather parameters and every rank's optimizer shards into one HDF5 file readable with plain h5py."""
    from ortflow.checkpoints import CheckpointError
    from ortflow.checkpoints.tools import merge

    try:
        info = merge(path, out)
    except (CheckpointError, ValueError) as err:
        _fail(str(err))
    console.print(f"merged {info.path} (step {info.step}) into {out}", highlight=False)


@app.command()
def example(
    kind: Annotated[str, typer.Argument(help="gpt (byte-level GPT on text) or mlp (classifier on tabular data).")],
    folder: Annotated[Path, typer.Argument(help="Folder to write config.yaml and model.onnx into.")],
    data: Annotated[str | None, typer.Option(
        help="Training glob for the config (gpt default: this Python's stdlib *.py; mlp: synthetic data/train.npz).")]
    = None,
) -> None:
    """Write a runnable example (config, model, and the MLP's data) from the installed package."""
    from ortflow.examples.write import write_example

    try:
        config = write_example(kind, folder, data)
    except ValueError as err:
        _fail(str(err))
    console.print(f"wrote {config} and {folder / 'model.onnx'}; next: ortflow run {config}", highlight=False)


def main() -> None:
    """Entry point of the ``ortflow`` console script.

    A full, read-only or forbidden disk is reported as such (the path and the fix), not as a traceback, whichever
    command met it.
    """
    from ortflow.cli_terminal import disk_problem

    try:
        app(prog_name="ortflow")
    except OSError as err:
        message = disk_problem(err)
        if message is None:
            raise
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
