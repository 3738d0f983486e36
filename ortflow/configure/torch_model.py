"""The model configure builds from: a dynamo export with one initializer per torch parameter, under its torch name.

A TorchScript export is used as it is, except that parameters its exporter merged because their values were equal
(a fresh model's zero biases and norm weights) get one initializer each again
(:mod:`ortflow.graph.exports.torchscript`; the copy is written to ``torch-model/``).
A dynamo export (torch's default exporter) goes through
:func:`ortflow.graph.exports.torch_params.torch_parameters` once: renamed and pre-transposed weights get their torch
names and layouts, merged ones are untied, the integer constant arithmetic the exporter leaves (``optimize=False``) is
folded (:mod:`ortflow.graph.exports.constant_folding`), the constants the exporter computed (``expand_1``, scalars)
become ``Constant`` nodes and the torch buffers (RoPE's ``inv_freq``, masks) are added to ``model.frozen``, so the
engine trains exactly the torch model's parameters. The result is written beside the artifacts (``torch-model/``,
weights in external data) and the config configure builds from points at it; ``configure.json`` records what was trained
under which torch name (``torch``), what was untied and what was frozen and why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from ortflow.config import RunConfig
from ortflow.configure.engine_input import ArtifactsError
from ortflow.graph.exports.constant_folding import fold_int_constants
from ortflow.graph.exports.torch_params import TorchParameters, is_dynamo_export, torch_parameters
from ortflow.graph.exports.torchscript import untie_deduplicated
from ortflow.graph.onnx_tools import GraphError

log = logging.getLogger(__name__)

#: The folder, beside the artifacts folder, that holds the torch-named model configure builds from.
TORCH_MODEL_DIR = "torch-model"


def _escaped(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def read_torch_parameters(model_path: Path) -> TorchParameters | None:
    """The torch parameters of a dynamo export (None for other exports), with its weights loaded.

    Raises:
        ArtifactsError: The exporter merged or dropped parameters beyond what its metadata lets ortflow undo; the
            message gives the export call that keeps them.
    """
    proto = onnx.load(str(model_path), load_external_data=False)
    if not is_dynamo_export(proto):
        return None
    onnx.external_data_helper.load_external_data_for_model(proto, str(Path(model_path).parent))
    try:
        return torch_parameters(proto)
    except GraphError as err:
        raise ArtifactsError(str(err)) from None


def torch_source(cfg: RunConfig, folder: Path) -> tuple[RunConfig, TorchParameters | None]:
    """The config to build from: ``cfg`` itself for a TorchScript export (or its untied copy,
    :func:`_torchscript_source`); for a dynamo export, ``cfg`` with
    ``model.path`` at the torch-named model written into ``folder`` and its non-parameters in ``model.frozen``.

    Raises:
        ArtifactsError: As :func:`read_torch_parameters`.
    """
    found = read_torch_parameters(cfg.model.path)
    if found is None:
        return _torchscript_source(cfg, folder), None
    model = fold_int_constants(found.model)  # shape inference then types what the splits pass between pieces
    target = _write(model, folder, Path(cfg.model.path).name)
    for line in found.untied:
        log.info("model.path: untied %s", line)
    if found.frozen:
        log.info("model.path: not trained (not torch parameters): %s", ", ".join(sorted(found.frozen)))
    for table, row in found.padding.items():
        log.info("model.path: the embedding reading '%s' has torch's padding_idx %d: its lookup gives that row no "
                 "gradient from ids equal to %d, as torch's does", table, row, row)
    kept = {t.name for t in model.graph.initializer}  # buffers; computed constants became Constant nodes
    frozen = (*cfg.model.frozen, *(_escaped(name) for name in sorted(found.frozen) if name in kept))
    model = cfg.model.model_copy(update={"path": target, "frozen": frozen})
    return cfg.model_copy(update={"model": model}), found


def _write(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    """Save ``model`` as ``folder/name`` with its weights in ``name.data``; the path."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    data = target.with_name(target.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends external data to an existing file
    onnx.save(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
              location=data.name, size_threshold=1024)
    return target


def _torchscript_source(cfg: RunConfig, folder: Path) -> RunConfig:
    """``cfg`` for a TorchScript export; with ``model.path`` at a copy whose merged parameters are untied
    (:mod:`ortflow.graph.exports.torchscript`) when the exporter merged equal-valued ones."""
    proto = onnx.load(str(cfg.model.path), load_external_data=False)
    if not untie_deduplicated(proto)[1]:
        return cfg
    onnx.external_data_helper.load_external_data_for_model(proto, str(Path(cfg.model.path).parent))
    model, lines = untie_deduplicated(proto)
    log.info("model.path: untied %d parameter(s) the TorchScript exporter merged: %s", len(lines),
             "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else ""))
    target = _write(model, folder, Path(cfg.model.path).name)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": target})})
