"""Float initializers that are not weights, which configure freezes even when ``model.frozen`` does not name them.

ortflow trains every float initializer by default. Some are not weights, and listed as trained parameters they stop
the engine's build with "failed to find NodeArg by name: <name>_grad" (measured with onnxruntime-training 1.19.2):

* BatchNormalization's running mean and variance. The engine trains BatchNormalization with the batch's statistics
  (its gradients match a training-mode reference), updates the running ones in place with the ONNX momentum rule, and
  the eval graph uses them, as torch's ``train()`` / ``eval()`` do. The trainer turns the variance update into torch's
  and gives every rank the same statistics before each eval and checkpoint (ortflow/trainer/batchnorm.py).
* constants that feed only inputs the engine does not differentiate: Dropout's ratio, Clip's bounds, Pad's value,
  Pow's exponent (the engine has no gradient for it), and any input of a node whose outputs are not floats
  (comparisons such as Greater). Exporters store such scalars as initializers.
* initializers nothing reads.
"""

from __future__ import annotations

import onnx

from ortflow.graph.onnx_tools import FLOAT_TYPES, elem_types, node_label, report_change, subgraph_reads

#: op type -> (positions of float inputs the engine does not differentiate, what they are).
NO_GRADIENT_INPUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "BatchNormalization": ((3, 4), "running statistic, updated by the engine while training"),
    "Dropout": ((1,), "Dropout ratio"),
    "Clip": ((1, 2), "Clip bound"),
    "Pad": ((2,), "Pad value"),
    "Pow": ((1,), "Pow exponent (the engine has no gradient for it)"),
    "Resize": ((1, 2), "Resize roi/scales"),
}


def _why_untrainable(node: onnx.NodeProto, slot: int, types: dict[str, int]) -> str | None:
    if node.domain in ("", "ai.onnx") and node.op_type in NO_GRADIENT_INPUTS:
        positions, what = NO_GRADIENT_INPUTS[node.op_type]
        if slot in positions:
            return what
    out_types = [types.get(o) for o in node.output if o]
    if out_types and all(t is not None and t not in FLOAT_TYPES for t in out_types):
        return f"input of {node.op_type}, whose outputs are not floats"
    return None


def untrainable_initializers(
    model: onnx.ModelProto, trainable: set[str], report: list[dict] | None = None
) -> list[str]:
    """Names of ``trainable`` initializers that must be frozen, sorted (see the module docstring for which).

    Args:
        model: The model (not changed).
        trainable: The parameters the config would train.
        report: When given, receives one entry naming each and why.

    Returns:
        The initializer names configure must freeze.
    """
    candidates = {t.name for t in model.graph.initializer} & trainable
    in_subgraphs = set().union(*(subgraph_reads(n) for n in model.graph.node)) if model.graph.node else set()
    types = elem_types(model)
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {name: [] for name in candidates}
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            if name in uses:
                uses[name].append((node, slot))
    outputs = {o.name for o in model.graph.output}
    changes, frozen = [], []
    for name in sorted(candidates - in_subgraphs - outputs):
        if not uses[name]:
            changes.append(f"'{name}' is read by no node")
            frozen.append(name)
            continue
        reasons = [_why_untrainable(node, slot, types) for node, slot in uses[name]]
        if all(reasons):
            node = uses[name][0][0]
            changes.append(f"'{name}' ({reasons[0]}, {node.op_type} '{node_label(node)}') is frozen")
            frozen.append(name)
    report_change("freeze_untrainable", changes, report)
    return frozen
