"""The ``ortflow`` command: the Typer app and its commands, in the order ``ortflow --help`` lists them.

Each command lives in a small module of this package, calls one plain function (or a flow) and reports errors
without tracebacks. The command modules import at their top what loads fast; Prefect, ONNX, ONNX Runtime, pyarrow,
h5py and the Kubernetes client take seconds to import, so a command imports those inside its function, when it runs,
and `ortflow --help` or a command that does not need them starts at once (tests/test_import_rules.py checks that
importing this package loads none of them).
"""

from __future__ import annotations

import inspect
import sys

import typer
from rich.markup import escape

from ortflow.cli import (
    example_command,
    export_commands,
    render_command,
    run_command,
    sample_command,
    serve_commands,
    stage_commands,
    train_command,
    tune_command,
    validate_command,
    versions_command,
)
from ortflow.cli.checkpoint_commands import checkpoint_app
from ortflow.cli.shared import console
from ortflow.cli.stop_signals import mark_process_entry
from ortflow.cli.terminal import disk_problem

ABOUT = (
    "Train ONNX models with ONNX Runtime's training engine (data,"
    " pipeline and tensor parallel, on CPUs and GPUs), under mpirun, orchestrated by Prefect."
)

app = typer.Typer(name="ortflow", help=ABOUT, no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """The ortflow command (its help is ``ABOUT``)."""


app.command()(validate_command.validate)
app.command()(train_command.train)
app.command()(tune_command.tune)
app.command(name="configure")(stage_commands.configure)
app.command(name="prepare-data")(stage_commands.prepare_data)
app.command(name="retain")(stage_commands.retain)
app.command()(export_commands.evaluate)
app.command(name="export")(export_commands.export)
app.command()(render_command.render)
app.command()(validate_command.doctor)
app.command()(run_command.run)
app.command()(versions_command.runs)
app.command()(serve_commands.serve)
app.command()(serve_commands.automations)
app.command()(sample_command.sample)
app.add_typer(checkpoint_app, name="checkpoint")
app.command()(example_command.example)


def reflow(doc: str) -> str:
    """A command's docstring as its ``--help`` prose: the lines of each paragraph joined, so that the terminal wraps
    them at its own width (Typer keeps a docstring's line breaks after the first paragraph); a paragraph with a list
    item or an indented line keeps its lines."""
    paragraphs = []
    for paragraph in doc.split("\n\n"):
        lines = paragraph.splitlines()
        keep = any(line.startswith(("- ", "* ", " ", "\b")) for line in lines)
        paragraphs.append(paragraph if keep else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def _reflow_help(typer_app: typer.Typer) -> None:
    for info in typer_app.registered_commands:
        if info.help is None and info.callback is not None:
            info.help = reflow(inspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        _reflow_help(group.typer_instance)


_reflow_help(app)


def main() -> None:
    """Entry point of the ``ortflow`` console script.

    A full, read-only or forbidden disk is reported as such (the path and the fix), not as a traceback, whichever
    command met it.
    """
    mark_process_entry()
    try:
        app(prog_name="ortflow")
    except OSError as err:
        message = disk_problem(err)
        if message is None:
            raise
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        sys.exit(1)
