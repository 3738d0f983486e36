"""Declare the optional outputs the engine's gradient builder reads.

``torch.onnx.export`` writes ``LayerNormalization`` with only ``Y``, ``Dropout`` with only ``output`` and
``SoftmaxCrossEntropyLoss`` (``F.cross_entropy`` inside the model) with only ``output``; the engine's gradients read
``Mean`` and ``InvStdDev``, ``mask`` and ``log_prob``, and without them it stops with
``GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size()`` (measured with onnxruntime-training
1.19.2). Declaring the outputs changes no value the model computes.
"""

from __future__ import annotations

import copy

import onnx

from ortflow.graph.onnx_tools import Names, node_label, report_change

#: op type -> names of its outputs, in order, for the ops whose optional outputs the gradient builder reads.
NEEDED_OUTPUTS: dict[str, tuple[str, ...]] = {
    "LayerNormalization": ("Y", "Mean", "InvStdDev"),
    "Dropout": ("output", "mask"),
    "SoftmaxCrossEntropyLoss": ("output", "log_prob"),
}


def declare_optional_outputs(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Give every LayerNormalization, Dropout and SoftmaxCrossEntropyLoss node (default domain) all its outputs.

    Missing or empty-named outputs get fresh names ``<node>.<Output>``; nothing reads them.

    Args:
        model: The model (left unchanged).
        report: When given, receives one entry describing the change.

    Returns:
        A new model with the outputs declared.
    """
    model = copy.deepcopy(model)
    names = Names(model.graph)
    changes = []
    for node in model.graph.node:
        wanted = NEEDED_OUTPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted is None:
            continue
        added = []
        outputs = list(node.output) + [""] * (len(wanted) - len(node.output))
        for i, output in enumerate(outputs):
            if not output:
                outputs[i] = names.new(f"{node_label(node)}.{wanted[i]}")
                added.append(wanted[i])
        if added:
            del node.output[:]
            node.output.extend(outputs)
            changes.append(f"{node.op_type} '{node_label(node)}' declares {', '.join(added)}")
    report_change("declare_optional_outputs", changes, report)
    return model
