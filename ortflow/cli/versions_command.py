"""``ortflow runs``: the model versions in a config's output_dir, and pruning the old ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ortflow.cli.shared import ConfigArg, SetOpt, console, fail, load
from ortflow.cli.terminal import version_lines
from ortflow.runlock import RunFolderLocked, hold, holder

if TYPE_CHECKING:
    from ortflow.config import RunConfig


def runs(
    config: ConfigArg,
    overrides: SetOpt = None,
    prune: Annotated[bool, typer.Option(
        "--prune", help="Delete the version folders beyond versions.keep (never pinned, latest, or running ones).")]
    = False,
) -> None:
    """List the model versions in the config's output_dir (registry.json): status, parent, losses, model."""
    from ortflow.versions import describe, read_registry

    cfg = load(config, overrides)
    if prune:
        _prune(cfg)
    try:
        entries = read_registry(cfg.output_dir)
    except ValueError as err:
        fail(str(err))
    if not entries:
        console.print(f"{cfg.output_dir}: no versions yet (deployment runs and `ortflow run --new-version` add them)"
                      f"{_plain_run(cfg)}", highlight=False)  # fmt: skip
        return
    busy = holder(cfg.output_dir) is not None
    width = min(console.width, 100)  # a terminal's width (80 when not a terminal), no wider than 100
    for line in version_lines(entries, [describe(e, busy) for e in entries], cfg.output_dir, width):
        print(line)


def _plain_run(cfg: RunConfig) -> str:
    """``; the run folder itself: step 4/4, loss .., eval loss .., model PATH`` for a run trained without versions
    (``ortflow run CONFIG``, ``ortflow train``), from its progress.json and exported model; empty when there is none."""
    from ortflow.trainer.metrics import read_progress

    progress = read_progress(cfg.output_dir)
    if progress is None:
        return ""
    parts = [f"step {progress['step']}/{progress['total']}"]
    parts += [f"{label} {progress[key]:.4g}" for key, label in (("loss", "loss"), ("eval_loss", "eval loss"))
              if progress.get(key) is not None]
    if cfg.export_path.is_file():
        parts.append(f"model {cfg.export_path}")
    return f"; the run folder itself: {', '.join(parts)}"


def _prune(cfg: RunConfig) -> None:
    from ortflow.versions import prune_versions

    if cfg.versions.keep is None:
        fail("--prune: versions.keep is not set; set it in the config (or --set versions.keep=3)")
    try:
        with hold(cfg.output_dir, purpose="ortflow runs --prune"):  # writers of the registry hold the lock
            result = prune_versions(cfg.output_dir, cfg.versions.keep, cfg.versions.pinned)
    except (RunFolderLocked, ValueError) as err:
        fail(str(err))
    console.print(f"pruned {len(result.deleted)} version(s) ({result.freed_bytes / 1e6:.1f} MB freed)"
                  f"{': ' + ', '.join(result.deleted) if result.deleted else ''}; {len(result.kept)} version "
                  f"folder(s) use {result.remaining_bytes / 1e6:.1f} MB", highlight=False)
