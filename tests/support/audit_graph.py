"""One tiny branch per op variant torch.onnx.export writes, for the gradient audit (tests/graph/test_gradient_audit.py).

Every case is a function ``(b: Branch) -> tensor``: it builds its op on activations made from the model input by a
trained MatMul (``b.act``) or on trained parameters (``b.param``), and returns the op's output. :func:`build_model`
gives each case a trained head (``Reshape [B, -1]`` then ``MatMul [k, C]``) and sums the heads into ``logits``, so
many cases share one configure while each case's gradients still belong to its own parameters (named ``case.*``).
Values are drawn away from the points where an op is not differentiable (Relu/Abs at 0, Clip at its bounds, ties).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

BATCH, FEATURES, CLASSES = 4, 6, 3


class Branch:
    """Nodes and initializers of one case; every name starts with the case name."""

    def __init__(self, name: str, rng: np.random.Generator):
        self.name, self.rng = name, rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def _next(self, kind: str) -> str:
        self._count += 1
        return f"{self.name}/{kind}_{self._count}"

    def param(self, shape: tuple[int, ...], std: float = 0.5, offset: float = 0.0, value=None) -> str:
        name = f"{self.name}.p{self._count}"
        self._count += 1
        data = self.rng.standard_normal(shape) * std + offset if value is None else value
        self.inits.append(numpy_helper.from_array(np.asarray(data, np.float32), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        name = self._next("Constant")
        tensor = numpy_helper.from_array(np.asarray(value, dtype), name)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, **attrs) -> str | list[str]:
        base = self._next(op_type)
        outputs = [f"{base}_out{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=base, **attrs))
        return outputs[0] if num_outputs == 1 else outputs

    def act(self, shape: tuple[int, ...], scale: float = 1.0, offset: float = 0.0) -> str:
        """``x @ P`` (P trained) reshaped to ``shape`` (its size a multiple of the batch), values ~N(offset, scale)."""
        size = math.prod(shape)
        assert size % BATCH == 0, shape
        w = self.param((FEATURES, size // BATCH), std=scale / math.sqrt(FEATURES))
        out = self.op("Reshape", [self.op("MatMul", ["x", w]), self.const(list(shape))])
        return self.op("Add", [out, self.const(offset, np.float32)]) if offset else out


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Branch], str]
    opset: int = 17


def _branch_nodes(case: Case, rng: np.random.Generator, opset: int, count: int) -> tuple[Branch, str]:
    """The case's nodes plus its head; returns the branch and its contribution to the logits ([B, C]).

    Heads are scaled by 1/sqrt(count), so the summed logits stay O(1) however many cases share the model: with
    ~100 O(1) contributions the softmax saturates (logits of +-20), the loss is ~20 and the float64 differences of
    a branch with small gradients lose their precision (measured: 1e-4 of its largest gradient)."""
    b = Branch(case.name, rng)
    out = case.build(b)
    flat = b.op("Reshape", [out, b.const([BATCH, -1])])
    width = _width(b, flat, opset)
    head = b.param((width, CLASSES), std=1.0 / math.sqrt(width * count))
    return b, b.op("MatMul", [flat, head])


def _width(b: Branch, flat: str, opset: int) -> int:
    graph = helper.make_graph(b.nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                [BATCH, FEATURES])],
                              [helper.make_tensor_value_info(flat, TensorProto.FLOAT, None)], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    x = np.zeros((BATCH, FEATURES), np.float32)
    # onnxruntime first: the ReferenceEvaluator's Resize takes seconds. ONNX Runtime's reductions with
    # noop_with_empty_axes=1 and no axes crash (inference too), so the ReferenceEvaluator runs those.
    try:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 4  # its failure is expected here, not an error to print
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        out = session.run([flat], {"x": x})[0]
    except Exception:  # noqa: BLE001
        out = ReferenceEvaluator(model).run([flat], {"x": x})[0]
    return int(out.shape[1])


def _model(nodes, inits, output: str, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "main_graph",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, FEATURES])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, [BATCH, CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="pytorch")
    model.ir_version = 8 if opset < 19 else 9
    return model


def build_model(path: Path, cases: list[Case], seed: int = 0) -> tuple[Path, dict[str, onnx.ModelProto]]:
    """The model of all ``cases`` (logits = sum of their heads) and, per case, a model of its branch alone whose
    output is that branch's contribution (for the float64 reference)."""
    opset = max(c.opset for c in cases)
    rng = np.random.default_rng(seed)
    nodes, inits, branches, total = [], [], {}, None
    for case in cases:
        b, contribution = _branch_nodes(case, rng, opset, len(cases))
        branch_out = f"{case.name}/contribution"
        own = [*b.nodes, helper.make_node("Identity", [contribution], [branch_out], name=f"{case.name}/Identity")]
        branches[case.name] = _model(own, b.inits, branch_out, opset)
        nodes.extend(b.nodes)
        inits.extend(b.inits)
        if total is None:
            total = contribution
        else:
            summed = f"{case.name}/Add_logits"
            nodes.append(helper.make_node("Add", [total, contribution], [summed], name=summed))
            total = summed
    nodes.append(helper.make_node("Identity", [total], ["logits"], name="/Identity_logits"))
    model = _model(nodes, inits, "logits", opset)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path, branches
