"""Which half-precision CUDA kernels the GPU engine has, per operator: what autocast may lower and what validate checks.

The GPU build of ``onnxruntime-training`` 1.19.2 resolves every node to a kernel when a rank starts its session. A
node whose (op, opset, element type) has no CUDA kernel falls back to the CPU provider, which has no fp16/bf16 kernel
for arithmetic either, and the rank stops with ``NOT_IMPLEMENTED: Could not find an implementation for Pow(15)``.
``configure`` cannot see this: the CPU build only builds the graph.

:data:`KERNELS` records, for the operators ortflow meets in real exports (Hugging Face GPT-2 and BERT, torch CNNs and
recurrent layers, ``ortflow.examples.gpt``) and in its own passes, which of fp16 and bf16 the CUDA execution provider
registers a kernel for, per opset range. It follows the CUDA kernel registrations in the engine's source
(``onnxruntime/core/providers/cuda/cuda_execution_provider.cc``,
``onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc``
and each op's type constraints) and, where they disagree, what the installed GPU engine of release 1.19.2 does:
``tests/gpu/test_gpu_cuda_kernels.py`` starts a one-node CUDA session per judged op and type (CPU fallback off), a
session per autocast fixture, and the failure the table prevents; where the two disagree, the engine is right and the
test names the entry. In short: elementwise arithmetic, MatMul, Gemm, Softmax, LayerNormalization and the
``com.microsoft`` GELU kernels have both types; Pow and LogSoftmax have fp16 but no bf16; Conv and BatchNormalization
have fp16 only (cuDNN paths), and so has Pad; LSTM and GRU train in fp32 only (the engine's training kernels of
both are the CPU provider's); SkipLayerNormalization (which the engine's own fusion makes out of Add +
LayerNormalization) has fp16 only; data-movement ops (Reshape, Transpose, Gather, Concat, Slice, ...) take any
fixed-size type.

Operators absent from the table are not judged (:func:`has_kernel` returns ``None``): autocast lowers them as before
and validate does not report them. Before the table, :func:`schema_admits` asks the operator's ONNX schema at the
model's opset whether the type exists at all (``Cos`` and ``Sin`` have no bf16 type before opset 22, ``Conv`` none
before 22): a node the schema refuses stops configure itself ("has unsupported type: tensor(bfloat16)").
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from ortflow.graph.onnx_tools import infer_shapes

FLOAT16, BFLOAT16 = TensorProto.FLOAT16, TensorProto.BFLOAT16
HALF_NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16"}
_BOTH = frozenset({FLOAT16, BFLOAT16})
_FP16 = frozenset({FLOAT16})
_NONE: frozenset[int] = frozenset()


@dataclass(frozen=True)
class KernelRange:
    """The half types with a CUDA kernel for opsets ``first`` to ``last`` (``None``: and every later one)."""

    first: int
    last: int | None
    types: frozenset[int]

    def covers(self, opset: int) -> bool:
        return self.first <= opset and (self.last is None or opset <= self.last)


def _always(types: frozenset[int]) -> tuple[KernelRange, ...]:
    return (KernelRange(1, None, types),)


# Data-movement and shape ops: their CUDA kernels are registered for every fixed-size type. CastLike has no kernel of
# its own: the engine expands it into its function body, a Cast.
_ANY_TYPE_OPS = (
    "Cast", "CastLike", "Concat", "ConstantOfShape", "Expand", "Flatten", "Gather", "GatherElements", "GatherND",
    "Identity", "Reshape", "Shape", "Size", "Slice", "Split", "Squeeze", "Transpose", "Trilu", "Unsqueeze",
)  # fmt: skip

#: (domain, op type) -> the opset ranges and the half types the CUDA provider has kernels for. ``""`` is ai.onnx.
KERNELS: dict[tuple[str, str], tuple[KernelRange, ...]] = {
    **{("", op): _always(_BOTH) for op in _ANY_TYPE_OPS},
    # Elementwise arithmetic: fp16 since the first opsets, bf16 from opset 13.
    **{("", op): (KernelRange(7, 12, _FP16), KernelRange(13, None, _BOTH)) for op in ("Add", "Sub", "Mul", "Div")},
    ("", "Pow"): (KernelRange(7, 11, _FP16), KernelRange(12, 12, _NONE), KernelRange(13, None, _FP16)),
    ("", "Erf"): (KernelRange(9, 12, _FP16), KernelRange(13, None, _BOTH)),
    ("", "Tanh"): (KernelRange(6, 12, _FP16), KernelRange(13, None, _BOTH)),
    ("", "Relu"): (KernelRange(6, 12, _FP16), KernelRange(13, None, _BOTH)),
    ("", "Sigmoid"): (KernelRange(6, 12, _FP16), KernelRange(13, None, _BOTH)),
    # Unary math of RMSNorm and RoPE (Llama): fp16 kernels only; Sin and Cos have no bf16 type before opset 22 either.
    **{("", op): _always(_FP16) for op in ("Neg", "Sqrt", "Reciprocal", "Sin", "Cos", "Exp", "Log")},
    ("", "Where"): (KernelRange(9, 15, _FP16), KernelRange(16, None, _BOTH)),
    # ScatterND (TorchScript's T5 writes one): every fixed-size type, as the data-movement ops, at the opsets whose
    # registrations read so; its opset-18 registration (with the reduction attribute) is not judged.
    ("", "ScatterND"): (KernelRange(11, 17, _BOTH),),
    ("", "Equal"): (KernelRange(7, None, _FP16),),
    ("", "Dropout"): (KernelRange(7, 12, _FP16), KernelRange(13, None, _BOTH)),
    # Matrix products: cuBLAS in both types.
    ("", "MatMul"): (KernelRange(1, 12, _FP16), KernelRange(13, None, _BOTH)),
    ("", "Gemm"): (KernelRange(7, 12, _FP16), KernelRange(13, None, _BOTH)),
    # Normalisations and softmax (autocast keeps them fp32 by default; the table matters when a user lowers them).
    ("", "Softmax"): (KernelRange(1, 12, _FP16), KernelRange(13, None, _BOTH)),
    ("", "LogSoftmax"): _always(_FP16),
    ("", "LayerNormalization"): (KernelRange(17, None, _BOTH),),
    # Convolutional layers: cuDNN paths registered for fp16 only.
    ("", "Conv"): (KernelRange(1, None, _FP16),),
    ("", "BatchNormalization"): (KernelRange(7, None, _FP16),),
    # Pad (the vocabulary padding of a tensor-parallel LM head, graph/tensor_parallel): float, double, fp16 and bool.
    ("", "Pad"): (KernelRange(2, None, _FP16),),
    # Recurrent layers: the engine trains an LSTM or GRU node as com.microsoft LSTMTraining + LSTMGrad (GRUTraining +
    # GRUGrad), which it registers for the CPU provider alone, in float: in fp16 or bf16 no provider has a kernel (the
    # CUDA provider's fp16 LSTM and GRU serve inference only). Kept fp32, they run on the CPU beside the GPU's nodes.
    # From the registrations alone: the GPU test's one-node probe starts inference sessions and leaves them out.
    **{("", op): _always(_NONE) for op in ("LSTM", "GRU")},
    # com.microsoft ops that ortflow's passes or the engine's fusions introduce.
    ("com.microsoft", "SkipLayerNormalization"): _always(_FP16),
    ("com.microsoft", "FastGelu"): _always(_BOTH),
    ("com.microsoft", "Gelu"): _always(_BOTH),
    ("com.microsoft", "BiasGelu"): _always(_BOTH),
    # The engine fuses SiLU, x * Sigmoid(x) (Llama's SwiGLU), into QuickGelu when it builds the training graph; the
    # CUDA QuickGelu of release 1.19.2 has no bf16 type (onnxruntime added it in 2025, PR #24772).
    ("com.microsoft", "QuickGelu"): _always(_FP16),
}


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset per domain (``""`` for ai.onnx)."""
    return {_domain(o.domain): o.version for o in model.opset_import}


def has_kernel(op_type: str, domain: str, opset: int, elem_type: int) -> bool | None:
    """Whether the CUDA provider has a kernel for ``op_type`` at ``opset`` in ``elem_type`` (fp16 or bf16).

    Returns:
        True or False for operators in :data:`KERNELS`; None for operators the table does not cover.
    """
    ranges = KERNELS.get((_domain(domain), op_type))
    if ranges is None:
        return None
    return any(r.covers(opset) and elem_type in r.types for r in ranges)


@dataclass(frozen=True)
class MissingKernel:
    """A node the GPU engine cannot run: it reads or writes a half type its op has no CUDA kernel for."""

    node: str
    op_type: str
    domain: str
    opset: int
    elem_type: int

    def message(self) -> str:
        op = f"{self.domain}:{self.op_type}" if self.domain else self.op_type
        return (f"{op}({self.opset}) node '{self.node}' runs in {HALF_NAMES[self.elem_type]}, for which the GPU engine "
                f"has no CUDA kernel; the rank would stop at start ('Could not find an implementation'). Keep the op "
                f"in fp32 (precision.fp32_ops: [{self.op_type}, ...]) or remove the model's own cast to "
                f"{HALF_NAMES[self.elem_type]} before it")  # fmt: skip


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor ``model`` names: inputs, initializers, value_info and onnx's shape inference."""
    try:
        model = infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - onnx raises several kinds; what value_info records is used as it is
        pass
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
    for node in graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and to is not None:  # known even where inference stopped early
            types.setdefault(node.output[0], to)
    return types


def missing_kernels(model: onnx.ModelProto, elem_types: dict[str, int] | None = None) -> list[MissingKernel]:
    """Nodes of ``model`` whose half-precision inputs or outputs have no CUDA kernel, in graph order.

    Args:
        model: The graph a rank loads (an autocast model, or a built training model).
        elem_types: Element type of each tensor name; :func:`element_types` of the model when not given.
    """
    elem_types = element_types(model) if elem_types is None else elem_types
    versions = opsets(model)
    found = []
    for node in model.graph.node:
        domain = _domain(node.domain)
        half = {elem_types.get(name) for name in [*node.input, *node.output] if name} & set(HALF_NAMES)
        if node.op_type == "Cast" or not half or (domain, node.op_type) not in KERNELS:
            continue
        opset = versions.get(domain, 1)
        for elem in sorted(half):
            if has_kernel(node.op_type, domain, opset, elem) is False:
                found.append(MissingKernel(node.name, node.op_type, domain, opset, elem))
    return found


_TYPE_NAMES = {FLOAT16: "tensor(float16)", BFLOAT16: "tensor(bfloat16)"}


def schema_admits(node: onnx.NodeProto, opset: int, elem_type: int, lowered: set[str]) -> bool:
    """Whether the ONNX schema of ``node``'s op at ``opset`` allows ``elem_type`` (fp16 or bf16) for the inputs and
    outputs named in ``lowered`` (those autocast would give that type). True for ops without a schema in onnx
    (``com.microsoft`` ops: the kernel table judges those)."""
    if node.domain not in ("", "ai.onnx"):
        return True
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return True
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    want = _TYPE_NAMES[elem_type]
    # An output whose type parameter types no input (LayerNormalization's Mean and InvStdDev, U) gets its type from
    # the op's attributes, not from the inputs autocast lowers: it does not decide whether the node can be lowered.
    input_kinds = {f.type_str for f in schema.inputs}
    for formals, actuals, outputs in ((schema.inputs, node.input, False), (schema.outputs, node.output, True)):
        for k, name in enumerate(actuals):
            if name in lowered and formals:
                kind = formals[min(k, len(formals) - 1)].type_str
                if outputs and kind in allowed and kind not in input_kinds:
                    continue
                if want not in allowed.get(kind, {kind}):
                    return False
    return True


def fused_without_kernel(graph: onnx.GraphProto, elem_type: int) -> dict[str, str]:
    """Nodes that the engine's training-graph build fuses into an op without a CUDA kernel in ``elem_type``, by first
    output -> that op: the ``Sigmoid`` and ``Mul`` of a SiLU, ``x * Sigmoid(x)`` (QuickGelu in bf16). Kept in fp32,
    they fuse into an fp32 QuickGelu."""
    if has_kernel("QuickGelu", "com.microsoft", 1, elem_type) is not False:
        return {}
    producers = {o: n for n in graph.node for o in n.output}
    found = {}
    for node in graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        for x, gate in (node.input, reversed(node.input)):
            sigmoid = producers.get(gate)
            if sigmoid is not None and sigmoid.op_type == "Sigmoid" and sigmoid.input[0] == x:
                found[node.output[0]] = found[sigmoid.output[0]] = "QuickGelu"
    return found
