"""Models shaped like ``torch.onnx.export`` output, for the pipeline split (built with ``onnx.helper``).

A small decoder-style stack: token embedding (Gather), per block a LayerNormalization, shape arithmetic
(Shape -> Gather -> Unsqueeze -> Concat with Constants -> Reshape) around a 2-D MatMul, GELU (Erf), a residual Add;
a final LayerNormalization and an LM head that is either its own weight or the embedding used twice (tied, through
Transpose), with [B, T, V] logits flattened by a Constant-fed Reshape. Batch and sequence dimensions are fixed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

B, T, V, D = 2, 8, 32, 16


def build_torchlike(path: Path | None = None, *, num_blocks: int = 2, tied: bool = False, dropout: bool = False,
                    ln_outputs: int = 3, vocab: int = V, seed: int = 0, routed: bool = False) -> onnx.ModelProto:
    """The model (saved to ``path`` when given). ``ln_outputs=1`` is torch's single-output LayerNormalization.
    ``routed``: block 0 also computes ``blocks.0.top = ArgMax`` of its LayerNorm output, which the final LayerNorm's
    input reads (an int64 tensor that depends on trained values: no pipeline cut between the two can carry it)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def param(name, shape, scale=0.1):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name, value):
        nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name)))
        return name

    def op(kind, inputs, output, **attrs):
        nodes.append(helper.make_node(kind, inputs, [output], name=f"/{kind}_{output}", **attrs))
        return output

    def layer_norm(x, prefix):
        gamma = numpy_helper.from_array(np.ones(D, np.float32), f"{prefix}.weight")
        beta = numpy_helper.from_array(np.zeros(D, np.float32), f"{prefix}.bias")
        inits.extend([gamma, beta])
        outs = [f"{prefix}.out", f"{prefix}.mean", f"{prefix}.inv_std"][:ln_outputs]
        nodes.append(helper.make_node("LayerNormalization", [x, gamma.name, beta.name], outs, name=f"/{prefix}/LN",
                                      axis=-1, epsilon=1e-5))
        return outs[0]

    wte = param("wte", (vocab, D))
    x = op("Gather", [wte, "input_ids"], "embed", axis=0)
    for i in range(num_blocks):
        p = f"blocks.{i}"
        h = layer_norm(x, f"{p}.ln")
        if routed and i == 0:
            top = op("ArgMax", [h], f"{p}.top", axis=-1, keepdims=1)
        # torch exports flatten [B, T, D] -> [B*T, D] for the 2-D MatMul and read the shape back from the tensor.
        shape = op("Shape", [h], f"{p}.shape")
        lead = op("Gather", [shape, const(f"{p}.idx0", np.array(0, np.int64))], f"{p}.b", axis=0)
        lead = op("Unsqueeze", [lead, const(f"{p}.axes", np.array([0], np.int64))], f"{p}.b1")
        back = op("Concat", [lead, const(f"{p}.td", np.array([T, D], np.int64))], f"{p}.shape_back", axis=0)
        flat = op("Reshape", [h, const(f"{p}.flat", np.array([-1, D], np.int64))], f"{p}.flat_in")
        mm = op("MatMul", [flat, param(f"{p}.fc.weight", (D, D))], f"{p}.mm")
        mm = op("Add", [mm, param(f"{p}.fc.bias", (D,))], f"{p}.fc")
        erf = op("Erf", [op("Mul", [mm, const(f"{p}.isq2", np.array(0.70710677, np.float32))], f"{p}.s")], f"{p}.e")
        gate = op("Mul", [op("Add", [erf, const(f"{p}.one", np.array(1.0, np.float32))], f"{p}.e1"),
                          const(f"{p}.half", np.array(0.5, np.float32))], f"{p}.g")
        act = op("Mul", [mm, gate], f"{p}.gelu")
        if dropout:
            act = op("Dropout", [act], f"{p}.drop")
        x = op("Add", [x, op("Reshape", [act, back], f"{p}.unflat")], f"{p}.resid")
    if routed:
        route = op("Cast", [top], "route", to=TensorProto.FLOAT)
        x = op("Add", [x, op("Mul", [route, const("route_scale", np.array(1e-3, np.float32))], "route_s")], "routed")
    h = layer_norm(x, "ln_f")
    head = op("Transpose", [wte], "wte_t", perm=[1, 0]) if tied else param("lm_head.weight", (D, vocab))
    logits = op("MatMul", [h, head], "logits_3d")
    op("Reshape", [logits, const("flat_logits", np.array([-1, vocab], np.int64))], "logits")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [B, T])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B * T, vocab])
    graph = helper.make_graph(nodes, "torchlike", [ids], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, str(path))
    return model


def trainable(model: onnx.ModelProto) -> list[str]:
    """Every float initializer (ortflow trains them all by default)."""
    return sorted(t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)
