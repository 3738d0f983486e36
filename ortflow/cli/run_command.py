"""``ortflow run``: the whole pipeline as a Prefect flow in this terminal (:mod:`.run_flow` runs it; imported when the
command runs, since it needs the config, the flows and Prefect)."""

from __future__ import annotations

from typing import Annotated

import typer

from ortflow.cli.shared import ConfigArg, SetOpt, WaitOpt


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
    wait: WaitOpt = False,
    version: Annotated[str | None, typer.Option(
        help="With --new-version --from STAGE: the version whose stages rerun (default: the newest).")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also show Prefect's, the engine's and the ranks' log lines (always in the log file).")]
    = False,
) -> None:
    """Run the whole pipeline as a Prefect flow (no server needed); finished stages are skipped on a rerun.

    The terminal shows a line per stage, training progress, a Slurm or Kubernetes job's id and state (pending, each
    allocation, a time-limit requeue), warnings and errors, the summary and what to do next; every log line (the
    ranks' and the engine's too) goes to OUTPUT_DIR/logs/run-*.log.

    With --new-version --from STAGE, that stage and the later ones rerun inside an existing version (the newest, or
    --version NAME) instead of training a new one. SIGINT/SIGTERM (once or more) stop the ranks with a stop
    checkpoint; the command then exits 130/143.
    """
    from ortflow.cli.run_flow import run_in_terminal

    run_in_terminal(config, overrides, from_stage, new_version, policy, skip_unchanged, wait, version, verbose)
