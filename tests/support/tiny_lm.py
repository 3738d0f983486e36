"""Models shaped like ``torch.onnx.export`` output, for the mixed-precision tests (built with ``onnx.helper``).

``build_tiny_lm`` is a one-block decoder the way torch exports it: a tied embedding (the same initializer read by
Gather and, transposed, by the LM head), LayerNormalization with only its ``Y`` output, MatMul+Add linears,
Softmax attention scaled by a Div and masked by a Where with a -inf Constant, Erf GELU, shape arithmetic from
Shape/Gather/Unsqueeze/Concat Constants into Reshape, and [B, T, V] logits (optionally flattened to [B*T, V] for the
engine's cross entropy). Fixed batch dimension, as torch writes it without dynamic_axes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _const(nodes: list, name: str, value: np.ndarray) -> str:
    nodes.append(helper.make_node("Constant", [], [name], name=f"/{name}", value=numpy_helper.from_array(value, name)))
    return name


def build_tiny_lm(
    vocab: int = 32, seq: int = 8, d: int = 16, batch: int = 2, flatten: bool = False, full_layer_norm: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """The decoder block described in the module docstring, as a ModelProto (opset 17, IR 8).

    Args:
        vocab: Vocabulary size V.
        seq: Sequence length T.
        d: Model width.
        batch: The fixed batch dimension B.
        flatten: Reshape the logits to [B*T, V] (what the engine's CrossEntropyLoss needs) instead of [B, T, V].
        full_layer_norm: Declare Mean and InvStdDev outputs (the engine's gradient builder needs them).
        seed: Weight seed.
    """
    rng = np.random.default_rng(seed)
    inits = []

    def param(name: str, shape: tuple[int, ...], std: float = 0.1) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * std).astype(np.float32), name))
        return name

    nodes: list[onnx.NodeProto] = []

    def op(op_type: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(op_type, inputs, [name], name=f"/{name}", **attrs))
        return name

    wte = param("transformer.wte.weight", (vocab, d))
    x = op("Gather", [wte, "input_ids"], "wte_out", axis=0)
    x = op("Add", [x, param("transformer.wpe.weight", (seq, d))], "embed")
    ln_out = ["ln_out", "ln_mean", "ln_inv_std"] if full_layer_norm else ["ln_out"]
    nodes.append(helper.make_node("LayerNormalization", [x, param("ln.weight", (d,), 1.0), param("ln.bias", (d,))],
                                  ln_out, name="/ln/LayerNormalization", axis=-1, epsilon=1e-5))
    h = "ln_out"
    # torch's shape arithmetic: Shape -> Gather(0) -> Unsqueeze -> Concat with constants -> Reshape.
    shape = op("Shape", [h], "shape")
    b = op("Gather", [shape, _const(nodes, "zero", np.array(0, np.int64))], "batch_dim", axis=0)
    b = op("Unsqueeze", [b, _const(nodes, "axes0", np.array([0], np.int64))], "batch_dim_1d")
    heads_shape = op("Concat", [b, _const(nodes, "rest", np.array([seq, 2, d // 2], np.int64))], "heads_shape", axis=0)
    qkv = {}
    for name in ("q", "k", "v"):
        y = op("MatMul", [h, param(f"attn.{name}.weight", (d, d))], f"{name}_mm")
        y = op("Add", [y, param(f"attn.{name}.bias", (d,))], f"{name}_lin")
        y = op("Reshape", [y, heads_shape], f"{name}_split")
        qkv[name] = op("Transpose", [y], f"{name}_heads", perm=[0, 2, 1, 3])
    kt = op("Transpose", [qkv["k"]], "k_t", perm=[0, 1, 3, 2])
    scores = op("MatMul", [qkv["q"], kt], "scores")
    scores = op("Div", [scores, _const(nodes, "sqrt_dh", np.array(math.sqrt(d // 2), np.float32))], "scaled")
    causal = _const(nodes, "causal", np.tril(np.ones((seq, seq), bool)))
    scores = op("Where", [causal, scores, _const(nodes, "neg_inf", np.array(-np.inf, np.float32))], "masked")
    probs = op("Softmax", [scores], "probs", axis=-1)
    ctx = op("MatMul", [probs, qkv["v"]], "context")
    ctx = op("Transpose", [ctx], "context_t", perm=[0, 2, 1, 3])
    ctx = op("Reshape", [ctx, _const(nodes, "merge", np.array([batch, seq, d], np.int64))], "merged")
    x = op("Add", [x, op("MatMul", [ctx, param("attn.proj.weight", (d, d))], "proj")], "resid1")
    # GELU as torch exports it: x * 0.5 * (1 + erf(x / sqrt(2))).
    fc = op("Add", [op("MatMul", [x, param("mlp.fc.weight", (d, 2 * d))], "fc_mm"), param("mlp.fc.bias", (2 * d,))],
            "fc")
    erf = op("Erf", [op("Div", [fc, _const(nodes, "sqrt2", np.array(math.sqrt(2), np.float32))], "gelu_div")], "erf")
    erf1 = op("Add", [erf, _const(nodes, "one", np.array(1.0, np.float32))], "erf1")
    gelu = op("Mul", [op("Mul", [fc, erf1], "gelu_mul"), _const(nodes, "half", np.array(0.5, np.float32))], "gelu")
    x = op("Add", [x, op("MatMul", [gelu, param("mlp.proj.weight", (2 * d, d))], "mlp_out")], "resid2")
    # Tied LM head: the embedding read a second time, transposed.
    logits = op("MatMul", [x, op("Transpose", [wte], "wte_t", perm=[1, 0])], "logits_btv")
    if flatten:
        logits = op("Reshape", [logits, _const(nodes, "flat", np.array([-1, vocab], np.int64))], "logits")
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch * seq, vocab])
    else:
        nodes[-1].output[0] = "logits"
        out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, vocab])
    graph = helper.make_graph(nodes, "main_graph",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])], [out],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pytorch")
    model.ir_version = 8
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    """Write the model (parent folders created) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
