"""Initializers that are statistics, not weights: BatchNormalization's running mean and variance.

Measured with onnxruntime-training 1.19.2 on a BatchNormalization exported in inference mode (``torch.onnx.export``
of a model in ``eval()``): the engine's training graph normalises with the batch's statistics and its gradients match
a training-mode reference; each training step updates the running mean and variance in place (momentum), and the
eval graph uses them, as torch's ``train()`` / ``eval()`` do. Listed as trained parameters (ortflow's default trains
every float initializer) they stop the build ("failed to find NodeArg by name: <name>_grad"), so configure freezes
them. Each rank updates its own copy from its own batches, as torch's DistributedDataParallel without SyncBatchNorm
does; checkpoints hold rank 0's.
"""

from __future__ import annotations

import onnx

from ortflow.graph.common import node_label, report_change

#: op type -> positions of its inputs that hold running statistics.
STATISTICS_INPUTS: dict[str, tuple[int, ...]] = {"BatchNormalization": (3, 4)}


def statistics_buffers(model: onnx.ModelProto, trainable: set[str], report: list[dict] | None = None) -> list[str]:
    """Names of ``trainable`` initializers that default-domain nodes read as running statistics, sorted.

    Args:
        model: The model (not changed).
        trainable: The parameters the config would train.
        report: When given, receives one entry naming the ones to freeze.

    Returns:
        The initializer names configure must freeze.
    """
    initializers = {t.name for t in model.graph.initializer} & trainable
    found: dict[str, str] = {}
    for node in model.graph.node:
        positions = STATISTICS_INPUTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()
        for i in positions:
            if i < len(node.input) and node.input[i] in initializers:
                found.setdefault(node.input[i], f"{node.op_type} '{node_label(node)}'")
    changes = [f"'{name}' ({where}'s running statistic) is frozen; the engine updates it while training"
               for name, where in sorted(found.items())]
    report_change("freeze_statistics", changes, report)
    return sorted(found)
