"""``ortflow checkpoint inspect|verify|merge``: a checkpoint folder read with h5py (no engine needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ortflow.cli.shared import console, fail, writing

checkpoint_app = typer.Typer(
    help="Inspect, verify or merge a checkpoint folder (HDF5; no engine needed).", no_args_is_help=True
)
CheckpointArg = Annotated[Path, typer.Argument(help="A checkpoint folder (step-NNNNNNNN).", show_default=False)]


@checkpoint_app.command("inspect")
def checkpoint_inspect(path: CheckpointArg) -> None:
    """Print a checkpoint's step, data cursor, files, parameters and optimizer state as JSON (verified first)."""
    from ortflow.checkpoints import CheckpointError
    from ortflow.checkpoints.tools import inspect

    try:
        print(json.dumps(inspect(path), indent=1))
    except CheckpointError as err:
        fail(str(err))


@checkpoint_app.command("verify")
def checkpoint_verify(path: CheckpointArg) -> None:
    """Check meta.json's digest and every file's size and sha256; exit 1 naming the damaged file."""
    from ortflow.checkpoints import CheckpointError, verify

    try:
        info = verify(path)
    except CheckpointError as err:
        fail(str(err))
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
        with writing(out.parent):
            info = merge(path, out)
    except (CheckpointError, ValueError) as err:
        fail(str(err))
    console.print(f"merged {info.path} (step {info.step}) into {out}", highlight=False)
