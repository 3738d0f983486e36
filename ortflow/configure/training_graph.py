"""Rewrites of the engine's generated training model: run by configure after the engine wrote the artifacts.

The passes in :mod:`ortflow.graph` rewrite the user's model before the engine sees it; some costs only show in what
the engine generates (its gradient ops). One such pass so far:
:func:`ortflow.graph.gradients.leading_sums.sums_as_matmul`, on GPU runs with ``distributed.deterministic_compute`` (the
engine's deterministic CUDA ReduceSum is slow; a MatMul with a ones vector gives the same sums, deterministically,
through cuBLAS). The eval model has no gradient sums and is left as it is; the checkpoint and every parameter and
gradient name are unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from ortflow.config import RunConfig
from ortflow.graph.gradients.leading_sums import LeadingSumReport, sums_as_matmul

log = logging.getLogger(__name__)


def sums_as_matmul_applies(cfg: RunConfig) -> bool:
    """Whether configure rewrites the training model's leading-axis sums: ``device: cuda`` with
    ``deterministic_compute`` and ``reduce_sum_as_matmul`` (the opt-out). Without deterministic compute the engine's
    own ReduceSum takes its fast path, and the CPU has no such gap."""
    dist = cfg.distributed
    return dist.device == "cuda" and dist.deterministic_compute and dist.reduce_sum_as_matmul


def rewrite_training_model(cfg: RunConfig, path: Path) -> list[dict]:
    """Apply the training-model passes that ``cfg`` asks for to ``path`` in place; returns their report entries.

    External data (a model over 2 GB) is neither loaded nor rewritten: the passes add nodes and small constants only,
    and the tensors keep their references to the data file beside ``path``.
    """
    if not sums_as_matmul_applies(cfg):
        return []
    model = onnx.load(str(path), load_external_data=False)
    report: list[dict] = []
    details = LeadingSumReport()
    model = sums_as_matmul(model, report, details)
    total = len(details.rewritten) + len(details.kept)
    log.info("training graph: %d of %d ReduceSum node(s) rewritten as MatMul with ones (distributed."
             "reduce_sum_as_matmul; %d kept)", len(details.rewritten), total, len(details.kept))  # fmt: skip
    if details.rewritten:
        onnx.save(model, str(path))
    return report
