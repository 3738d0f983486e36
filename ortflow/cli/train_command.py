"""``ortflow train``: launch the ranks of a configured run folder (mpiexec here, or a Slurm or Kubernetes job)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ortflow.cli.shared import MpiexecOpt, WaitOpt, console, fail, local_paths, writing
from ortflow.cli.stop_signals import StoppedBeforeJob, StopSignals, stop_signals
from ortflow.protocol import EXIT_INTERRUPTED, EXIT_STOPPED
from ortflow.runlock import RunFolderLocked, hold, hold_all, training_folders

if TYPE_CHECKING:
    from ortflow.config import RunConfig


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
    mpiexec: MpiexecOpt = None,
    wait: WaitOpt = False,
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

    SIGTERM/SIGINT stop every rank after the same update with a stop checkpoint (exit 143/130, however often the
    signal is repeated); ranks that have not stopped after the grace period (30 s here, 60 s for a Slurm job,
    kubernetes.stop_grace_s + 30 s for an MPIJob) are killed.
    """
    local_paths(run_dir)
    with stop_signals() as stops:
        try:
            cfg = _run_config(run_dir, launcher, accept_changed_config)
            _refuse_another_split(cfg)
            if cfg.distributed.launcher != "local":
                if np_ is not None or hostfile is not None or threads is not None or mpiexec is not None:
                    fail(f"--np, --hostfile, --threads and --mpiexec are for launcher local; launcher "
                         f"{cfg.distributed.launcher} takes them from the config (distributed.num_ranks, section "
                         f"{cfg.distributed.launcher})")
                _train_scheduled(cfg, run_dir, wait, profile, stops)
            else:
                _train_here(cfg, run_dir, np_, threads, hostfile, mpiexec, wait, profile, stops)
        except StoppedBeforeJob as stop:
            console.print(f"[yellow]stopped by {signal.Signals(stop.signum).name}[/] before the training job "
                          "started: nothing was trained")
            raise typer.Exit(128 + stop.signum) from None


def _run_config(run_dir: Path, launcher: str | None, accept_changed: bool) -> RunConfig:
    """The run folder's config (an edit accepted and recorded when asked), with ``--launcher`` applied."""
    from ortflow.config import ConfigError, apply_overrides, load_run_config

    try:
        cfg = load_run_config(run_dir, accept_changed=accept_changed)
        if accept_changed:
            from ortflow.configure.configure import accept_config_edit  # ONNX and the engine: only for this option

            accept_config_edit(cfg)
        return cfg if launcher is None else apply_overrides(cfg, [f"distributed.launcher={launcher}"])
    except ConfigError as err:
        fail(str(err))


def _refuse_another_split(cfg: RunConfig) -> None:
    """A checkpoint to resume of another pipeline or tensor-parallel size: refused before any job starts (the ranks
    would refuse it at start, under a scheduler after the queue wait)."""
    from ortflow.checkpoints.layout_check import resume_layout_refusal

    refusal = resume_layout_refusal(cfg)
    if refusal:
        fail(refusal)


def _refuse_unwritable(cfg: RunConfig) -> None:
    """A checkpoint or TensorBoard folder that takes no files, refused before any rank starts (as validate does)."""
    from ortflow.validate import training_path_problems

    problems = training_path_problems(cfg)
    if problems:
        fail("; ".join(problems))


def _busy(err: RunFolderLocked, run_dir: Path) -> str:
    """The refusal of a folder another run holds, with this command's way to queue behind it."""
    return f"{err}\n  to queue behind it instead: ortflow train {run_dir} --wait"


def _set_profile(profile: str | None, cfg: RunConfig) -> None:
    """Check ``--profile A:B`` and put it in the environment the ranks (or the Slurm job) inherit."""
    from ortflow.trainer.profile_report import PROFILE_ENV, parse_steps

    if not profile:
        return
    if cfg.distributed.launcher == "kubernetes":
        fail("--profile with launcher kubernetes: set train.profile_steps in the config (the pods do not get "
             "this command's environment)")
    try:
        _, end = parse_steps(profile)
    except ValueError as err:
        fail(str(err))
    updates = cfg.train.num_weight_updates
    if end > updates:
        fail(f"--profile {profile} ends after the run's {updates} weight update(s): profile updates within "
             f"1..{updates}")
    if cfg.distributed.launcher == "local" and cfg.distributed.device == "cuda":
        fail("--profile traces CPU ranks only (the engine's GPU trace is not wired up): profile a run with "
             "distributed.device cpu")
    os.environ[PROFILE_ENV] = profile  # overrides train.profile_steps


def _train_here(cfg: RunConfig, run_dir: Path, np_: str | None, threads: int | None, hostfile: Path | None,
                mpiexec: str | None, wait: bool, profile: str | None, stops: StopSignals) -> None:
    """Launcher local: choose the layout, hold the folders, run mpiexec, report how the ranks ended."""
    from ortflow.launch.job import LaunchError
    from ortflow.launch.layout import LayoutError, host_resources, launch_layout
    from ortflow.launch.local import launch

    if np_ is not None and np_ != "auto" and not (np_.isdigit() and int(np_) > 0):
        fail(f"--np {np_}: give a number of ranks or auto")
    _set_profile(profile, cfg)
    if _already_complete(cfg, run_dir, "no ranks started"):
        return
    _refuse_unwritable(cfg)
    try:
        layout, plan = launch_layout(cfg, run_dir, host_resources(), np_ if np_ in (None, "auto") else int(np_),
                                     threads)
    except (LayoutError, ValueError) as err:
        fail(str(err))
    split = f"; {plan.describe()}" if plan else ""
    console.print(f"layout: {layout.ranks} rank(s) x {layout.threads} thread(s) ({layout.reason}){split}",
                  highlight=False)  # fmt: skip
    dist = cfg.distributed
    try:
        # one writer per run folder, and per checkpoint folder wherever checkpoint.dir puts it
        with writing(run_dir), hold_all(training_folders(run_dir, cfg.checkpoints_dir), wait=wait,
                                        purpose="ortflow train"):
            stops.phase = "job"
            result = launch(run_dir, layout.ranks, hostfile=hostfile or dist.hostfile, num_hosts=dist.num_hosts,
                            threads=layout.threads, mpiexec=mpiexec, forward_signals=True, received=stops.received)
    except RunFolderLocked as err:
        fail(_busy(err, run_dir))
    except LaunchError as err:
        fail(str(err))
    finally:
        stops.phase = "after"
    # The ranks stopped together on a signal and saved a stop checkpoint (or the launcher ended them after it).
    stopped = (EXIT_INTERRUPTED, EXIT_STOPPED)
    if result.returncode in stopped or (result.signal and not result.ok):
        how = "" if result.returncode in stopped else f" (the job ended with status {result.returncode})"
        console.print(f"[yellow]training stopped[/] by a signal{how}; resume with `ortflow train "
                      f"{escape(str(run_dir))}`")
        raise typer.Exit(128 + result.signal if result.signal else result.returncode)
    if not result.ok:
        fail(result.summary(), code=result.returncode if 0 < result.returncode < 256 else 1)
    console.print(f"[green]training finished[/]: checkpoints in {cfg.checkpoints_dir}")


def _already_complete(cfg: RunConfig, run_dir: Path, nothing: str) -> bool:
    """Say so when the run's final checkpoint exists and verifies: ranks (or a scheduler job) would only resume at the
    last step and exit. ``nothing`` names what is then not started."""
    from ortflow.checkpoints import completed_run
    from ortflow.config import RESOLVED_CONFIG_NAME

    updates = cfg.train.num_weight_updates
    if completed_run(cfg) is None:
        return False
    console.print(f"training is already complete at step {updates}/{updates} (checkpoints in "
                  f"{escape(str(cfg.checkpoints_dir))}): {nothing}; to train further, raise train.num_train_steps in "
                  f"{escape(str(run_dir / RESOLVED_CONFIG_NAME))} and run `ortflow train {escape(str(run_dir))} "
                  "--accept-changed-config`", highlight=False)
    return True


def _train_scheduled(cfg: RunConfig, run_dir: Path, wait: bool, profile: str | None, stops: StopSignals) -> None:
    """Launcher slurm or kubernetes: submit, stream the job's output, exit with its status."""
    from ortflow.launch.job import LaunchError
    from ortflow.launch.scheduled import run_scheduled

    _set_profile(profile, cfg)  # the Slurm job inherits this environment
    try:
        with hold(run_dir, wait=wait, purpose="ortflow train"):
            if _already_complete(cfg, run_dir, f"no {cfg.distributed.launcher} job submitted"):
                return
            _refuse_unwritable(cfg)
            stops.phase = "job"
            result = run_scheduled(cfg, run_dir, forward_signals=True, received=stops.received)
    except RunFolderLocked as err:
        fail(_busy(err, run_dir))
    except LaunchError as err:
        fail(str(err))
    finally:
        stops.phase = "after"
    job = f"{result.launcher} job {result.job_id}"
    if result.signal:
        console.print(f"[yellow]training stopped[/] ({job}) by a signal; resume with `ortflow train "
                      f"{escape(str(run_dir))}`")
        raise typer.Exit(128 + result.signal)
    if not result.ok:
        fail(f"{job}: {result.summary()}", code=result.returncode if 0 < result.returncode < 256 else 1)
    console.print(f"[green]training finished[/] ({job}): checkpoints in {cfg.checkpoints_dir}")
