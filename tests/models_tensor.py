"""Models and a one-process simulation for the tensor-parallel split (no MPI: the ranks' all-reduce is a sum here).

The torch-export-shaped model is :func:`tests.models_export.gpt2_style` (fused QKV Linear + Split, single-output
LayerNormalization, Shape/Gather/Unsqueeze/Concat head reshapes on Constants, tied embedding / LM head).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from ortflow.graph.tensor_parallel import plan_tensor_split
from ortflow.graph.tensor_pieces import cut_pieces
from ortflow.graph.tensor_shard import shard_model


def trainable(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]


def run_pieces(model: onnx.ModelProto, size: int, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output computed by ``size`` simulated ranks, piece by piece, partial sums added in rank
    order (what the all-reduce does)."""
    names = trainable(model)
    plan = plan_tensor_split(model, names, size)
    ranks = [cut_pieces(shard_model(model, plan, r), plan, model, names) for r in range(size)]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    envs = [dict(feeds) for _ in range(size)]
    for k in range(len(ranks[0])):
        outs = []
        for r in range(size):
            stage = ranks[r][k].stage
            session = ort.InferenceSession(stage.model.SerializeToString(), options)
            values = session.run(list(stage.sends), {i.name: envs[r][i.name] for i in session.get_inputs()})
            outs.append(dict(zip(stage.sends, values, strict=True)))
        if ranks[0][k].parallel:
            summed = {n: sum(o[n] for o in outs[1:]) + outs[0][n] for n in outs[0]}
            outs = [summed] * size
        for r in range(size):
            envs[r].update(outs[r])
    return envs[0][model.graph.output[0].name]


def run_whole(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options).run(None, feeds)[0]


def torch_gpt(path, *, layers: int = 2, width: int = 32, heads: int = 4, vocab: int = 256, seq: int = 16,
              batch: int = 2, seed: int = 0):
    """A GPT-2 stack as ``torch.onnx.export`` writes it, for training: fixed batch, fused QKV Linear + Split (all
    parts used), single-output LayerNormalization, Shape/Gather/Unsqueeze/Concat head reshapes on Constants, tanh MLP,
    an untied LM head and [B, T, V] logits flattened to [B*T, V] by a Constant-fed Reshape."""
    import math

    from onnx import TensorProto, helper

    from .models_export import Builder

    head_dim = width // heads
    b = Builder(seed)
    wte = b.param("transformer.wte.weight", (vocab, width), std=0.1)
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"], axis=0), b.param("transformer.wpe.weight", (seq, width),
                                                                            std=0.1)])

    def dims_of(t: str) -> tuple[str, str]:
        shape = b.op("Shape", [t])
        return (b.op("Unsqueeze", [b.op("Gather", [shape, b.const(0)], axis=0), b.const([0])]),
                b.op("Unsqueeze", [b.op("Gather", [shape, b.const(1)], axis=0), b.const([0])]))

    for i in range(layers):
        p = f"transformer.h.{i}"
        qkv = b.linear(b.layer_norm(x, f"{p}.ln_1", width), f"{p}.attn.c_attn", width, 3 * width)
        q, k, v = b.op("Split", [qkv, b.const([width, width, width])], num_outputs=3, axis=2)
        parts = []
        for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])):
            bsz, length = dims_of(t)
            shape = b.op("Concat", [bsz, length, b.const([heads]), b.const([head_dim])], axis=0)
            parts.append(b.op("Transpose", [b.op("Reshape", [t, shape])], perm=perm))
        scores = b.op("Div", [b.op("MatMul", parts[:2]), b.const(math.sqrt(head_dim), np.float32)])
        mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
        probs = b.op("Softmax", [b.op("Add", [scores, b.const(mask, np.float32)])], axis=-1)
        context = b.op("Transpose", [b.op("MatMul", [probs, parts[2]])], perm=[0, 2, 1, 3])
        bsz, length = dims_of(x)
        merged = b.op("Reshape", [context, b.op("Concat", [bsz, length, b.const([width])], axis=0)])
        x = b.op("Add", [x, b.linear(merged, f"{p}.attn.c_proj", width, width)])
        hidden = b.op("Tanh", [b.linear(b.layer_norm(x, f"{p}.ln_2", width), f"{p}.mlp.c_fc", width, 4 * width)])
        x = b.op("Add", [x, b.linear(hidden, f"{p}.mlp.c_proj", 4 * width, width)])
    x = b.layer_norm(x, "transformer.ln_f", width)
    logits = b.op("MatMul", [x, b.param("lm_head.weight", (width, vocab), std=0.1)])
    flat = b.op("Reshape", [logits, b.const([-1, vocab])])
    return b.save(path, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch * seq, vocab])],
                  {flat: "logits"})
