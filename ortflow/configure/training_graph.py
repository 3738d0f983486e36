"""Rewrites of the engine's generated training model: run by configure after the engine wrote the artifacts.

For a dynamo export whose embeddings have torch's ``padding_idx``, every training model (the whole model's, each
pipeline stage's, each tensor-parallel piece's) gets :func:`ortflow.graph.gradients.padding_rows.mask_padding_rows`:
the lookup gives the padding row no gradient from the positions holding its id, as torch's does
(:func:`mask_padding_gradients`). The forward-once calls of a pipeline stage or piece build their gradient graph at
run time from the eval model: the stage's or piece's record names the padding rows its training model masks
(``padding_rows``; a piece's for each tensor-parallel rank), and the rank masks that gradient graph the same way
(:mod:`ortflow.trainer.parallel.kept_activations`).

The passes in :mod:`ortflow.graph` rewrite the user's model before the engine sees it; some costs only show in what
the engine generates (its gradient ops). Two such passes, both for GPU runs:
:func:`ortflow.graph.gradients.leading_sums.sums_as_matmul`, with ``distributed.deterministic_compute`` (the
engine's deterministic CUDA ReduceSum is slow; a MatMul with a ones vector gives the same sums, deterministically,
through cuBLAS), on every training model (the whole model's, each stage's, each piece's: the stage's or piece's
record says so with ``sums_as_matmul``, and the rank rewrites its forward-once gradient graph the same way), and
:func:`ortflow.graph.capture.split_for_capture`, with ``distributed.cuda_graphs``: the whole model's training graph cut
into the part the CUDA provider records and replays and the part it cannot record, written beside it
(:data:`~ortflow.artifacts_folder.CAPTURE_HEAD`, :data:`~ortflow.artifacts_folder.CAPTURE_TAIL`). The eval model is
left as it is; the checkpoint and every parameter and gradient name are unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from ortflow.artifacts_folder import CAPTURE_HEAD, CAPTURE_TAIL
from ortflow.config import RunConfig
from ortflow.graph.capture import split_for_capture
from ortflow.graph.exports.torch_params import is_dynamo_export, padding_rows
from ortflow.graph.gradients.leading_sums import LeadingSumReport, sums_as_matmul
from ortflow.graph.gradients.padding_rows import mask_padding_rows

log = logging.getLogger(__name__)


def sums_as_matmul_applies(cfg: RunConfig) -> bool:
    """Whether configure rewrites the training model's leading-axis sums: ``device: cuda`` with
    ``deterministic_compute`` and ``reduce_sum_as_matmul`` (the opt-out). Without deterministic compute the engine's
    own ReduceSum takes its fast path, and the CPU has no such gap."""
    dist = cfg.distributed
    return dist.device == "cuda" and dist.deterministic_compute and dist.reduce_sum_as_matmul


def capture_applies(cfg: RunConfig) -> bool:
    """Whether configure cuts the training graph for CUDA graph capture: ``device: cuda`` with ``cuda_graphs``, for a
    whole model (pipeline stages and tensor-parallel pieces run their calls as before)."""
    dist = cfg.distributed
    return (dist.device == "cuda" and dist.cuda_graphs and dist.pipeline_parallel_size == 1
            and dist.horizontal_parallel_size == 1)


def rewrite_training_model(cfg: RunConfig, path: Path) -> list[dict]:
    """Apply the training-model passes that ``cfg`` asks for to ``path`` in place; returns their report entries.

    External data (a model over 2 GB) is neither loaded nor rewritten: the passes add nodes and small constants only,
    and the tensors keep their references to the data file beside ``path``.
    """
    report = mask_padding_gradients(path, torch_padding_rows(cfg))
    if not (sums_as_matmul_applies(cfg) or capture_applies(cfg)):
        return report
    model = onnx.load(str(path), load_external_data=False)
    if sums_as_matmul_applies(cfg):
        model = _sums_as_matmul(model, path, report)
    if capture_applies(cfg):
        _write_capture_split(model, path.parent)
    return report


def rewrite_part_training_model(cfg: RunConfig, path: Path, rows: dict[str, int],
                                where: str) -> tuple[dict[str, int], list[dict]]:
    """Apply the training-model passes of a pipeline stage or tensor-parallel piece to its training model at ``path``
    in place: the padding rows' mask (``rows``, :func:`mask_padding_gradients`) and, where
    :func:`sums_as_matmul_applies`, the leading-axis sums as MatMuls (logged as the whole model's, naming ``where``,
    e.g. "pipeline stage 0"). The forward-once gradient graph the rank builds from the part's eval model gets the same
    passes (its record's ``padding_rows`` and ``sums_as_matmul``: :mod:`ortflow.trainer.parallel.kept_activations`).

    Returns:
        The padding rows its training model masks (empty where it masks none) and the passes' report entries.
    """
    report = mask_padding_gradients(path, rows)
    masked = rows if report else {}
    if sums_as_matmul_applies(cfg):
        _sums_as_matmul(onnx.load(str(path), load_external_data=False), path, report, f"training graph of {where}")
    return masked, report


def torch_padding_rows(cfg: RunConfig) -> dict[str, int]:
    """Table -> torch's ``padding_idx`` of the embeddings of ``model.path`` where the dynamo exporter recorded it
    (:func:`ortflow.graph.exports.torch_params.padding_rows`); empty for other exports, which do not record it."""
    proto = onnx.load(str(cfg.model.path), load_external_data=False)
    return padding_rows(proto.graph) if is_dynamo_export(proto) else {}


def mask_padding_gradients(path: Path, rows: dict[str, int]) -> list[dict]:
    """Apply :func:`~ortflow.graph.gradients.padding_rows.mask_padding_rows` to the training model at ``path`` in
    place (``rows``: table -> padding row in that graph's table); returns its report entries. Warns for each trained
    lookup of a padding table whose gradient it does not recognise (that lookup trains the row as the engine wrote)."""
    report: list[dict] = []
    if not rows:
        return report
    model = onnx.load(str(path), load_external_data=False)
    model, unmasked = mask_padding_rows(model, rows, report)
    for line in unmasked:
        log.warning("training graph: the gradient of %s is not one this pass knows; ids equal to torch's padding_idx "
                    "give the padding row a gradient there where torch gives it none", line)
    if report:
        onnx.save(model, str(path))
    return report


def _sums_as_matmul(model: onnx.ModelProto, path: Path, report: list[dict],
                    what: str = "training graph") -> onnx.ModelProto:
    details = LeadingSumReport()
    model = sums_as_matmul(model, report, details)
    log.info("%s: %s", what, details.line())
    if details.rewritten:
        onnx.save(model, str(path))
    return model


def _write_capture_split(model: onnx.ModelProto, folder: Path) -> None:
    try:
        split = split_for_capture(model)
    except ValueError as err:  # random operators: the rank launches every kernel (no head file)
        log.info("training graph: trains without CUDA graphs (distributed.cuda_graphs): %s", err)
        return
    onnx.save(split.head, str(folder / CAPTURE_HEAD))
    if split.tail is not None:
        onnx.save(split.tail, str(folder / CAPTURE_TAIL))
    tail = len(split.tail.graph.node) if split.tail is not None else 0
    log.info("training graph: cut for CUDA graphs, %d node(s) recorded, %d after the replay (%s), %d tensor(s) "
             "between", len(split.head.graph.node), tail, ", ".join(sorted({n.op_type for n in split.tail.graph.node}))
             if tail else "none", len(split.boundary))  # fmt: skip
