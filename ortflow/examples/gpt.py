"""A small GPT-style decoder as an ONNX model, built with ``onnx.helper`` (no torch).

``input_ids`` int64 [B, T] -> ``logits`` float32 [B*T, V]. The logits are flattened so the engine's
CrossEntropyLoss takes labels of shape [B*T] (it needs 2-D scores). Byte-level by default (V = 256).

The graph keeps to what the engine's gradient builder handles correctly (docs/engine.md):

* Q, K and V come from three MatMuls, never from a Split (a Split with an unused output gets wrong gradients);
* LayerNormalization declares all three outputs;
* GELU uses the Erf formulation;
* every float constant (the causal mask, scales) is a Constant node, not an initializer, because the engine trains
  every float initializer by default.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.examples.mlp import save_model

_INIT_STD = 0.02


class _Graph:
    """Collects nodes and initializers; names every intermediate value after the layer it belongs to."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def param(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def normal(self, name: str, shape: tuple[int, ...], std: float = _INIT_STD) -> str:
        return self.param(name, self.rng.standard_normal(shape) * std)

    def const(self, name: str, value: np.ndarray) -> str:
        self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
        return name

    def op(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def linear(self, x: str, prefix: str, fan_in: int, fan_out: int, std: float = _INIT_STD) -> str:
        w = self.normal(f"{prefix}.weight", (fan_in, fan_out), std)
        b = self.param(f"{prefix}.bias", np.zeros(fan_out))
        return self.op("Add", [self.op("MatMul", [x, w], f"{prefix}.mm"), b], f"{prefix}.out")

    def layer_norm(self, x: str, prefix: str, width: int) -> str:
        gamma = self.param(f"{prefix}.weight", np.ones(width))
        beta = self.param(f"{prefix}.bias", np.zeros(width))
        out = f"{prefix}.out"
        # All three outputs declared: the engine cannot build the gradient of a LayerNormalization without them.
        self.nodes.append(
            helper.make_node(
                "LayerNormalization",
                [x, gamma, beta],
                [out, f"{prefix}.mean", f"{prefix}.inv_std"],
                name=prefix,
                axis=-1,
                epsilon=1e-5,
            )
        )
        return out


def build_gpt(
    path: Path | str,
    vocab_size: int = 256,
    seq_len: int = 64,
    d_model: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Write a pre-LayerNorm GPT decoder: embeddings, causal self-attention + GELU MLP blocks, LM head.

    Weights are drawn from N(0, 0.02) (output projections scaled by 1/sqrt(2 * num_layers), as in GPT-2), so the
    initial cross-entropy is close to ln(vocab_size).

    Args:
        path: Where to write the ``.onnx`` file (parent folders are created).
        vocab_size: Number of token ids V.
        seq_len: Fixed sequence length T of ``input_ids`` (the position table has T rows).
        d_model: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Attention heads; must divide d_model.
        seed: Seed of the weight initialisation.

    Returns:
        The path written.

    Raises:
        ValueError: If num_heads does not divide d_model.
    """
    if d_model % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    head_dim = d_model // num_heads
    g = _Graph(np.random.default_rng(seed))
    proj_std = _INIT_STD / math.sqrt(2 * num_layers)

    # Shapes for Reshape: 0 copies the (dynamic) batch dimension.
    split_heads = g.const("shape.split_heads", np.array([0, seq_len, num_heads, head_dim], np.int64))
    merge_heads = g.const("shape.merge_heads", np.array([0, seq_len, d_model], np.int64))
    flat_logits = g.const("shape.flat_logits", np.array([-1, vocab_size], np.int64))
    causal = np.triu(np.full((seq_len, seq_len), -1e9, np.float32), k=1)
    mask = g.const("attn.causal_mask", causal)
    scale = g.const("attn.scale", np.array(1.0 / math.sqrt(head_dim), np.float32))
    half = g.const("gelu.half", np.array(0.5, np.float32))
    one = g.const("gelu.one", np.array(1.0, np.float32))
    inv_sqrt2 = g.const("gelu.inv_sqrt2", np.array(1.0 / math.sqrt(2.0), np.float32))

    tok = g.op("Gather", [g.normal("wte.weight", (vocab_size, d_model)), "input_ids"], "wte.out", axis=0)
    x = g.op("Add", [tok, g.normal("wpe.weight", (seq_len, d_model))], "embed.out")

    for i in range(num_layers):
        p = f"h{i}"
        h = g.layer_norm(x, f"{p}.ln_1", d_model)
        heads = {}
        for name in ("q", "k", "v"):
            y = g.linear(h, f"{p}.attn.{name}", d_model, d_model)
            y = g.op("Reshape", [y, split_heads], f"{p}.attn.{name}.split")
            # q, v: [B, H, T, Dh]; k: [B, H, Dh, T] so that q @ k gives [B, H, T, T].
            perm = [0, 2, 3, 1] if name == "k" else [0, 2, 1, 3]
            heads[name] = g.op("Transpose", [y], f"{p}.attn.{name}.heads", perm=perm)
        scores = g.op("MatMul", [heads["q"], heads["k"]], f"{p}.attn.scores")
        scores = g.op("Mul", [scores, scale], f"{p}.attn.scaled")
        scores = g.op("Add", [scores, mask], f"{p}.attn.masked")
        probs = g.op("Softmax", [scores], f"{p}.attn.probs", axis=-1)
        att = g.op("MatMul", [probs, heads["v"]], f"{p}.attn.context")
        att = g.op("Transpose", [att], f"{p}.attn.context.t", perm=[0, 2, 1, 3])
        att = g.op("Reshape", [att, merge_heads], f"{p}.attn.merged")
        x = g.op("Add", [x, g.linear(att, f"{p}.attn.proj", d_model, d_model, proj_std)], f"{p}.resid_attn")

        h = g.layer_norm(x, f"{p}.ln_2", d_model)
        h = g.linear(h, f"{p}.mlp.fc", d_model, 4 * d_model)
        # GELU(h) = 0.5 * h * (1 + erf(h / sqrt(2)))
        erf = g.op("Erf", [g.op("Mul", [h, inv_sqrt2], f"{p}.mlp.gelu.scaled")], f"{p}.mlp.gelu.erf")
        gate = g.op("Mul", [g.op("Add", [erf, one], f"{p}.mlp.gelu.add"), half], f"{p}.mlp.gelu.gate")
        h = g.op("Mul", [h, gate], f"{p}.mlp.gelu.out")
        x = g.op("Add", [x, g.linear(h, f"{p}.mlp.proj", 4 * d_model, d_model, proj_std)], f"{p}.resid_mlp")

    x = g.layer_norm(x, "ln_f", d_model)
    logits = g.op("MatMul", [x, g.normal("lm_head.weight", (d_model, vocab_size))], "lm_head.out")
    g.op("Reshape", [logits, flat_logits], "logits")

    graph = helper.make_graph(
        g.nodes,
        "gpt",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq_len])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["tokens", vocab_size])],
        g.initializers,
    )
    return save_model(graph, path)
