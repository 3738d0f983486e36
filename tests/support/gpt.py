"""One configurable GPT-2 stack as ``torch.onnx.export`` writes it (built with ``onnx.helper``, no torch).

Token and position embeddings (Gather + Add), per block: a single-output LayerNormalization, a fused QKV Linear split
in three (all parts used), head reshapes through Shape -> Gather -> Unsqueeze -> Concat on Constants, scaled scores
with a Constant causal mask, Softmax, the output projection, a second LayerNormalization and a tanh MLP; a final
LayerNormalization and an LM head, tied to the token table (``MatMul(x, Transpose(wte))``) or its own ``[C, V]``.

The options are the ways torch's exports of GPTs differ:

* ``mlp="matmul"``: ``nn.Linear`` on ``[B, T, C]`` as ``MatMul`` + ``Add`` with an ``[in, out]`` weight;
  ``mlp="gemm"``: the MLP on flattened tokens, ``[B, T, C] -> [B*T, C]`` with Constant-heavy shape arithmetic,
  ``Gemm(transB=1)`` with its ``[out, in]`` weight, reshaped back with the residual's own ``Shape``;
* ``sizes="tuple"``: one ``Shape`` per reshaped tensor (``B, T, _ = x.size()``); ``"each"``: one per dimension read
  (``x.size(0)``, ``x.size(1)``);
* ``tied``: the LM head reads the token table; ``flat_logits``: the ``[B, T, V]`` logits reshaped to ``[B*T, V]``.

The presets below are the GPTs the tests train and split; each gives, bit for bit, the model its tests were written
against.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from tests.support.graph import Builder


def gpt(path, *, layers: int, width: int, heads: int, vocab: int, seq: int, batch: int | str, seed: int = 0,
        mlp: str = "matmul", mlp_ratio: int = 4, tied: bool = False, flat_logits: bool = False,
        sizes: str = "tuple", embed_std: float = 0.1, head_std: float = 0.1):
    """Write the GPT described in the module docstring to ``path`` and return ``path``.

    Args:
        path: Where the ONNX file goes.
        layers: Transformer blocks.
        width: Model width C (a multiple of ``heads``).
        heads: Attention heads.
        vocab: Vocabulary size V.
        seq: Sequence length T (fixed: the causal mask is a Constant).
        batch: Batch dimension B: an int, or a name for a symbolic one (not with ``flat_logits``).
        seed: Weight seed.
        mlp: ``matmul`` or ``gemm`` (module docstring).
        mlp_ratio: MLP hidden width / C.
        tied: LM head tied to the token table.
        flat_logits: Logits reshaped to ``[B*T, V]``.
        sizes: ``tuple`` or ``each`` (module docstring).
        embed_std: Standard deviation of the token table.
        head_std: Standard deviation of an untied LM head.
    """
    if mlp not in ("matmul", "gemm") or sizes not in ("tuple", "each"):
        raise ValueError(f"mlp {mlp!r} / sizes {sizes!r}: use mlp matmul|gemm and sizes tuple|each")
    if flat_logits and not isinstance(batch, int):
        raise ValueError("flat_logits needs a fixed (int) batch")
    head_dim = width // heads
    b = Builder(seed)
    wte = b.param("transformer.wte.weight", (vocab, width), std=embed_std)
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0),
                     b.param("transformer.wpe.weight", (seq, width), std=0.1)])  # fmt: skip

    def dims(t: str) -> tuple[str, str]:  # B and T of t as 1-element int64 tensors
        shape = b.op("Shape", [t]) if sizes == "tuple" else None
        out = []
        for k in (0, 1):
            of = shape if shape is not None else b.op("Shape", [t])
            out.append(b.op("Unsqueeze", [b.op("Gather", [of, b.const(k)], axis=0), b.const([0])]))
        return out[0], out[1]

    def gemm(t: str, prefix: str, fan_in: int, fan_out: int) -> str:  # nn.Linear on [N, fan_in]
        w = b.param(f"{prefix}.weight", (fan_out, fan_in), std=1.0 / math.sqrt(fan_in))
        return b.op("Gemm", [t, w, b.param(f"{prefix}.bias", (fan_out,), std=0.1)], alpha=1.0, beta=1.0, transB=1)

    hidden_width = mlp_ratio * width
    for i in range(layers):
        p = f"transformer.h.{i}"
        qkv = b.linear(b.layer_norm(x, f"{p}.ln_1", width), f"{p}.attn.c_attn", width, 3 * width)
        q, k, v = b.op("Split", [qkv, b.const([width] * 3)], num_outputs=3, axis=2)
        parts = []
        for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])):
            bsz, length = dims(t)
            shape = b.op("Concat", [bsz, length, b.const([heads]), b.const([head_dim])], axis=0)
            parts.append(b.op("Transpose", [b.op("Reshape", [t, shape])], perm=perm))
        scores = b.op("Div", [b.op("MatMul", parts[:2]), b.const(math.sqrt(head_dim), np.float32)])
        mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
        probs = b.op("Softmax", [b.op("Add", [scores, b.const(mask, np.float32)])], axis=-1)
        context = b.op("Transpose", [b.op("MatMul", [probs, parts[2]])], perm=[0, 2, 1, 3])
        bsz, length = dims(x)
        merged = b.op("Reshape", [context, b.op("Concat", [bsz, length, b.const([width])], axis=0)])
        x = b.op("Add", [x, b.linear(merged, f"{p}.attn.c_proj", width, width)])
        h = b.layer_norm(x, f"{p}.ln_2", width)
        if mlp == "matmul":
            hidden = b.op("Tanh", [b.linear(h, f"{p}.mlp.c_fc", width, hidden_width)])
            x = b.op("Add", [x, b.linear(hidden, f"{p}.mlp.c_proj", hidden_width, width)])
        else:
            tokens = b.op("Unsqueeze", [b.op("Mul", [b.op("Gather", [b.op("Shape", [h]), b.const(0)], axis=0),
                                                     b.op("Gather", [b.op("Shape", [h]), b.const(1)], axis=0)]),
                                        b.const([0])])  # fmt: skip
            flat = b.op("Reshape", [h, b.op("Concat", [tokens, b.const([width])], axis=0)])  # [B*T, C]
            hidden = b.op("Tanh", [gemm(flat, f"{p}.mlp.c_fc", width, hidden_width)])
            out = gemm(hidden, f"{p}.mlp.c_proj", hidden_width, width)
            x = b.op("Add", [x, b.op("Reshape", [out, b.op("Shape", [x])])])
    x = b.layer_norm(x, "transformer.ln_f", width)
    head = b.op("Transpose", [wte], perm=[1, 0]) if tied else b.param("lm_head.weight", (width, vocab), std=head_std)
    logits = b.op("MatMul", [x, head])
    shape = [batch, seq, vocab]
    if flat_logits:
        logits, shape = b.op("Reshape", [logits, b.const([-1, vocab])]), [batch * seq, vocab]
    return b.save(path, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)], {logits: "logits"})


def gpt2_style(path, vocab: int = 13, seq_len: int = 4, width: int = 8, heads: int = 2, batch: int | str = "batch",
               seed: int = 0):
    """One GPT-2 block with a tied LM head, [B, T, V] logits and, by default, a symbolic batch."""
    return gpt(path, layers=1, width=width, heads=heads, vocab=vocab, seq=seq_len, batch=batch, seed=seed,
               mlp_ratio=2, tied=True, embed_std=0.5)  # fmt: skip


def torch_gpt(path, *, layers: int = 2, width: int = 32, heads: int = 4, vocab: int = 256, seq: int = 16,
              batch: int = 2, seed: int = 0):
    """A GPT-2 stack for training: fixed batch, untied LM head, logits flattened to [B*T, V]."""
    return gpt(path, layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch, seed=seed,
               flat_logits=True)


def gemm_tied_gpt(path, *, layers: int = 1, width: int = 16, heads: int = 2, vocab: int = 32, seq: int = 8,
                  batch: int = 2, seed: int = 0, tied: bool = True):
    """The MLP as Gemm on flattened tokens, a size read per dimension, [B, T, V] logits; tied unless told."""
    return gpt(path, layers=layers, width=width, heads=heads, vocab=vocab, seq=seq, batch=batch, seed=seed,
               mlp="gemm", tied=tied, sizes="each", embed_std=0.3, head_std=0.3)
