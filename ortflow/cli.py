"""The ``ortflow`` command. Each command calls one plain function (or a flow) and reports errors without tracebacks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ortflow.config import ConfigError, find_problems, load_config

app = typer.Typer(
    name="ortflow",
    help="Train ONNX models data-parallel with ONNX Runtime's training engine, under mpirun, orchestrated by Prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

ConfigArg = Annotated[Path, typer.Argument(help="Run config (YAML).", show_default=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config value: --set train.batch_size=8 (repeatable)."),
]


@app.callback()
def _root() -> None:
    """Train ONNX models data-parallel with ONNX Runtime's training engine, under mpirun, orchestrated by Prefect."""


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def _load(config: Path, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        _fail(str(err))


@app.command()
def validate(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Check a config and the files it names; print every problem at once (exit 1 if any)."""
    _, problems = find_problems(config, overrides or [])
    if problems:
        console.print(f"[bold red]{config}: {len(problems)} problem(s)[/]")
        for problem in problems:
            console.print(f"  - {problem}", highlight=False)
        raise typer.Exit(1)
    console.print(f"[green]{config}: valid[/]")


def main() -> None:
    """Entry point of the ``ortflow`` console script."""
    app(prog_name="ortflow")


if __name__ == "__main__":
    sys.exit(main())
