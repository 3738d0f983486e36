"""``ortflow example``: a runnable example written from the installed package."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ortflow.cli.shared import console, fail


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
        fail(str(err))
    console.print(f"wrote {config} and {folder / 'model.onnx'}; next: ortflow run {config}", highlight=False)
