"""A pipeline stage's forward pass with BatchNorm normalising by the batch, as its training call does.

A middle pipeline stage computes what it sends with its eval model, then recomputes that forward inside the training
call (parallel/schedule.py). The engine's eval model normalises every ``BatchNormalization`` with the running
statistics (torch's ``model.eval()``), while the training call normalises with the micro-batch's own (torch's
``model.train()``): sent as they are, a stage's activations would differ from the ones its own backward pass and the
unsplit model compute. This pass gives each such node a twin that normalises by the batch, the engine's own
``com.microsoft.BatchNormInternal`` (the kernel its training graphs run, on CPU and CUDA; the CUDA provider has no ONNX
training-mode BatchNormalization at opset >= 14), and a bool scalar graph input that picks the twin's output: true
for the forward passes of training micro-batches, false for evaluation.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

MS_DOMAIN = "com.microsoft"
#: The engine's training form of BatchNormalization (what its training graphs run).
TRAINING_FORM = "BatchNormInternal"


def _inference_batchnorms(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    def training(node: onnx.NodeProto) -> bool:
        return any(a.name == "training_mode" and a.i for a in node.attribute)

    return [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
            and not training(n) and len([o for o in n.output if o]) == 1]  # fmt: skip


def switch_to_batch_statistics(model: onnx.ModelProto, flag: str) -> list[str]:
    """In place: every inference-mode BatchNormalization's output becomes ``Where(flag, training-form twin,
    running-statistics form)``, ``flag`` a new bool scalar input. Returns the nodes switched (none: unchanged)."""
    graph = model.graph
    nodes = _inference_batchnorms(graph)
    if not nodes:
        return []
    order = list(graph.node)
    for node in nodes:
        out = node.output[0]
        running, batch = f"{out}.running_statistics", f"{out}.batch_statistics"
        # A training-mode BatchNorm may write its running-statistics outputs into its mean and variance inputs' buffers
        # (the engine's CPU kernel for ONNX's training mode did, measured): the twin reads fresh zeros instead, so a
        # forward pass never moves the stage's running statistics (its training call updates them, once per
        # micro-batch). Nothing reads the twin's other outputs.
        scale = node.input[1]
        zeros = [f"{out}.zeros_{i}" for i in (0, 1)]
        fresh = [helper.make_node("Sub", [scale, scale], [z], name=f"{node.name}.{z.rsplit('.', 1)[1]}") for z in zeros]
        unused = [f"{out}.unused_{what}" for what in ("mean", "var", "saved_mean", "saved_inv_std")]
        twin = helper.make_node(TRAINING_FORM, [node.input[0], scale, node.input[2], *zeros], [batch, *unused],
                                name=f"{node.name}.batch_statistics", domain=MS_DOMAIN)  # fmt: skip
        twin.attribute.extend(a for a in node.attribute if a.name in ("epsilon", "momentum"))
        twin.attribute.append(helper.make_attribute("training_mode", 1))
        pick = helper.make_node("Where", [flag, batch, running], [out], name=f"{node.name}.pick")
        node.output[0] = running
        at = order.index(node) + 1
        order[at:at] = [*fresh, twin, pick]
    del graph.node[:]
    graph.node.extend(order)
    graph.input.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, []))
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return [n.name for n in nodes]
