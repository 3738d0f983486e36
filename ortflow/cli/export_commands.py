"""``ortflow evaluate`` and ``ortflow export``: a trained checkpoint's eval loss, and the inference model (or
state dict) made from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ortflow.cli.shared import CheckpointOpt, console, fail, fetched, local_paths, writing


def evaluate(
    source: Annotated[Path, typer.Argument(help="Run folder, a checkpoint folder of one, or OUTPUT_DIR/latest (newest "
                                           "version); a path, or its s3:// / gs:// / az:// URL (brought up to the "
                                           "store in its local copy first).")],
    checkpoint: CheckpointOpt = None,
    max_rows: Annotated[int | None, typer.Option(
        min=1, help="Evaluate the eval split's first N rows (default: the run's train.max_eval_rows, else all)."
    )] = None,
) -> None:
    """Eval loss (and, for loss cross_entropy, accuracy) of a checkpoint on the run's eval split.

    Uses the engine's eval graph with the run's eval batch size, counting every eval row once, so the loss equals
    what training records for the same checkpoint (the same rows: train.max_eval_rows counts rows of the whole split,
    on any layout). `--checkpoint initial` evaluates the configured weights.
    """
    from ortflow.export.evaluate import evaluate_checkpoint
    from ortflow.versions import resolve_run

    source = fetched(source)  # a run folder on object storage: its local copy, up to the store
    try:
        source = resolve_run(source)  # OUTPUT_DIR/latest: the newest completed version
        result = evaluate_checkpoint(source, checkpoint, max_rows)
    except ValueError as err:  # ExportError, CheckpointError, DataError, ConfigError: each says what to do
        fail(str(err))
    accuracy = "" if result.accuracy is None else f", accuracy {result.accuracy:.4f}"
    console.print(
        f"{Path(result.checkpoint).name} (step {result.step}): eval loss {result.loss}{accuracy} over "
        f"{result.num_rows} rows",
        highlight=False,
    )
    print(json.dumps(result.to_dict()))


def export(
    source: Annotated[Path | None, typer.Argument(
        help="Run folder (best checkpoint, else newest), checkpoint folder, or OUTPUT_DIR/latest (newest version); "
        "a path, or a URL on object storage (brought up to the store in its local copy first).",
        show_default=False)] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Model to write (default: the run's export.path).")]
    = None,
    outputs: Annotated[str | None, typer.Option(help="Comma-separated outputs (default: the model's own).")] = None,
    eval_model: Annotated[Path | None, typer.Option(help="Eval model (default: found next to the checkpoint).")]
    = None,
    optimize: Annotated[bool, typer.Option(help="ONNX Runtime offline graph optimization (basic level).")] = False,
    quantize: Annotated[bool, typer.Option(help="Dynamic int8 quantization; reports the accuracy change.")] = False,
    tolerance: Annotated[float, typer.Option(help="Max abs difference to the eval graph accepted.")] = 1e-4,
    checkpoint: CheckpointOpt = None,
    verify: Annotated[Path | None, typer.Option(
        "--verify", help="Only check an exported model against its .sha256 sidecar (exit 1 if it differs).")] = None,
    state_dict: Annotated[Path | None, typer.Option(
        "--state-dict", help="Instead of a model, write the parameters as a safetensors state dict under their "
        "torch names, for model.load_state_dict (docs/your-model.md).")] = None,
    strip_prefix: Annotated[str | None, typer.Option(
        help="With --state-dict: remove this prefix from every key (e.g. 'model.' of an export wrapper).")] = None,
    add_prefix: Annotated[str | None, typer.Option(help="With --state-dict: put this prefix before every key.")]
    = None,
) -> None:
    """Export a verified inference model from a checkpoint and the eval model (no training session).

    The model gets a sha256 sidecar (model.onnx.sha256); `ortflow export --verify model.onnx` checks it.
    With --state-dict, writes the trained parameters as a safetensors state dict PyTorch loads instead.
    """
    if verify is not None:
        _verify(verify)
        return
    # Options of the other kind of export would be ignored: the user would get a file other than the one asked for.
    model_options = [name for name, given in (("-o/--out", out is not None), ("--outputs", outputs is not None),
                                              ("--eval-model", eval_model is not None), ("--optimize", optimize),
                                              ("--quantize", quantize)) if given]
    if state_dict is not None and model_options:
        fail(f"--state-dict writes the parameters instead of a model, so {', '.join(model_options)} would do nothing: "
             "run `ortflow export` once with --state-dict and once with the model's options")
    if state_dict is None and (strip_prefix is not None or add_prefix is not None):
        fail("--strip-prefix and --add-prefix rename the keys of a state dict: add --state-dict weights.safetensors")
    if source is None:
        fail("give the run folder (or checkpoint folder) to export, or --verify MODEL to check an exported model")
    local_paths(None, **{"-o/--out": out, "--eval-model": eval_model, "--state-dict": state_dict})
    source = fetched(source)  # a run folder on object storage: its local copy, up to the store
    from ortflow.versions import resolve_run

    try:
        source = resolve_run(source)  # OUTPUT_DIR/latest: the newest completed version
    except ValueError as err:
        fail(str(err))
    if state_dict is not None:
        _export_state_dict(source, state_dict, checkpoint, strip_prefix, add_prefix)
        return
    names = [n.strip() for n in outputs.split(",") if n.strip()] if outputs else []
    _export_model(source, out, names, eval_model, optimize, quantize, tolerance, checkpoint)


def _verify(model: Path) -> None:
    from ortflow.export.checksum import verify_model

    try:
        digest = verify_model(model)
    except ValueError as err:
        fail(str(err))
    console.print(f"[green]verified[/] {escape(str(model))}: sha256 {digest} matches its sidecar", highlight=False)


def _export_model(source: Path, out: Path | None, names: list[str], eval_model: Path | None, optimize: bool,
                  quantize: bool, tolerance: float, checkpoint: str | None) -> None:
    from ortflow.config import RESOLVED_CONFIG_NAME, config_file_given, load_run_config
    from ortflow.export import export_model

    if source.is_file():
        fail(config_file_given(source) + " or one of its checkpoint folders")
    if out is None:
        if not (source / RESOLVED_CONFIG_NAME).exists():
            fail(f"{source} is not a configured run folder: give the output path with -o model.onnx")
        out = load_run_config(source).export_path
    try:
        with writing(out.parent):
            result = export_model(source, out, names, eval_model, optimize=optimize, quantize=quantize,
                                  tolerance=tolerance, checkpoint=checkpoint)
    except ValueError as err:  # ExportError, CheckpointError, ConfigError: each message says what to do
        fail(str(err))
    ver = result.verification
    recorded = ("no eval loss recorded in training" if result.eval_loss is None  # the initial weights
                else f"eval loss {result.eval_loss} as training recorded it")
    console.print(
        f"[green]exported[/] {result.path} from {result.checkpoint.name} (step {result.step}, {recorded}); "
        f"outputs {list(result.outputs)}; max abs diff to the eval graph "
        f"{ver.max_abs_diff} "
        f"<= {ver.tolerance} on {ver.num_rows} rows ({ver.data}); sha256 {result.sha256}",
        highlight=False,
        soft_wrap=True,
    )
    if result.quantization is not None:
        console.print(f"int8: {json.dumps(result.to_dict()['quantization'])}", highlight=False, soft_wrap=True)


def _export_state_dict(source: Path, out: Path, checkpoint: str | None, strip: str | None, add: str | None) -> None:
    from ortflow.export.state_dict import export_state_dict

    try:
        with writing(out.parent):
            result = export_state_dict(source, out, checkpoint=checkpoint, strip_prefix=strip, add_prefix=add)
    except ValueError as err:  # ExportError, CheckpointError: each message says what to do
        fail(str(err))
    console.print(f"[green]wrote[/] {result.path}: {len(result.shapes)} tensors from {result.checkpoint} (step "
                  f"{result.step}) under their torch names; left out {len(result.left_out)} (not torch parameters)",
                  highlight=False, soft_wrap=True)
