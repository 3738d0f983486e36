"""GELUs as exporters write them (opset 17, built with ``onnx.helper``; no torch), for the GELU fusion tests.

Forms (``x`` the activation; node order and operand order as the exporter writes them):

* ``torch_erf``: ``torch.onnx.export`` of ``nn.GELU()`` / ``F.gelu`` (symbolic_opset9.gelu):
  ``Mul(Mul(x, Add(Erf(Div(x, sqrt2)), 1)), 0.5)``;
* ``hf_erf``: Hugging Face's ``x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))``: ``Mul(Mul(x, 0.5), Add(1, Erf(..)))``;
* ``scaled_erf``: ``y * ((torch.erf(y * (1 / sqrt2)) + 1) * 0.5)`` (the bench GPT, ortflow's example GPT);
* ``torch_tanh``: ``F.gelu(x, approximate="tanh")``: ``Mul(0.5, Mul(x, Add(1, Tanh(Mul(c, Add(x, Mul(k, Mul(x,
  Mul(x, x)))))))))``;
* ``hf_tanh``: Hugging Face's ``NewGELUActivation`` (GPT-2's ``gelu_new``): ``0.5 * input * (1.0 + torch.tanh(
  math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from tests.support.graph import Builder

FORMS = ("torch_erf", "hf_erf", "scaled_erf", "torch_tanh", "hf_tanh")


def gelu(b: Builder, x: str, form: str) -> str:
    """Append the nodes of one GELU ``form`` reading ``x``; returns its output."""
    f32 = np.float32
    if form == "torch_erf":
        erf = b.op("Erf", [b.op("Div", [x, b.const(math.sqrt(2.0), f32)])])
        return b.op("Mul", [b.op("Mul", [x, b.op("Add", [erf, b.const(1.0, f32)])]), b.const(0.5, f32)])
    if form == "hf_erf":
        half = b.op("Mul", [x, b.const(0.5, f32)])
        erf = b.op("Erf", [b.op("Div", [x, b.const(math.sqrt(2.0), f32)])])
        return b.op("Mul", [half, b.op("Add", [b.const(1.0, f32), erf])])
    if form == "scaled_erf":
        erf = b.op("Erf", [b.op("Mul", [x, b.const(1.0 / math.sqrt(2.0), f32)])])
        return b.op("Mul", [x, b.op("Mul", [b.op("Add", [erf, b.const(1.0, f32)]), b.const(0.5, f32)])])
    if form == "torch_tanh":
        cube = b.op("Mul", [x, b.op("Mul", [x, x])])
        inner = b.op("Mul", [b.const(math.sqrt(2.0 / math.pi), f32),
                             b.op("Add", [x, b.op("Mul", [b.const(0.044715, f32), cube])])])
        one_plus = b.op("Add", [b.const(1.0, f32), b.op("Tanh", [inner])])
        return b.op("Mul", [b.const(0.5, f32), b.op("Mul", [x, one_plus])])
    if form == "hf_tanh":
        half = b.op("Mul", [x, b.const(0.5, f32)])
        cube = b.op("Pow", [x, b.const(3.0, f32)])
        inner = b.op("Mul", [b.op("Add", [x, b.op("Mul", [cube, b.const(0.044715, f32)])]),
                             b.const(math.sqrt(2.0 / math.pi), f32)])
        return b.op("Mul", [half, b.op("Add", [b.op("Tanh", [inner]), b.const(1.0, f32)])])
    raise ValueError(form)


def gelu_mlp(path, form: str = "torch_erf", features: int = 6, hidden: int = 16, classes: int = 3,
             batch: int | str = "batch", seed: int = 0, extra_reader: bool = False) -> Path:
    """x [batch, features] -> Linear -> GELU (``form``) -> LayerNormalization (Y only) -> Linear -> logits.

    ``extra_reader``: the GELU's ``1 + erf/tanh`` is also a model output, so its nodes must not be fused.
    """
    b = Builder(seed)
    h = b.linear("x", "fc1", features, hidden)
    count = len(b.nodes)
    y = gelu(b, h, form)
    gate = next(n.output[0] for n in b.nodes[count:] if n.op_type == "Add" and n.input[0] != h and n.input[1] != h)
    logits = b.linear(b.layer_norm(y, "ln", hidden), "fc2", hidden, classes)
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])]
    rename = {logits: "logits"}
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("gate", TensorProto.FLOAT, [batch, hidden]))
        rename[gate] = "gate"
    return b.save(path, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])], outputs, rename)


def gelu_lm(path, form: str = "hf_tanh", vocab: int = 11, seq_len: int = 5, width: int = 8, batch: int | str = "batch",
            seed: int = 0) -> Path:
    """GPT-2-like: tied embedding, a pre-LayerNorm GELU MLP block (``form``), LM head by ``MatMul(h, wte^T)``,
    logits [batch, T, V]."""
    b = Builder(seed)
    wte = b.param("wte.weight", (vocab, width), std=0.5)
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0), b.param("wpe.weight", (seq_len, width), std=0.1)])
    h = gelu(b, b.linear(b.layer_norm(x, "h.0.ln_2", width), "h.0.mlp.c_fc", width, 4 * width), form)
    x = b.op("Add", [x, b.linear(h, "h.0.mlp.c_proj", 4 * width, width)])
    x = b.layer_norm(x, "ln_f", width)
    logits = b.op("MatMul", [x, b.op("Transpose", [wte], perm=[1, 0])])
    return b.save(path, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq_len])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq_len, vocab])],
                  {logits: "logits"})
