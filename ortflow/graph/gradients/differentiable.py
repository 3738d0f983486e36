"""Find, before the engine runs, the nodes whose gradient onnxruntime-training 1.19.2 cannot build.

Only nodes on the trained path count: some float input depends on a trained parameter and some output reaches the
loss. An op without a gradient on inputs or frozen parameters alone is fine (the engine does not differentiate it).
The op list below was measured by building artifacts for a one-node model per op (see tests/graph/); the engine's own
failure for anything not listed is turned into the same kind of message by :func:`explain_engine_error`.
"""

from __future__ import annotations

import re

import onnx

from ortflow.graph.onnx_tools import FLOAT_TYPES, GraphError, elem_types, node_label

_ZERO_GRADIENT = ("its gradient is zero almost everywhere: compute it from values that need no gradient (model "
                  "inputs, frozen parameters) or remove it from the trained path")
_NO_SUBSTITUTE = "no exact substitute among the ops the engine differentiates: remove it from the trained path"

#: Default-domain ops the engine has no gradient for, with what to write instead.
NO_GRADIENT: dict[str, str] = {
    "Elu": "write it as Where(x > 0, x, alpha * (Exp(x) - 1))",
    "Selu": "write it as gamma * Where(x > 0, x, alpha * (Exp(x) - 1))",
    "Celu": "write it as Max(x, 0) + Min(0, alpha * (Exp(x / alpha) - 1))",
    "Softplus": "write it as Relu(x) + Log(1 + Exp(-Abs(x)))",
    "Softsign": "write it as x / (1 + Abs(x))",
    "HardSigmoid": "write it as Clip(alpha * x + beta, 0, 1)",
    "HardSwish": "write it as x * Clip(x / 6 + 0.5, 0, 1)",
    "Mish": "write it as x * Tanh(Relu(x) + Log(1 + Exp(-Abs(x))))",
    "ThresholdedRelu": "write it as Where(x > alpha, x, 0)",
    "Shrink": "write it as Where(x < -lambd, x + bias, Where(x > lambd, x - bias, 0))",
    "PRelu": "write it as Max(x, 0) + slope * Min(x, 0)",
    "Sinh": "write it as (Exp(x) - Exp(-x)) / 2",
    "Cosh": "write it as (Exp(x) + Exp(-x)) / 2",
    "Tan": "write it as Sin(x) / Cos(x)",
    "Atan": _NO_SUBSTITUTE,
    "Asin": _NO_SUBSTITUTE,
    "Acos": _NO_SUBSTITUTE,
    "Sign": _ZERO_GRADIENT,
    "Round": _ZERO_GRADIENT,
    "Floor": _ZERO_GRADIENT,
    "Ceil": _ZERO_GRADIENT,
    "Mod": _ZERO_GRADIENT,
    "ReduceMax": "use TopK(k=1) along the axis (its values), or Softmax/LogSoftmax directly if it only stabilises one",
    "ReduceMin": "use TopK(k=1, largest=0) along the axis (its values)",
    "GlobalMaxPool": "use MaxPool with kernel_shape equal to the spatial size",
    "ReduceProd": "write it as Exp(ReduceSum(Log(x))) for positive x",
    "ReduceL1": "write it as ReduceSum(Abs(x))",
    "ReduceSumSquare": "write it as ReduceSum(x * x)",
    "CumSum": "write it as a MatMul with a triangular matrix of ones (Trilu of ones)",
    "Einsum": "write it as the equivalent MatMul / Transpose / Reshape (torch: use matmul instead of einsum)",
    "InstanceNormalization": "write it with ReduceMean, Sub, Mul, Sqrt and Div, then scale and bias",
    "LpNormalization": "write it as x / ReduceL2(x, keepdims=1) (p=2) or x / ReduceSum(Abs(x), keepdims=1) (p=1)",
    "LRN": _NO_SUBSTITUTE,
    "GroupNormalization": "Reshape to [N, groups, -1], LayerNormalization (axis=-1, all outputs), Reshape back, then "
                          "scale and bias",
}
#: Reductions whose gradient the engine builds wrongly (an invalid Unsqueeze) when keepdims=0.
_KEEPDIMS_BROKEN = frozenset({"ReduceL2", "ReduceLogSumExp"})
#: Ops whose gradient kernel the CPU engine (onnxruntime-training-cpu) lacks: the training session fails to start
#: ("Could not find an implementation for ...Grad"). The CUDA engine has them, so these are refused only without it.
_NO_CPU_GRADIENT_KERNEL: dict[str, str] = {
    "ConvTranspose": "the CPU engine has no ConvTransposeGrad kernel: write it as a Conv over the input "
                     "interleaved with zeros, or train on a GPU (the CUDA engine has it)",
    "Resize": "the CPU engine has no ResizeGrad kernel: for nearest upsampling by an integer factor use "
              "Unsqueeze + Expand + Reshape (or Tile), or train on a GPU (the CUDA engine has it)",
}
_CONTRIB_NO_GRADIENT = {"SimplifiedLayerNormalization": "use LayerNormalization (with all three outputs)"}
_MAX_NAMES = 8


def _upstream_params(model: onnx.ModelProto, names: list[str], trainable: set[str]) -> list[str]:
    producer = {out: node for node in model.graph.node for out in node.output}
    found, stack, seen = set(), list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in trainable:
            found.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(n for n in node.input if n)
    return sorted(found)


def trained_path(model: onnx.ModelProto, trainable: set[str], loss_inputs: list[str]) -> list[onnx.NodeProto]:
    """Nodes the engine must differentiate: a float input depends on ``trainable`` and an output reaches the loss."""
    types = elem_types(model)
    tainted = set(trainable)
    for node in model.graph.node:
        if any(n in tainted for n in node.input):
            tainted.update(o for o in node.output if types.get(o, onnx.TensorProto.FLOAT) in FLOAT_TYPES)
    producer = {out: node for node in model.graph.node for out in node.output}
    reaching, stack = set(), list(loss_inputs)
    while stack:
        name = stack.pop()
        if name in reaching:
            continue
        reaching.add(name)
        if name in producer:
            stack.extend(n for n in producer[name].input if n)
    return [n for n in model.graph.node if any(o in reaching for o in n.output)
            and any(i in tainted and types.get(i, onnx.TensorProto.FLOAT) in FLOAT_TYPES for i in n.input)]


def _problem(model: onnx.ModelProto, node: onnx.NodeProto, why: str, trainable: set[str]) -> str:
    upstream = _upstream_params(model, [n for n in node.input if n], trainable)
    text = f"node '{node_label(node)}' (op {node.op_type}) is on the trained path but {why}"
    if upstream and len(upstream) < len(trainable):
        shown = ", ".join(upstream[:_MAX_NAMES]) + (", ..." if len(upstream) > _MAX_NAMES else "")
        text += f"; or freeze the parameters that feed it (model.frozen: [{shown}])"
    return text


def check_differentiable(model: onnx.ModelProto, trainable: set[str], loss_inputs: list[str]) -> None:
    """Raise one error listing every node on the trained path whose gradient the engine cannot build.

    Args:
        model: The prepared model.
        trainable: Names of the trained parameters.
        loss_inputs: The tensors the loss reads (the model output, or the flattened scores).

    Raises:
        GraphError: Naming each node, its op and a fix.
    """
    problems = []
    for node in trained_path(model, trainable, loss_inputs):
        fix = None
        if node.domain in ("", "ai.onnx"):
            if node.op_type in NO_GRADIENT:
                fix = f"the engine has no gradient for {node.op_type}: {NO_GRADIENT[node.op_type]}"
            elif node.op_type == "Pow" and _upstream_params(model, node.input[1:2], trainable):
                fix = ("the engine has no gradient for Pow's exponent: keep the exponent constant or write "
                       "Exp(y * Log(x))")
            elif node.op_type == "BatchNormalization" and _attr_int(node, "training_mode") == 1:
                fix = ("the engine cannot train BatchNormalization(training_mode=1) whose running-statistics outputs "
                       "are read (its eval graph does not load): export the model in eval mode (torch: model.eval() "
                       "before torch.onnx.export; the engine still trains with batch statistics and updates the "
                       "running ones), or read nothing from outputs 1 and 2")
            elif node.op_type == "Pad":
                fix = _pad_problem(node)
            elif node.op_type in _NO_CPU_GRADIENT_KERNEL and not _cuda_engine():
                fix = _NO_CPU_GRADIENT_KERNEL[node.op_type]
            elif node.op_type in _KEEPDIMS_BROKEN and _keepdims(node) == 0:
                fix = (f"the engine builds an invalid gradient for {node.op_type} with keepdims=0: use keepdims=1 "
                       "followed by Squeeze")
        elif node.op_type in _CONTRIB_NO_GRADIENT:
            fix = f"the engine has no gradient for {node.op_type}: {_CONTRIB_NO_GRADIENT[node.op_type]}"
        if fix is not None:
            problems.append(_problem(model, node, fix, trainable))
    if problems:
        raise GraphError("model.path: the engine cannot differentiate this model:\n  - " + "\n  - ".join(problems))


def _pad_problem(node: onnx.NodeProto) -> str | None:
    mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "constant")
    if mode != "constant":
        return (f"the engine's Pad gradient supports constant mode only, not mode={mode!r}: write it with Slice and "
                "Concat (reflect: the reversed border Slices; edge: the border Slice repeated with Expand)")
    if len(node.input) > 3 and node.input[3]:
        return ("the engine builds an invalid gradient for Pad with an axes input (opset 18): give pads for every "
                "axis and no axes input (torch: export with opset 17, or pad every dim)")
    return None


def _cuda_engine() -> bool:
    """Whether the installed engine is the CUDA build (it has the gradient kernels the CPU build lacks)."""
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _attr_int(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _keepdims(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "keepdims"), 1)


_NOT_REGISTERED = re.compile(r"gradient builder has not been registered: (\S+) for node (\S*)")
_NO_GRADIENT_ARG = re.compile(r"failed to find NodeArg by name: (\S+)_grad\b")


def explain_engine_error(message: str, model: onnx.ModelProto, trainable: set[str]) -> str | None:
    """A message naming node, op and fix for an engine failure this module recognises, else None."""
    match = _NOT_REGISTERED.search(message)
    if match:
        op_type, name = match.group(1), match.group(2)
        node = next((n for n in model.graph.node if name and name in (n.name, *n.output)), None)
        if node is None:
            node = next((n for n in model.graph.node if n.op_type == op_type), None)
        why = f"the engine has no gradient for {op_type}: " + NO_GRADIENT.get(
            op_type, "replace it by ops the engine differentiates")
        if node is not None:
            return _problem(model, node, why, trainable)
        return f"an {op_type} node is on the trained path but {why}"
    match = _NO_GRADIENT_ARG.search(message)
    if match and match.group(1) in trainable:
        name = match.group(1)
        readers = [f"{node_label(n)} ({n.op_type}) input {list(n.input).index(name)}"
                   for n in model.graph.node if name in n.input]
        return (f"parameter '{name}' gets no gradient: it feeds only inputs the engine does not differentiate "
                f"({'; '.join(readers[:_MAX_NAMES]) or 'no node'}); freeze it: model.frozen: [{name}]")
    if "OutputDefs().size()" in message:
        return ("a node on the trained path lacks an optional output that its gradient reads (ortflow declares them "
                "for LayerNormalization and Dropout); declare all of the node's outputs in the model")
    return None
