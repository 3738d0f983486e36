"""The way back to PyTorch: a run's trained parameters as a safetensors state dict under their torch names.

``ortflow export RUN --state-dict weights.safetensors`` writes what ``model.load_state_dict`` reads:

* a dynamo export's run (configure.json ``torch``, :mod:`ortflow.configure.torch_model`): every torch parameter under
  its torch name and shape (configure already gave each its own tensor in torch's layout: transposes undone, merged
  tensors untied), each tied name (``lm_head.weight`` of a tied embedding) with the same values, and the persistent
  buffers the export kept; nothing else (RoPE's ``inv_freq`` and other non-persistent buffers are not in a state dict);
* a TorchScript export's run: every float tensor the checkpoint holds whose name is a torch name (TorchScript keeps
  parameter names; ``onnx::``-named constants it computed are left out and listed; a trained ``onnx::`` tensor, a
  weight its constant folding stored transposed under a computed name, is refused with the export call that keeps
  the names); the second name of a tied weight (``lm_head.weight``) with the same values, found from the module
  path of the node that reads it (:func:`ortflow.graph.exports.torchscript.tied_names`);
* either way, each BatchNorm's ``num_batches_tracked`` (no ONNX graph holds it): the micro-batches each rank ran
  forward in training mode up to the checkpoint (``micro_batches_per_rank`` in its meta.json), the count torch's
  module keeps on each rank of a data-parallel run; 0 for ``--checkpoint initial`` (docs/your-model.md).

``strip_prefix``/``add_prefix`` rename keys for a model whose module tree differs from the exported wrapper's (the
test fixtures export ``LogitsOnly(model)``, so their names start with ``model.``; ``strip_prefix="model."`` gives
the Hugging Face model's own keys). Written with the ``safetensors`` numpy API (no torch), with ``format: pt``
metadata as ``transformers`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ortflow.config import RunConfig
from ortflow.export.model import load_parameters, resolve_source
from ortflow.export.verify import ExportError
from ortflow.graph.exports.torchscript import tied_names


@dataclass(frozen=True)
class StateDictResult:
    """What :func:`export_state_dict` wrote.

    Attributes:
        path: The safetensors file.
        checkpoint: The checkpoint (or the configured weights) it was read from.
        step: That checkpoint's step.
        shapes: Written key -> shape.
        left_out: Checkpoint tensors not written, with why.
    """

    path: Path
    checkpoint: Path
    step: int
    shapes: dict[str, list[int]]
    left_out: dict[str, str]


def torch_tensors(params: dict[str, np.ndarray], record: dict | None,
                  batches_tracked: int = 0) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The checkpoint's tensors under their torch state-dict names, and those left out with why.

    Args:
        params: The checkpoint's tensors by name.
        record: The run's configure record (configure.json).
        batches_tracked: Each BatchNorm's ``num_batches_tracked``: the micro-batches a rank trained.

    Raises:
        ExportError: A torch parameter configure recorded is missing from the checkpoint.
    """
    tensors, left = _named(params, record)
    return {**tensors, **_batches_tracked(tensors, batches_tracked)}, left


def _batches_tracked(tensors: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """``PREFIX.num_batches_tracked`` (int64, shape ``[]``, as torch's buffer) of every module with running statistics:
    no ONNX graph holds the count, and torch's state dict of a BatchNorm (and of an InstanceNorm that tracks its
    statistics) has it beside ``running_mean`` and ``running_var``."""
    suffix = ".running_mean"
    modules = [n[:-len(suffix)] for n in tensors if n.endswith(suffix) and f"{n[:-len(suffix)]}.running_var" in tensors]
    return {f"{m}.num_batches_tracked": np.array(count, dtype=np.int64) for m in modules
            if f"{m}.num_batches_tracked" not in tensors}


def _named(params: dict[str, np.ndarray], record: dict | None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """:func:`torch_tensors` without the BatchNorm counts."""
    torch = (record or {}).get("torch")
    if not torch:
        unnamed = sorted(n for n in (record or {}).get("trainable", []) if "::" in n)
        if unnamed:
            raise ExportError(f"{len(unnamed)} trained tensor(s) have no torch name ({', '.join(unnamed[:3])}"
                              f"{', ...' if len(unnamed) > 3 else ''}): the TorchScript exporter's constant folding "
                              "(do_constant_folding=True, its default) stored these weights transposed under computed "
                              "names, so no state dict holds them; re-export with torch.onnx.export(..., dynamo=False, "
                              "do_constant_folding=False), or with the dynamo exporter (docs/your-model.md)")
        kept = {n: v for n, v in params.items() if "::" not in n and v.dtype.kind == "f"}
        left = {n: "a tensor the TorchScript exporter computed, not a torch parameter" for n in params if n not in kept}
        for name, others in _torchscript_ties(record).items():
            if name in kept:
                kept.update({other: kept[name] for other in others})  # tied names: the same values under each
        return kept, left
    wanted = [*torch["parameters"], *torch.get("persistent_buffers", [])]
    missing = [n for n in wanted if n not in params]
    if missing:
        raise ExportError(f"the checkpoint lacks torch parameters {missing[:5]}; it is not this run's checkpoint")
    tensors = {n: params[n] for n in wanted}
    for name, others in torch.get("aliases", {}).items():
        tensors.update({other: params[name] for other in others})  # tied names: the same values under each
    left = {n: torch.get("frozen", {}).get(n, "not a torch parameter") for n in params if n not in tensors}
    return tensors, left


def _torchscript_ties(record: dict | None) -> dict[str, list[str]]:
    """Tied parameters' other names in the run's TorchScript export (none when the export is gone)."""
    path = Path((record or {}).get("model_path") or "")
    if not path.is_file():
        return {}
    return tied_names(onnx.load(str(path), load_external_data=False))


def _renamed(name: str, strip_prefix: str | None, add_prefix: str | None) -> str:
    if strip_prefix:
        if not name.startswith(strip_prefix):
            raise ExportError(f"--strip-prefix '{strip_prefix}': key '{name}' does not start with it; give the "
                              "prefix every key has (or none)")
        name = name[len(strip_prefix):]
    return f"{add_prefix or ''}{name}"


def export_state_dict(source: Path, out: Path, *, checkpoint: str | None = None, strip_prefix: str | None = None,
                      add_prefix: str | None = None, config: RunConfig | None = None) -> StateDictResult:
    """Write a run's parameters as a safetensors state dict under torch names.

    Args:
        source: A run folder or a checkpoint folder (as ``ortflow export``).
        out: The ``.safetensors`` file to write.
        checkpoint: For a run folder, which checkpoint (``best``, ``latest``, ``initial``, ``step-N``).
        strip_prefix: Removed from the start of every key (each must have it).
        add_prefix: Put before every key (after stripping).
        config: The run config, if the caller has it.

    Raises:
        ExportError: Nothing to export at ``source``, a prefix that does not fit, a missing parameter.
    """
    from safetensors.numpy import save_file

    found = resolve_source(Path(source), config=config, checkpoint=checkpoint)
    tensors, left = torch_tensors(load_parameters(found.checkpoint.path), found.record,
                                  found.checkpoint.micro_batches_per_rank)
    renamed = {_renamed(n, strip_prefix, add_prefix): np.asarray(v, order="C") for n, v in sorted(tensors.items())}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(renamed, str(tmp), metadata={"format": "pt", "ortflow.checkpoint": str(found.checkpoint.path),
                                           "ortflow.step": str(found.checkpoint.step)})
    tmp.replace(out)
    return StateDictResult(out, found.checkpoint.path, found.checkpoint.step,
                           {n: list(v.shape) for n, v in renamed.items()}, left)
