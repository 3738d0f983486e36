"""What every command module shares: the console, the common arguments, and errors reported as one line (exit 1)
instead of a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from ortflow.cli.terminal import disk_problem

if TYPE_CHECKING:
    from ortflow.config import RunConfig

console = Console(stderr=True, soft_wrap=True)  # messages stay whole lines: users grep them

ConfigArg = Annotated[Path, typer.Argument(help="Run config (YAML).", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config value: --set train.batch_size=8 (repeatable)."),
]
CheckpointOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint", "-c",
        help="Which checkpoint of a run folder: best, latest, initial (the configured weights, before training), "
        "step-N or N (default: best by eval loss, else latest).",
    ),
]  # fmt: skip
MpiexecOpt = Annotated[str | None, typer.Option(help="Launcher (default: the bundled MPICH mpiexec).")]
WaitOpt = Annotated[bool, typer.Option(help="If another run holds the folder, wait for it instead of failing.")]


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` and exit with ``code``."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # `[rank 0]`, `[/x` stay text
    raise typer.Exit(code)


def say(line: str) -> None:
    """Print a line as it is (no markup, no highlighting)."""
    console.print(line, highlight=False, markup=False)


@contextlib.contextmanager
def writing(where: Path) -> Iterator[None]:
    """Report a full, read-only or forbidden disk met while writing under ``where`` as such, without a traceback."""
    try:
        yield
    except OSError as err:
        from ortflow.storage import StorageError

        message = str(err) if isinstance(err, StorageError) else disk_problem(err, where)  # a store out of reach
        if message is None:  # another system refusal (/proc, a vanished folder): named, not a traceback
            message = (f"cannot use {err.filename or where}: {err.strerror or err}; point output_dir / checkpoint.dir "
                       "/ export.path at a folder you can write, then rerun the command")
        fail(message)


def _url(path: Path | None) -> str | None:
    """The object-store URL a Path argument was given as (the shell's ``s3://b/run`` reaches it as ``s3:/b/run``)."""
    from ortflow.config.base import REMOTE_SCHEMES

    scheme, sep, rest = str(path).partition(":/") if path is not None else ("", "", "")
    return f"{scheme}://{rest.lstrip('/')}" if sep and scheme.lower() in REMOTE_SCHEMES else None


def local_paths(run_folder: Path | None = None, **outputs: Path | None) -> None:
    """Refuse an object-store URL where a command takes a local path (a Path argument given ``s3://b/run`` would name
    a local folder ``s3:``): ``run_folder`` is a run folder the command runs in place (the message names its local
    copy), ``outputs`` maps option names to the paths they write."""
    from ortflow.config.storage import cache_folder

    remote = _url(run_folder)
    if remote is not None:
        fail(f"{remote}: this command reads local files; a run folder on object storage is read through its local "
             f"copy, {cache_folder(remote, None)} (`ortflow run CONFIG` brings it up to the store, every kept "
             "checkpoint included; with another storage.cache_dir, the copy is under it)")
    for option, path in outputs.items():
        remote = _url(path)
        if remote is not None:
            fail(f"{option} {remote}: takes a local path; write the file here, then copy it to the store (a run "
                 "whose output_dir is on the store uploads its export/model.onnx itself)")


def fetched(source: Path, what: str = "run") -> Path:
    """``source`` as a local path: a URL of a run folder on object storage (or of one of its checkpoint folders, or
    ``OUTPUT_DIR/latest``) is brought up to the store in its local copy, which is returned; ``what="file"``: a file
    on the store (an exported model) is downloaded into its place in the local copies. A local path is returned as
    is; a store out of reach, refused credentials or a folder that is not a run folder exit with one line."""
    remote = _url(source)
    if remote is None:
        return source
    from ortflow.checkpoints.run_store import fetch_file, fetch_run
    from ortflow.config import ConfigError

    say(f"{remote}: bringing the local copy up to the store")
    try:
        local = fetch_file(remote) if what == "file" else fetch_run(remote)
    except (OSError, ConfigError, ValueError) as err:  # StorageError, a missing file or config: each says what to do
        fail(str(err))
    say(f"{remote}: local copy {local}")
    return local


def load(config: Path, overrides: list[str] | None) -> RunConfig:
    """The run config with its ``--set`` overrides, or exit naming what is wrong with it."""
    from ortflow.config import ConfigError, load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        fail(str(err))
