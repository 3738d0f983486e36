"""A pipeline stage's forward pass with BatchNorm normalising by the batch, as its training call does.

A middle pipeline stage computes what it sends with its eval model, then recomputes that forward inside the training
call (parallel/schedule.py). The engine's eval model normalises every ``BatchNormalization`` with the running
statistics (torch's ``model.eval()``), while the training call normalises with the micro-batch's own (torch's
``model.train()``): sent as they are, a stage's activations would differ from the ones its own backward pass and the
unsplit model compute. This pass gives each such node a training-mode twin (the batch's statistics, no running
statistics written: the training call updates those once per micro-batch) and a bool scalar graph input that picks
the twin's output: true for the forward passes of training micro-batches, false for evaluation.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ortflow.graph.onnx_tools import GraphError

_MIN_OPSET = 14  # BatchNormalization's training_mode attribute


def _opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _inference_batchnorms(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    def training(node: onnx.NodeProto) -> bool:
        return any(a.name == "training_mode" and a.i for a in node.attribute)

    return [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
            and not training(n) and len([o for o in n.output if o]) == 1]  # fmt: skip


def batch_statistics_problem(model: onnx.ModelProto) -> str | None:
    """Why :func:`switch_to_batch_statistics` would refuse ``model`` (a stage's forward graph), or None."""
    nodes = _inference_batchnorms(model.graph)
    if nodes and _opset(model) < _MIN_OPSET:
        return (f"BatchNormalization '{nodes[0].name}' in a pipeline stage before the last needs opset >= "
                f"{_MIN_OPSET} (the model has {_opset(model)}): re-export with opset_version={_MIN_OPSET} or later, "
                "or cut the model after its last BatchNorm (model.pipeline_cuts)")
    return None


def switch_to_batch_statistics(model: onnx.ModelProto, flag: str) -> list[str]:
    """In place: every inference-mode BatchNormalization's output becomes ``Where(flag, training-mode twin,
    running-statistics form)``, ``flag`` a new bool scalar input. Returns the nodes switched (none: unchanged).

    Raises:
        GraphError: The model's opset predates BatchNormalization's training mode (14).
    """
    graph = model.graph
    nodes = _inference_batchnorms(graph)
    if not nodes:
        return []
    problem = batch_statistics_problem(model)
    if problem:
        raise GraphError(problem)
    order = list(graph.node)
    for node in nodes:
        out = node.output[0]
        running, batch = f"{out}.running_statistics", f"{out}.batch_statistics"
        # Training mode writes running statistics into outputs that the engine aliases to the mean and variance
        # inputs (updated in place): the twin reads fresh zeros instead, so the running statistics stay the training
        # call's. Its own outputs, which ONNX requires in training mode, are read by nothing; its normalisation uses
        # the batch's statistics only.
        scale = node.input[1]
        zeros = [f"{out}.zeros_{i}" for i in (0, 1)]
        fresh = [helper.make_node("Sub", [scale, scale], [z], name=f"{node.name}.{z.rsplit('.', 1)[1]}") for z in zeros]
        twin = helper.make_node("BatchNormalization", [node.input[0], scale, node.input[2], *zeros],
                                [batch, f"{out}.unused_mean", f"{out}.unused_var"],
                                name=f"{node.name}.batch_statistics")  # fmt: skip
        twin.attribute.extend(a for a in node.attribute if a.name != "training_mode")
        twin.attribute.append(helper.make_attribute("training_mode", 1))
        pick = helper.make_node("Where", [flag, batch, running], [out], name=f"{node.name}.pick")
        node.output[0] = running
        at = order.index(node) + 1
        order[at:at] = [*fresh, twin, pick]
    del graph.node[:]
    graph.node.extend(order)
    graph.input.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, []))
    return [n.name for n in nodes]
