"""A model shaped like torch.onnx.export output, for the optimizer and checkpoint tests (built with onnx.helper).

Tied embedding (used by Gather and, transposed, by the LM head MatMul), LayerNormalization (its Mean/InvStdDev
outputs declared, as the engine's gradient builder needs), Constant-heavy shape arithmetic into Reshape, fixed batch
dims, [B, T, V] logits flattened to [B*T, V] for the loss, a bias and a LayerNorm weight (names that
``no_weight_decay`` patterns match).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BATCH, SEQ, VOCAB, DIM = 2, 4, 11, 7  # odd sizes: tensors end in a partial SIMD packet


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name + "_v"))


def build_tied_lm(path: Path, seed: int = 0) -> Path:
    """Write the model: input_ids int64 [2, 4] -> logits float32 [8, 11]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((VOCAB, DIM)) * 0.3).astype(np.float32), "embed.weight"),
        numpy_helper.from_array((rng.standard_normal((DIM, DIM)) * 0.3).astype(np.float32), "fc.weight"),
        numpy_helper.from_array((rng.standard_normal(DIM) * 0.1).astype(np.float32), "fc.bias"),
        numpy_helper.from_array(np.ones(DIM, np.float32), "ln.weight"),
        numpy_helper.from_array(np.zeros(DIM, np.float32), "ln.bias"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed.weight", "input_ids"], ["h0"]),
        helper.make_node("MatMul", ["h0", "fc.weight"], ["h1"]),
        helper.make_node("Add", ["h1", "fc.bias"], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["h3"]),
        helper.make_node("LayerNormalization", ["h3", "ln.weight", "ln.bias"], ["h4", "ln_mean", "ln_inv"], axis=-1),
        helper.make_node("Transpose", ["embed.weight"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h4", "embed_t"], ["logits_btv"]),
        # torch.onnx.export style shape arithmetic: Shape -> Gather -> Mul -> Concat -> Reshape
        helper.make_node("Shape", ["logits_btv"], ["shape"]),
        _const("i0", np.array(0, np.int64)),
        _const("i1", np.array(1, np.int64)),
        _const("i2", np.array([2], np.int64)),
        helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "i1"], ["t"], axis=0),
        helper.make_node("Mul", ["b", "t"], ["bt"]),
        helper.make_node("Unsqueeze", ["bt", "zero_axis"], ["bt1"]),
        _const("zero_axis", np.array([0], np.int64)),
        helper.make_node("Slice", ["shape", "i2", "end"], ["v"]),
        _const("end", np.array([3], np.int64)),
        helper.make_node("Concat", ["bt1", "v"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["logits_btv", "new_shape"], ["logits"]),
    ]
    # Constants first, as exporters emit them before use.
    nodes = [n for n in nodes if n.op_type == "Constant"] + [n for n in nodes if n.op_type != "Constant"]
    graph = helper.make_graph(
        nodes, "tied_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH, SEQ])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH * SEQ, VOCAB])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Path(path)


def lm_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids [2, 4], labels [8]) for :func:`build_tied_lm`."""
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    return ids, rng.integers(0, VOCAB, BATCH * SEQ).astype(np.int64)


TRAINABLE = ("embed.weight", "fc.bias", "fc.weight", "ln.bias", "ln.weight")
