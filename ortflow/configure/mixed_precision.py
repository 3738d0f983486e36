"""What configure does for ``precision.use_mixed_precision``: the autocast pass, the loss-scale input, the eval fix.

1. :func:`prepare_model` rewrites the user's model with :func:`ortflow.graph.precision.autocast.autocast`
   (fp32 parameters, fp16/bf16 activations, sensitive ops in fp32) before the engine builds its training graphs from it.
2. For fp16, the loss block multiplies the loss by a scalar graph input (:data:`loss_scale.INPUT_NAME`) that the
   trainer feeds every micro-batch (:class:`ortflow.trainer.loss_scale.LossScaler`).
3. :func:`unscale_eval_model`: the eval model is built from the same loss block, so it would take the scale input
   too; it is replaced there by a constant 1, so evaluation, export and the data stage see the model's own inputs.

Ops that must stay fp32 in bf16 whatever ``precision.fp32_ops`` says are added for bf16 here (:data:`BF16_FP32_OPS`):
``LayerNormalization``. With it in bf16, the engine's own SkipLayerNormFusion (applied when the session is made,
after configure) turns a residual ``Add`` -> ``LayerNormalization`` into a ``SkipLayerNormalization`` with bf16
inputs, a type that op does not have, and the session fails ("Type 'tensor(bfloat16)' of input parameter ... of
operator (SkipLayerNormalization) ... is invalid"; measured on an H200 with an empty fp32 list,
docs/gpu.md). fp16 has that type, so fp16 leaves the list to the user.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ortflow.artifacts_folder import LOSS_SCALE_INPUT as INPUT_NAME
from ortflow.config import RunConfig
from ortflow.graph.precision.autocast import BFLOAT16, FLOAT16, autocast

log = logging.getLogger(__name__)

#: Op types kept fp32 in bf16 even when ``precision.fp32_ops`` leaves them out: the engine fuses a bf16 residual Add +
#: LayerNormalization into a SkipLayerNormalization, which has no bf16 type (module docstring).
BF16_FP32_OPS: tuple[str, ...] = ("LayerNormalization",)


def compute_type(cfg: RunConfig) -> int:
    """``TensorProto.FLOAT16`` or ``BFLOAT16`` for the run's precision section."""
    return BFLOAT16 if cfg.precision.use_bfloat16 else FLOAT16


def fp32_ops(cfg: RunConfig) -> tuple[str, ...]:
    """The op types kept in fp32: ``precision.fp32_ops`` (default :data:`DEFAULT_FP32_OPS`) and, for bf16, the
    engine's missing kernels."""
    extra = BF16_FP32_OPS if cfg.precision.use_bfloat16 else ()
    return tuple(dict.fromkeys((*cfg.precision.fp32_ops, *extra)))


def scale_input(cfg: RunConfig) -> str | None:
    """The loss-scale input's name when the run scales its loss (fp16 mixed precision), else None."""
    prec = cfg.precision
    return INPUT_NAME if prec.use_mixed_precision and not prec.use_bfloat16 else None


def prepare_model(cfg: RunConfig, proto: onnx.ModelProto) -> onnx.ModelProto:
    """The user's model rewritten for mixed precision (the model itself when mixed precision is off).

    Raises:
        ValueError: The model already has an input called like the loss-scale input.
    """
    if not cfg.precision.use_mixed_precision:
        return proto
    name = scale_input(cfg)
    if name and any(i.name == name for i in proto.graph.input):
        raise ValueError(f"model.path: the model has an input named '{name}', which fp16 loss scaling needs; rename it")
    return autocast(proto, compute_type(cfg), fp32_ops(cfg))


def add_scale_input(graph: onnx.GraphProto, name: str) -> None:
    """Declare the scalar fp32 loss-scale input on a graph (the engine's loss block multiplies by it)."""
    graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))


def unscale_eval_model(path: Path, name: str) -> None:
    """Replace the eval model's loss-scale input by a constant 1 (eval reports the true loss, and takes no scale)."""
    model = onnx.load(str(path))
    kept = [i for i in model.graph.input if i.name != name]
    if len(kept) == len(model.graph.input):
        return
    del model.graph.input[:]
    model.graph.input.extend(kept)
    one = helper.make_tensor(name, TensorProto.FLOAT, [], [1.0])
    model.graph.node.insert(0, helper.make_node("Constant", [], [name], name=f"{name}/eval_one", value=one))
    onnx.save(model, str(path))
