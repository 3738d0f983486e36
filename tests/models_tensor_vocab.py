"""A torch-export-shaped GPT for the Gemm and vocabulary splits (built with ``onnx.helper``, no torch).

What ``torch.onnx.export`` writes for a GPT whose MLP runs on flattened tokens and whose LM head is tied:

* the MLP reshapes ``[B, T, C]`` to ``[B*T, C]`` with Constant-heavy shape arithmetic (``Shape -> Gather -> Mul ->
  Unsqueeze -> Concat``), runs ``nn.Linear`` as ``Gemm(transB=1)`` with its ``[out, in]`` weight and bias, and
  reshapes back with the residual's own ``Shape``;
* attention: a fused QKV Linear (``MatMul`` + ``Add`` on ``[B, T, C]``) split in three, Concat head reshapes;
* the token table ``wte`` is read twice: by the embedding ``Gather`` and by the LM head ``MatMul(x, Transpose(wte))``;
* the model's output is the ``[B, T, V]`` logits.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from .models_export import Builder


def gemm_tied_gpt(path, *, layers: int = 1, width: int = 16, heads: int = 2, vocab: int = 32, seq: int = 8,
                  batch: int = 2, seed: int = 0, tied: bool = True):
    """Write the model to ``path`` (see the module docstring); ``tied=False`` gives the LM head its own [C, V]."""
    head_dim = width // heads
    b = Builder(seed)
    wte = b.param("transformer.wte.weight", (vocab, width), std=0.3)
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0),
                     b.param("transformer.wpe.weight", (seq, width), std=0.1)])

    def dim(t: str, k: int) -> str:
        return b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", [t]), b.const(k)], axis=0), b.const([0])])

    def gemm(t: str, prefix: str, fan_in: int, fan_out: int) -> str:  # nn.Linear on [N, fan_in]
        w = b.param(f"{prefix}.weight", (fan_out, fan_in), std=1.0 / math.sqrt(fan_in))
        return b.op("Gemm", [t, w, b.param(f"{prefix}.bias", (fan_out,), std=0.1)], alpha=1.0, beta=1.0, transB=1)

    for i in range(layers):
        p = f"transformer.h.{i}"
        qkv = b.linear(b.layer_norm(x, f"{p}.ln_1", width), f"{p}.attn.c_attn", width, 3 * width)
        q, k, v = b.op("Split", [qkv, b.const([width] * 3)], num_outputs=3, axis=2)
        parts = []
        for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])):
            shape = b.op("Concat", [dim(t, 0), dim(t, 1), b.const([heads]), b.const([head_dim])], axis=0)
            parts.append(b.op("Transpose", [b.op("Reshape", [t, shape])], perm=perm))
        scores = b.op("Div", [b.op("MatMul", parts[:2]), b.const(math.sqrt(head_dim), np.float32)])
        mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
        probs = b.op("Softmax", [b.op("Add", [scores, b.const(mask, np.float32)])], axis=-1)
        context = b.op("Transpose", [b.op("MatMul", [probs, parts[2]])], perm=[0, 2, 1, 3])
        merged = b.op("Reshape", [context, b.op("Concat", [dim(x, 0), dim(x, 1), b.const([width])], axis=0)])
        x = b.op("Add", [x, b.linear(merged, f"{p}.attn.c_proj", width, width)])
        h = b.layer_norm(x, f"{p}.ln_2", width)
        tokens = b.op("Unsqueeze", [b.op("Mul", [b.op("Gather", [b.op("Shape", [h]), b.const(0)], axis=0),
                                                 b.op("Gather", [b.op("Shape", [h]), b.const(1)], axis=0)]),
                                    b.const([0])])
        flat = b.op("Reshape", [h, b.op("Concat", [tokens, b.const([width])], axis=0)])  # [B*T, C]
        hidden = b.op("Tanh", [gemm(flat, f"{p}.mlp.c_fc", width, 4 * width)])
        out = gemm(hidden, f"{p}.mlp.c_proj", 4 * width, width)
        x = b.op("Add", [x, b.op("Reshape", [out, b.op("Shape", [x])])])
    x = b.layer_norm(x, "transformer.ln_f", width)
    head = b.op("Transpose", [wte], perm=[1, 0]) if tied else b.param("lm_head.weight", (width, vocab), std=0.3)
    logits = b.op("MatMul", [x, head])
    return b.save(path, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, vocab])],
                  {logits: "logits"})
