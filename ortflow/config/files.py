"""Checks that need the disk: the model file is a bounded regular file of valid ONNX the engine can run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ortflow.config.base import MAX_IR_VERSION, MAX_OPSET, RESOLVED_CONFIG_NAME, ConfigError, regular_file_problem
from ortflow.config.loading import load_config
from ortflow.config.model_checks import model_structure_problems
from ortflow.config.run import RunConfig

# ---------------------------------------------------------------------------------------------------------------------
# File checks


#: Protocol buffers cannot hold more than 2 GiB: larger models keep their weights in external data files.
MAX_MODEL_BYTES = 2 << 30


def check_model_file(path: Path) -> list[str]:
    """Problems with the ONNX model file: missing, not ONNX, opset/IR too new, external data outside its folder."""
    import onnx  # local: only file checks need it

    if not path.exists():
        return [f"model.path: {path} does not exist; check the path (relative paths start at the config's folder)"]
    refusal = regular_file_problem(path, MAX_MODEL_BYTES, "an ONNX model")
    if refusal:
        return [f"model.path: {refusal}"]
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - onnx raises several types for bad files
        return [f"model.path: {path} is not a valid ONNX model ({type(err).__name__}: {err}); re-export it"]
    problems = []
    if proto.ir_version > MAX_IR_VERSION:
        problems.append(
            f"model.path: IR version {proto.ir_version} is newer than the engine runs (<= {MAX_IR_VERSION}); re-export "
            f"with onnx 1.17 or set `model.ir_version = {MAX_IR_VERSION}` before saving"
        )
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            problems.append(
                f"model.path: opset {opset.version} is newer than the engine runs (<= {MAX_OPSET}); re-export with "
                f"opset_version={MAX_OPSET} (torch.onnx.export) or opset_imports=[make_opsetid('', {MAX_OPSET})]"
            )
    folder = path.resolve().parent
    problems.extend(_short_initializers(proto))
    problems.extend(model_structure_problems(proto, folder))  # recursion, zero dims, short data, NaN weights
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                if "\0" in entry.value:
                    problems.append(
                        f"model.path: initializer '{tensor.name}' names its external data file {entry.value!r}, "
                        "which holds a NUL byte (a damaged model); re-export it"
                    )
                    continue
                target = (folder / entry.value).resolve()
                if not target.is_relative_to(folder):
                    problems.append(
                        f"model.path: initializer '{tensor.name}' keeps its data at '{entry.value}', outside the "
                        f"model's folder; refused for safety: move the data file next to the model"
                    )
                elif not target.exists():
                    problems.append(f"model.path: external data file '{entry.value}' of '{tensor.name}' is missing")
    if not problems:
        try:
            onnx.checker.check_model(str(path))
        except Exception as err:  # noqa: BLE001
            problems.append(f"model.path: the ONNX checker rejects {path.name}: {err}")
    return problems


def _short_initializers(proto: Any) -> list[str]:
    """Initializers whose stored bytes do not fill their declared shape (the engine fails without naming them)."""
    import math

    import onnx

    problems = []
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
            continue
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, ValueError, TypeError):
            continue
        want = math.prod(tensor.dims) * itemsize
        if len(tensor.raw_data) != want:
            problems.append(
                f"model.path: initializer '{tensor.name}' declares shape {list(tensor.dims)} ({want} bytes) but holds "
                f"{len(tensor.raw_data)} bytes; the model file is damaged or was edited: re-export it"
            )
    return problems


def check_files(cfg: RunConfig) -> list[str]:
    """Checks that need the disk: the model file, the host file, the tokenizer, the output folder."""
    problems = check_model_file(cfg.model.path)
    if cfg.output_dir.exists() and not cfg.output_dir.is_dir():
        problems.append(f"output_dir: {cfg.output_dir} is a file, not a folder; choose another output_dir")
    if cfg.distributed.hostfile is not None and not cfg.distributed.hostfile.exists():
        problems.append(f"distributed.hostfile: {cfg.distributed.hostfile} does not exist")
    tok = cfg.data.text.tokenizer
    if tok is not None and not tok.exists():
        problems.append(f"data.text.tokenizer: {tok} does not exist")
    for field, folder in (("init_from", cfg.checkpoint.init_from),
                          ("checkpoint_to_load_path", cfg.checkpoint.checkpoint_to_load_path)):
        if folder is not None and not folder.exists():
            problems.append(f"checkpoint.{field}: {folder} does not exist; give a checkpoint folder (step-N) or remove "
                            f"the field")
    return problems


def find_problems(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[RunConfig | None, list[str]]:
    """Every problem with a config file at once: YAML, fields, cross-field rules, then the files it names."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        return None, err.problems
    problems = check_files(cfg)
    if (cfg.output_dir / RESOLVED_CONFIG_NAME).resolve() == Path(path).resolve():
        problems.append(f"output_dir: {cfg.output_dir} is this config's own folder, and configure writes the resolved "
                        f"config to {RESOLVED_CONFIG_NAME} there, over this file: choose an output_dir of its own "
                        "(e.g. runs/NAME)")
    return cfg, problems
