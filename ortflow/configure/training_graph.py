"""Rewrites of the engine's generated training model: run by configure after the engine wrote the artifacts.

The passes in :mod:`ortflow.graph` rewrite the user's model before the engine sees it; some costs only show in what
the engine generates (its gradient ops). Two such passes, both for GPU runs:
:func:`ortflow.graph.gradients.leading_sums.sums_as_matmul`, with ``distributed.deterministic_compute`` (the
engine's deterministic CUDA ReduceSum is slow; a MatMul with a ones vector gives the same sums, deterministically,
through cuBLAS), and :func:`ortflow.graph.capture.split_for_capture`, with ``distributed.cuda_graphs``: the training
graph cut into the part the CUDA provider records and replays and the part it cannot record, written beside it
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
from ortflow.graph.gradients.leading_sums import LeadingSumReport, sums_as_matmul

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
    report: list[dict] = []
    if not (sums_as_matmul_applies(cfg) or capture_applies(cfg)):
        return report
    model = onnx.load(str(path), load_external_data=False)
    if sums_as_matmul_applies(cfg):
        model = _sums_as_matmul(model, path, report)
    if capture_applies(cfg):
        _write_capture_split(model, path.parent)
    return report


def _sums_as_matmul(model: onnx.ModelProto, path: Path, report: list[dict]) -> onnx.ModelProto:
    details = LeadingSumReport()
    model = sums_as_matmul(model, report, details)
    total = len(details.rewritten) + len(details.kept)
    log.info("training graph: %d of %d ReduceSum node(s) rewritten as MatMul with ones (distributed."
             "reduce_sum_as_matmul; %d kept)", len(details.rewritten), total, len(details.kept))  # fmt: skip
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
