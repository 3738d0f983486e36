"""The pipeline's stages one at a time: ``ortflow configure``, ``prepare-data`` and ``retain`` (``train`` has its
own module)."""

from __future__ import annotations

from ortflow.cli.shared import ConfigArg, SetOpt, console, fail, load, writing


def configure(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Build the training artifacts into the run folder (does nothing when the model is unchanged).

    A fixed batch dim the graph does not depend on is made symbolic first (configure.json 'batch' records it). The
    artifacts hold no optimizer (ortflow applies the update: docs/training.md), so only the model file, the model
    section and the layout and precision settings decide a rebuild; optimizer.groups are checked against the trained
    parameters every time.
    """
    from ortflow.checkpoints.run_store import around_stage
    from ortflow.config import ConfigError
    from ortflow.configure.configure import configure as build

    cfg = load(config, overrides)
    try:
        with writing(cfg.output_dir):
            result = around_stage("configure", cfg, build)(cfg)  # a remote output_dir: synced with the store
    except ConfigError as err:
        fail(str(err))
    state = "unchanged, reused existing artifacts" if result.reused else "built artifacts"
    console.print(f"[green]configured[/] {result.run_dir}: {state}", highlight=False)
    console.print(
        f"  {result.info['num_parameters']:,} trainable parameters in {len(result.info['trainable'])} tensors, "
        f"{len(result.info['frozen'])} frozen; loss {result.info['loss']}",
        highlight=False,
    )


def prepare_data(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Shard the data sources into Arrow files + manifest.json in the run folder (a no-op when nothing changed)."""
    from ortflow.checkpoints.run_store import around_stage
    from ortflow.dataprep import DataError
    from ortflow.dataprep import prepare_data as shard

    cfg = load(config, overrides)
    try:
        with writing(cfg.data_dir):
            manifest = around_stage("prepare_data", cfg, shard)(cfg)
    except DataError as err:
        fail(str(err))
    shards = sum(len(s) for s in manifest.splits.values())
    console.print(
        f"{cfg.data_dir}: {manifest.num_rows('train')} train + {manifest.num_rows('eval')} eval rows, {shards} "
        f"shard(s), {manifest.num_bytes / 1e6:.1f} MB, {'reused (unchanged)' if manifest.reused else 'written'}",
        highlight=False,
        soft_wrap=True,  # one line, whatever the terminal's width
    )


def retain(config: ConfigArg, overrides: SetOpt = None) -> None:
    """Keep the newest max_num_checkpoints, the best by eval loss and the final checkpoint; write checkpoints.json."""
    from ortflow.checkpoints.retention import reason_label, retain_checkpoints
    from ortflow.checkpoints.run_store import around_stage

    cfg = load(config, overrides)
    with writing(cfg.checkpoints_dir):
        index = around_stage("retain_checkpoints", cfg, retain_checkpoints)(cfg)
    for entry in index.kept:
        reasons = ", ".join(reason_label(r, index.keep_newest) for r in entry["reasons"])
        console.print(f"  keep   step {entry['step']}: {reasons}", highlight=False)
    for entry in index.deleted:
        console.print(f"  delete step {entry['step']}", highlight=False)
    for entry in index.damaged:
        console.print(f"  [yellow]damaged[/] step {entry['step']} (left in place): {entry['error']}", highlight=False)
    console.print(f"[green]index written[/] to {index.path}", highlight=False)
