"""Where a model's BatchNormalization running statistics are, and how many values each batch statistic averages.

The trainer corrects the engine's running-variance update to torch's rule and makes the ranks' statistics equal
(ortflow/trainer/batchnorm.py); both need, per BatchNormalization node that reads its running statistics from
initializers: their names, the ONNX momentum, and the values per channel one row contributes (the product of the
input's dims after the channel dim, from ONNX shape inference). configure records them in configure.json
(``batchnorm``), so the ranks never load the model for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import infer_shapes


@dataclass(frozen=True)
class RunningStatistics:
    """One BatchNormalization's running statistics.

    Attributes:
        node: The node's name (for messages).
        mean: Initializer name of the running mean.
        var: Initializer name of the running variance.
        momentum: ONNX momentum ``m``: ``running = m * running + (1 - m) * batch statistic`` (torch's is ``1 - m``).
        per_row: Values per channel that one row contributes (the product of the input's dims after the channel
            dim; 1 for ``[N, C]``), or None when shape inference leaves one of them unknown.
    """

    node: str
    mean: str
    var: str
    momentum: float
    per_row: int | None


def running_statistics(model: onnx.ModelProto | Path | str) -> list[RunningStatistics]:
    """Every BatchNormalization whose running mean and variance are initializers, in graph order."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
             and len(n.input) >= 5 and n.input[3] in inits and n.input[4] in inits]
    if not nodes:
        return []
    inferred = infer_shapes(model)
    shapes = {v.name: v.type.tensor_type.shape for v in
              [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    found = []
    for node in nodes:
        momentum = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "momentum"), 0.9)
        shape = shapes.get(node.input[0])
        per_row = None
        if shape is not None and len(shape.dim) >= 2:
            rest = shape.dim[2:]
            if all(d.HasField("dim_value") for d in rest):
                per_row = 1
                for d in rest:
                    per_row *= d.dim_value
        found.append(RunningStatistics(node.name or node.output[0], node.input[3], node.input[4], float(momentum),
                                       per_row))
    return found


def to_record(layers: list[RunningStatistics]) -> list[dict]:
    """JSON-ready form for configure.json."""
    return [asdict(layer) for layer in layers]


def from_record(items: list[dict]) -> list[RunningStatistics]:
    """The layers from configure.json's ``batchnorm`` list."""
    return [RunningStatistics(**item) for item in items]
