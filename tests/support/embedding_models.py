"""Embedding models shaped like ``torch.onnx.export`` output, for the repeatable-gather pass
(graph/gradients/embedding.py).

``tied_lm``: the token table is read by a Gather (optionally through an Identity, as torch writes a tied weight it
reads twice) and by the LM head ``MatMul(h, Transpose(wte))``; ids int64 or int32; fixed batch dims; LayerNormalization
with only Y; Constant-heavy shape arithmetic into Reshape; ``[B, T, V]`` logits. Other Gathers that must stay as they
are: one on a Shape (ints), one on a frozen table, one on axis 1 of a parameter.
"""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper

from tests.support.graph import Builder


def tied_lm(path, vocab: int = 7, seq_len: int = 6, width: int = 8, batch: int = 3, ids_type: int = TensorProto.INT64,
            through_identity: bool = True, seed: int = 0) -> Path:
    """input_ids [batch, T] -> tied embedding (+ frozen-style extra table, + axis-1 read) -> LN -> Linear -> tied head.

    Parameters: ``wte.weight`` [V, d] (tied), ``wpe.weight`` [T, d], ``seg.weight`` [2, d] (meant to be frozen in
    tests: its Gather must stay), ``mix.weight`` [d, T] read with Gather on axis 1, LN and Linear weights.
    """
    b = Builder(seed)
    wte = b.param("wte.weight", (vocab, width), std=0.5)
    table = b.op("Identity", [wte]) if through_identity else wte
    tokens = b.op("Gather", [table, "input_ids"], axis=0)
    seg_ids = b.op("Cast", [b.op("Greater", ["input_ids", b.const(vocab // 2, _np_int(ids_type))])],
                   to=TensorProto.INT64)
    segments = b.op("Gather", [b.param("seg.weight", (2, width), std=0.3), seg_ids], axis=0)
    columns = b.op("Gather", [b.param("mix.weight", (width, seq_len), std=0.3), b.const(0)], axis=1)  # [d]
    x = b.op("Add", [b.op("Add", [tokens, segments]), b.param("wpe.weight", (seq_len, width), std=0.1)])
    x = b.op("Add", [x, columns])
    h = b.op("Tanh", [b.linear(b.layer_norm(x, "ln_1", width), "fc", width, width)])
    h = b.layer_norm(b.op("Add", [x, h]), "ln_f", width)
    shape = b.op("Shape", [h])
    rows = b.op("Gather", [shape, b.const(0)], axis=0)  # torch's shape arithmetic: Shape -> Gather -> Unsqueeze
    target = b.op("Concat", [b.op("Unsqueeze", [rows, b.const([0])]), b.const([seq_len, width])], axis=0)
    h = b.op("Reshape", [b.op("Reshape", [h, b.const([batch * seq_len, width])]), target])
    logits = b.op("MatMul", [h, b.op("Transpose", [wte], perm=[1, 0])])  # tied LM head reads wte directly
    return b.save(path, [helper.make_tensor_value_info("input_ids", ids_type, [batch, seq_len])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq_len, vocab])],
                  {logits: "logits"})


def _np_int(ids_type: int):
    import numpy as np

    return np.int32 if ids_type == TensorProto.INT32 else np.int64
