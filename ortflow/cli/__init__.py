"""The ``ortflow`` command line: :mod:`.app` registers the commands, one small module per command (or per group of
related commands); :mod:`.shared` holds the console and the arguments they share, :mod:`.terminal` what
``ortflow run`` shows in a terminal."""

from ortflow.cli.app import app, main

__all__ = ["app", "main"]
