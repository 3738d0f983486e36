"""``ortflow tune``: time candidate ranks x threads layouts on this host."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ortflow.cli.shared import ConfigArg, MpiexecOpt, SetOpt, console, fail, load


def tune(
    config: ConfigArg,
    overrides: SetOpt = None,
    updates: Annotated[int, typer.Option(min=1, help="Timed weight updates per candidate.")] = 6,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed weight updates first.")] = 2,
    mpiexec: MpiexecOpt = None,
) -> None:
    """Time candidate ranks x threads layouts of CPU ranks on this host; num_ranks auto then uses the fastest."""
    from ortflow.config import ConfigError
    from ortflow.configure.configure import configure
    from ortflow.dataprep import DataError, prepare_data
    from ortflow.launch.job import LaunchError
    from ortflow.launch.layout import LayoutError, host_resources
    from ortflow.launch.tune import check_tunable, tune_notes
    from ortflow.launch.tune import tune as tune_layouts

    cfg = load(config, overrides)
    try:
        check_tunable(cfg)  # before configure and prepare-data do any work
        configure(cfg)  # both are no-ops when the run folder is up to date
        prepare_data(cfg)
        path = tune_layouts(cfg, host_resources(), updates, warmup, mpiexec)
    except (ConfigError, DataError, LayoutError, LaunchError) as err:
        fail(str(err))
    record = json.loads(path.read_text())
    for row in record["candidates"]:
        console.print(f"  {row['ranks']} x {row['threads']}: {row['samples_per_s']:.1f} samples/s", highlight=False)
    best = record["best"]
    console.print(f"[green]fastest[/]: {best['ranks']} rank(s) x {best['threads']} thread(s), recorded in {path}",
                  highlight=False)  # fmt: skip
    for note in tune_notes(cfg, record):
        console.print(f"[yellow]note[/]: {note}", highlight=False)
