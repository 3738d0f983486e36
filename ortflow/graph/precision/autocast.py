"""Mixed precision as a graph rewrite: fp32 master weights, fp16/bf16 activations, sensitive ops kept in fp32.

:func:`autocast` walks the graph once, in order, and tracks for every float tensor which precisions it is available
in. Each node is one of:

* **low** (most ops): its fp32 inputs are read in the compute type and its fp32 outputs become the compute type;
* **fp32** (``fp32_ops``: LayerNormalization, Softmax, the reductions, losses; ops with subgraphs; ops outside the
  standard and ``com.microsoft`` domains; ops whose output type is fixed by an attribute; ops whose ONNX schema at
  the model's opset has no such type, e.g. RoPE's Cos and Sin in bf16 before opset 22; ops for which the GPU engine
  has no CUDA kernel in the compute type, per :mod:`ortflow.graph.precision.cuda_kernels`, e.g. Pow, Sqrt, Neg in bf16,
  and the Sigmoid and Mul of a SiLU, which the engine fuses into QuickGelu, without a bf16 kernel): inputs are read in
  fp32, outputs stay fp32;
* **shape readers** (Shape, Size): read whatever version exists, no cast;
* **Cast** to fp32 becomes a cast to the compute type (marked in its ``doc_string``) so a low region stays low.

A tensor read in a precision it does not exist in gets one ``Cast`` node (named ``autocast/...``), made where it is
first read and shared by every later reader: a parameter used twice (tied weights) is cast once. Parameters are never
changed: they stay fp32 initializers, so the engine keeps fp32 master weights and delivers fp32 gradients (the
gradient of a Cast is a Cast back). Float ``Constant`` nodes read in the compute type get a second, already converted
``Constant`` (values beyond the compute type's range are clipped to its largest finite value, so a -1e9 or
float32-min attention mask stays finite rather than -inf). Graph
inputs and outputs keep their names and types: an output produced in the compute type is renamed inside the graph and
cast back under its own name.

:func:`strip_autocast` undoes the rewrite exactly (the fp32 graph, e.g. for an fp32 export of a model trained in mixed
precision) and :func:`fold_parameter_casts` turns the parameter casts of an inference graph into compute-type
initializers (half the file size).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.onnx_tools import infer_shapes
from ortflow.graph.precision.cuda_kernels import fused_without_kernel, has_kernel, opsets, schema_admits

log = logging.getLogger(__name__)

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
_SHORT = {FLOAT: "fp32", FLOAT16: "fp16", BFLOAT16: "bf16"}

#: Ops kept in fp32 by default: normalisations and softmax reduce over many values (fp16 sums lose the small terms),
#: explicit reductions likewise, and the losses take log/exp of the scores.
DEFAULT_FP32_OPS = (
    "LayerNormalization", "Softmax", "LogSoftmax", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2",
    "ReduceLogSumExp", "ReduceProd", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
)  # fmt: skip
#: Ops whose float output type an attribute fixes, or that have no fp16 kernel to speak of: left as they are.
_FIXED_TYPE_OPS = frozenset({
    "Constant", "ConstantOfShape", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
    "EyeLike", "Multinomial", "Bernoulli", "Range",
})  # fmt: skip
_SHAPE_READERS = frozenset({"Shape", "Size"})
#: Inputs that the operator's schema fixes to float32 whatever the data's type (Resize's roi and scales).
_FP32_INPUTS = {"Resize": {1, 2}, "Upsample": {1}}
_CAST_MARK = "autocast: was Cast(to=FLOAT)"
_FP16_MAX = 65504.0
#: Largest finite bf16 value (bit pattern 0x7F7F): the clip bound of bf16 constants.
_BF16_MAX = float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0])


class AutocastError(ValueError):
    """The graph cannot be rewritten (no type information for a tensor, or not topologically sorted)."""


@dataclass
class AutocastReport:
    """What :func:`autocast` changed (logged once; also handy in tests)."""

    compute_type: int
    lowered: collections.Counter = field(default_factory=collections.Counter)
    kept_fp32: collections.Counter = field(default_factory=collections.Counter)
    no_kernel: collections.Counter = field(default_factory=collections.Counter)
    no_type: collections.Counter = field(default_factory=collections.Counter)
    casts: int = 0
    parameter_casts: int = 0
    constants: int = 0
    clipped_constants: list[str] = field(default_factory=list)

    def summary(self) -> str:
        kept = ", ".join(f"{op} x{n}" for op, n in sorted(self.kept_fp32.items())) or "none"
        clipped = len(self.clipped_constants)
        clipped = f"; {clipped} constant(s) clipped to the compute type's range" if clipped else ""
        short = _SHORT[self.compute_type]
        lacking = ", ".join(f"{op} x{n}" for op, n in sorted(self.no_kernel.items()))
        lacking = f" ({lacking} for want of a {short} CUDA kernel)" if lacking else ""
        untyped = ", ".join(f"{op} x{n}" for op, n in sorted(self.no_type.items()))
        lacking += f" ({untyped} for want of a {short} type in the op's schema)" if untyped else ""
        return (
            f"autocast to {short}: {sum(self.lowered.values())} nodes in {short}, kept in fp32: {kept}{lacking}; "
            f"{self.casts} casts added ({self.parameter_casts} of parameters), {self.constants} constants "
            f"converted{clipped}"
        )


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor the graph names (inputs, initializers, node outputs via shape inference)."""
    try:
        inferred = infer_shapes(model, strict_mode=False)
    except Exception as err:  # noqa: BLE001 - onnx raises several kinds; the walk reports untyped tensors itself
        log.debug("shape inference failed: %s", err)
        inferred = model
    graph = inferred.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            attr = node.attribute[0]
            types[node.output[0]] = attr.t.data_type if attr.name == "value" else (
                FLOAT if attr.name in ("value_float", "value_floats") else TensorProto.INT64)
    return types


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to nearest-even bf16, as the uint16 bit patterns ONNX stores."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def convert_tensor(array: np.ndarray, name: str, compute: int) -> tuple[onnx.TensorProto, bool]:
    """An fp32 array as a compute-type TensorProto; also whether clipping to the type's range changed a value.

    Finite values beyond the compute type's largest finite value are clipped to it (inf stays inf): exporters write
    ``torch.finfo(torch.float32).min`` as the additive attention mask, which rounds to -inf in bf16 and makes
    ``0 * -inf = NaN`` where the mask lets a position through.
    """
    limit = _FP16_MAX if compute == FLOAT16 else _BF16_MAX
    clipped = np.clip(array, -limit, limit)
    finite = np.isfinite(array)
    changed = bool(np.any(clipped[finite] != array[finite]))
    if compute == FLOAT16:
        return numpy_helper.from_array(clipped.astype(np.float16), name), changed
    tensor = helper.make_tensor(name, BFLOAT16, array.shape, to_bfloat16_bits(clipped).tobytes(), raw=True)
    return tensor, changed


class _Walk:
    """The state of one rewrite: available versions of each tensor and the new node list."""

    def __init__(self, model: onnx.ModelProto, compute: int, fp32_ops: frozenset[str], check_kernels: bool = True):
        self.graph = model.graph
        self.compute, self.fp32_ops = compute, fp32_ops
        self.check_kernels = check_kernels
        self.opsets = opsets(model)
        self.fused = fused_without_kernel(model.graph, compute) if check_kernels else {}
        self.types = _elem_types(model)
        self.report = AutocastReport(compute)
        self.versions: dict[str, dict[int, str]] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.constants: dict[str, np.ndarray] = {}
        self.parameters = {t.name for t in self.graph.initializer}
        self.constant_outputs = {o for n in self.graph.node if n.op_type == "Constant" for o in n.output}
        self.outputs = {o.name for o in self.graph.output}
        for name, elem in self.types.items():
            if name in self.parameters or name in {i.name for i in self.graph.input}:
                self.versions[name] = {elem: name}

    def mode(self, node: onnx.NodeProto) -> str:
        if node.op_type in _SHAPE_READERS:
            return "any"
        if node.op_type == "Cast":
            return "cast"
        has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if (node.op_type in self.fp32_ops or node.op_type in _FIXED_TYPE_OPS or has_subgraph
                or node.domain not in ("", "ai.onnx", "com.microsoft")):
            return "fp32"
        exempt = _FP32_INPUTS.get(node.op_type, set())
        lowered = {x for k, x in enumerate(node.input) if x and k not in exempt and self.types.get(x) == FLOAT}
        if not lowered:
            return "low"
        lowered |= {x for x in node.output if self.types.get(x) == FLOAT}
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if not schema_admits(node, self.opsets.get(domain, 1), self.compute, lowered):
            self.report.no_type[node.op_type] += 1  # the engine's graph builder would refuse the type
            return "fp32"
        if self.check_kernels and has_kernel(node.op_type, domain, self.opsets.get(domain, 1), self.compute) is False:
            self.report.no_kernel[node.op_type] += 1
            return "fp32"
        if (self.compute == BFLOAT16 and node.op_type == "Div" and len(node.input) > 1
                and node.input[1] not in self.constant_outputs):
            # The engine's gradient of a computed divisor (DivGrad's dB, RMSNorm's 1 / sqrt) reduces it with
            # ReduceSumTraining, whose schema has no bf16 type: the training graph would not load.
            self.report.no_kernel["Div (its divisor's gradient, ReduceSumTraining)"] += 1
            return "fp32"
        if node.output and node.output[0] in self.fused:  # the engine would fuse it into an op without a kernel
            self.report.no_kernel[f"{node.op_type} (into {self.fused[node.output[0]]})"] += 1
            return "fp32"
        return "low"

    def fetch(self, name: str, want: int) -> str:
        """The name of ``name`` in precision ``want``, adding a Cast (or a converted Constant) the first time."""
        have = self.versions.get(name)
        if have is None:
            raise AutocastError(f"autocast: '{name}' is read before it is produced (the graph is not sorted)")
        if want in have:
            return have[want]
        short = _SHORT.get(want, str(want))
        new = f"{name}__{short}"
        if want == FLOAT and name in self.outputs:  # a graph output read in fp32 inside too (a pipeline stage's
            self.cast_output(name, have[self.compute])  # residual stream): its cast back, made now, serves both
            have[want] = name
            return name
        if name in self.constants and want == self.compute:
            tensor, clipped = convert_tensor(self.constants[name], new, want)
            self.nodes.append(helper.make_node("Constant", [], [new], name=f"autocast/{name}/{short}", value=tensor,
                                               doc_string=f"autocast: {name}"))
            self.report.constants += 1
            if clipped:
                self.report.clipped_constants.append(name)
        else:
            source = have.get(FLOAT) or next(iter(have.values()))
            self.nodes.append(helper.make_node("Cast", [source], [new], name=f"autocast/{name}/{short}", to=want,
                                               doc_string=f"autocast: {name}"))
            self.report.casts += 1
            self.report.parameter_casts += name in self.parameters
        have[want] = new
        return new

    def visit(self, node: onnx.NodeProto) -> None:
        mode = self.mode(node)
        if node.op_type == "Constant":
            attr = node.attribute[0] if node.attribute else None
            if attr is not None and attr.name == "value" and attr.t.data_type == FLOAT:
                self.constants[node.output[0]] = numpy_helper.to_array(attr.t)
        exempt = _FP32_INPUTS.get(node.op_type, set())
        for i, name in enumerate(node.input):
            if not name or self.types.get(name) != FLOAT:
                continue
            if mode == "low":
                node.input[i] = self.fetch(name, FLOAT if i in exempt else self.compute)
            elif mode == "fp32":
                node.input[i] = self.fetch(name, FLOAT)
            else:  # a shape reader or a Cast reads whatever exists
                have = self.versions.get(name) or {FLOAT: self.fetch(name, FLOAT)}
                node.input[i] = have.get(self.compute) or next(iter(have.values()))
        to = next((a for a in node.attribute if a.name == "to"), None)
        if mode == "cast" and to is not None and to.i == FLOAT and not node.doc_string:
            to.i = self.compute
            node.doc_string = _CAST_MARK
            mode = "low"
        lowered_any = False
        for j, out in enumerate(node.output):
            elem = self.types.get(out)
            if not out:
                continue
            if elem is None and mode == "low":
                raise AutocastError(
                    f"autocast: shape inference found no type for '{out}' ({node.op_type} '{node.name}'); "
                    "re-export the model with type information (value_info) or add its op to precision.fp32_ops"
                )
            if mode == "low" and elem == FLOAT:
                renamed = f"{out}__{_SHORT[self.compute]}" if out in self.outputs else out
                node.output[j] = renamed
                self.versions[out] = {self.compute: renamed}
                lowered_any = True
            else:
                self.versions[out] = {elem: out}
        if mode == "low" and (lowered_any or node.op_type == "Cast"):
            self.report.lowered[node.op_type] += 1
        elif mode == "fp32" and node.op_type not in _FIXED_TYPE_OPS:
            self.report.kept_fp32[node.op_type] += 1
        self.nodes.append(node)

    def cast_output(self, name: str, source: str) -> None:
        """The graph output ``name``, made in the compute type as ``source``, cast back to fp32 under its name."""
        self.nodes.append(helper.make_node("Cast", [source], [name], name=f"autocast/{name}/output", to=FLOAT,
                                           doc_string=f"autocast: output {name}"))
        self.report.casts += 1

    def finish_outputs(self) -> None:
        """Graph outputs made in the compute type are cast back to fp32 under their own names."""
        for out in self.graph.output:
            have = self.versions.get(out.name, {})
            if self.types.get(out.name) == FLOAT and FLOAT not in have and self.compute in have:
                self.cast_output(out.name, have[self.compute])


def autocast(
    model: onnx.ModelProto,
    compute_type: int = FLOAT16,
    fp32_ops: Iterable[str] = DEFAULT_FP32_OPS,
    check_kernels: bool = True,
) -> onnx.ModelProto:
    """The model with fp32 activations in ``compute_type`` (fp16 or bf16) and fp32 parameters cast where read.

    Args:
        model: An fp32 model (not changed; a rewritten copy is returned).
        compute_type: ``TensorProto.FLOAT16`` or ``TensorProto.BFLOAT16``.
        fp32_ops: Op types computed in fp32 (their inputs cast to fp32, outputs left fp32).
        check_kernels: Also keep in fp32 every op the GPU engine has no CUDA kernel for in ``compute_type``
            (:mod:`ortflow.graph.precision.cuda_kernels`); off only to show what would fail without it.

    Returns:
        The rewritten model; graph inputs, outputs and initializers are unchanged.

    Raises:
        AutocastError: A tensor has no type information, or the graph is not topologically sorted.
    """
    if compute_type not in (FLOAT16, BFLOAT16):
        raise ValueError(f"compute_type must be FLOAT16 or BFLOAT16, got {compute_type}")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    walk = _Walk(result, compute_type, frozenset(fp32_ops), check_kernels)
    for node in list(result.graph.node):
        walk.visit(node)
    walk.finish_outputs()
    for vi in result.graph.value_info:  # tensors that now hold the compute type under their own name
        if walk.versions.get(vi.name, {}).get(compute_type) == vi.name:
            vi.type.tensor_type.elem_type = compute_type
    del result.graph.node[:]
    result.graph.node.extend(walk.nodes)
    log.info(walk.report.summary())
    result.doc_string = (result.doc_string + "\n" if result.doc_string else "") + walk.report.summary()
    return result


def autocast_report(model: onnx.ModelProto, compute_type: int = FLOAT16,
                    fp32_ops: Iterable[str] = DEFAULT_FP32_OPS) -> AutocastReport:
    """What :func:`autocast` would change, without keeping the result."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    walk = _Walk(work, compute_type, frozenset(fp32_ops))
    for node in list(work.graph.node):
        walk.visit(node)
    walk.finish_outputs()
    return walk.report


def strip_autocast(model: onnx.ModelProto) -> onnx.ModelProto:
    """Undo :func:`autocast` (also on graphs the engine built around it): the fp32 graph, parameters untouched.

    Casts and constants that autocast added are removed (their readers read the original tensor again), rewritten
    Casts go back to fp32, outputs renamed inside the graph get their names back, and ``value_info`` is dropped.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    alias: dict[str, str] = {}  # added tensor -> the tensor it stands for
    kept = []
    for node in graph.node:
        if node.name.startswith("autocast/") and node.doc_string.startswith("autocast:"):
            if node.doc_string.startswith("autocast: output "):
                alias[node.input[0]] = node.output[0]  # the renamed producer gets the output's name back
            elif node.op_type == "Cast":
                alias[node.output[0]] = node.input[0]
            else:
                alias[node.output[0]] = node.doc_string.removeprefix("autocast: ")
            continue
        if node.op_type == "Cast" and node.doc_string == _CAST_MARK:
            next(a for a in node.attribute if a.name == "to").i = FLOAT
            node.doc_string = ""
        kept.append(node)

    def resolve(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = resolve(name)
        for j, name in enumerate(node.output):
            node.output[j] = resolve(name)
    del graph.node[:]
    graph.node.extend(kept)
    del graph.value_info[:]  # they record compute types; shape inference recovers the fp32 ones
    return result


def fold_parameter_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """An inference graph's autocast parameter casts replaced by compute-type initializers (fp32 copies dropped)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    inits = {t.name: t for t in graph.initializer}
    readers = collections.Counter(name for node in graph.node for name in node.input)
    kept, folded = [], {}
    for node in graph.node:
        source = node.input[0] if node.input else ""
        is_param_cast = node.op_type == "Cast" and node.name.startswith("autocast/") and source in inits
        to = next((a.i for a in node.attribute if a.name == "to"), FLOAT)
        if is_param_cast and readers[source] == 1 and inits[source].data_type == FLOAT and to != FLOAT:
            folded[source] = convert_tensor(numpy_helper.to_array(inits[source]), node.output[0], to)[0]
            continue
        kept.append(node)
    remaining = [t for t in graph.initializer if t.name not in folded] + list(folded.values())
    del graph.initializer[:]
    graph.initializer.extend(remaining)
    del graph.node[:]
    graph.node.extend(kept)
    return result
