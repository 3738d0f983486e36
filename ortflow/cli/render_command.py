"""``ortflow render``: the job training would submit (sbatch script or MPIJob manifest), submitting nothing."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ortflow.cli.shared import ConfigArg, SetOpt, fail, load


def render(
    config: ConfigArg,
    overrides: SetOpt = None,
    launcher: Annotated[str | None, typer.Option(help="slurm or kubernetes (default: distributed.launcher).")] = None,
) -> None:
    """Print the job training would submit, submitting nothing: the sbatch script (launcher slurm) or the MPIJob
    manifest (launcher kubernetes, checked strictly against the MPI Operator's CRD schema)."""
    from ortflow.launch.job import LaunchError
    from ortflow.launch.scheduled import render_job

    cfg = load(config, [*(overrides or []), *([f"distributed.launcher={launcher}"] if launcher else [])])
    try:
        text = render_job(cfg)
    except (ValueError, LaunchError) as err:
        fail(str(err))
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
