"""The ONNX graph builder of the tests (:class:`Builder`), and small models shaped like ``torch.onnx.export`` output.

Opset 17, IR 9, built with ``onnx.helper``, no torch (GPTs: :mod:`tests.support.gpt`). Each model writes the patterns
the engine stumbles on in users' exports: LayerNormalization with only ``Y``, Dropout with only ``output``, Split with
an unused output, fixed batch dims, ``[B, T, V]`` logits, Constant-heavy shape arithmetic (Shape/Gather/Unsqueeze/
Concat) feeding Reshape, and tied embedding / LM-head weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9


class Builder:
    """Nodes, initializers and Constant nodes of one graph; each op gets a readable name like torch's exporter."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def param(self, name: str, shape: tuple[int, ...], std: float = 0.3, value: np.ndarray | None = None) -> str:
        data = self.rng.standard_normal(shape) * std if value is None else value
        self.inits.append(numpy_helper.from_array(np.asarray(data, np.float32), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A Constant node, as torch writes for shape arithmetic and scalars."""
        self._count += 1
        name = f"/Constant_{self._count}_output_0"
        tensor = numpy_helper.from_array(np.asarray(value, dtype), name)
        self.nodes.append(helper.make_node("Constant", [], [name], name=f"/Constant_{self._count}", value=tensor))
        return name

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, **attrs) -> str | list[str]:
        self._count += 1
        base = f"/{op_type}_{self._count}"
        outputs = [f"{base}_output_{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=base, **attrs))
        return outputs[0] if num_outputs == 1 else outputs

    def layer_norm(self, x: str, prefix: str, width: int) -> str:
        """torch's export: LayerNormalization with only its Y output."""
        gamma = self.param(f"{prefix}.weight", (width,), value=1.0 + 0.1 * self.rng.standard_normal(width))
        beta = self.param(f"{prefix}.bias", (width,), std=0.1)
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)

    def linear(self, x: str, prefix: str, fan_in: int, fan_out: int) -> str:
        w = self.param(f"{prefix}.weight", (fan_in, fan_out), std=1.0 / math.sqrt(fan_in))
        return self.op("Add", [self.op("MatMul", [x, w]), self.param(f"{prefix}.bias", (fan_out,), std=0.1)])

    def save(self, path: Path | str, inputs: list, outputs: list, rename: dict[str, str]) -> Path:
        """Write the model; ``rename`` maps internal tensor names to the graph output names."""
        for node in self.nodes:
            node.output[:] = [rename.get(o, o) for o in node.output]
            node.input[:] = [rename.get(i, i) for i in node.input]
        graph = helper.make_graph(self.nodes, "main_graph", inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pytorch")
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model, full_check=True)
        path = Path(path)
        onnx.save(model, str(path))
        return path


def layernorm_classifier(path, features: int = 6, hidden: int = 8, classes: int = 3, batch: int | str = "batch",
                         dropout: bool = False, seed: int = 0) -> Path:
    """x [batch, F] -> Linear -> LayerNormalization (Y only) -> [Dropout (output only)] -> Relu -> Linear -> logits.

    ``batch`` fixed (an int) is what torch writes without ``dynamic_axes``. The Dropout (ratio 0, training_mode
    true, as a training-mode export writes it) is an identity, so gradients stay deterministic.
    """
    b = Builder(seed)
    h = b.layer_norm(b.linear("x", "fc1", features, hidden), "ln", hidden)
    if dropout:
        h = b.op("Dropout", [h, b.const(0.0, np.float32), b.const(True, np.bool_)])
    logits = b.linear(b.op("Relu", [h]), "fc2", hidden, classes)
    return b.save(path, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], {logits: "logits"})


def split_unused_classifier(path, features: int = 6, part: int = 4, classes: int = 3, seed: int = 0,
                            sizes_input: bool = True) -> Path:
    """x -> Linear to 3 parts -> Split (3 outputs, the middle one unused) -> first * sigmoid(last) -> Linear.

    ``sizes_input``: the split sizes as a Constant input (torch's export); else an equal split without sizes.
    """
    b = Builder(seed)
    h = b.linear("x", "fc1", features, 3 * part)
    inputs = [h, b.const([part, part, part])] if sizes_input else [h]
    first, _unused, last = b.op("Split", inputs, num_outputs=3, axis=1)
    gated = b.op("Mul", [first, b.op("Sigmoid", [last])])
    logits = b.linear(gated, "fc2", part, classes)
    return b.save(path, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
                  {logits: "logits"})


def token_lm(path, vocab: int = 11, seq_len: int = 5, width: int = 8, batch: int | str = "batch",
             seed: int = 0) -> Path:
    """input_ids [batch, T] -> embedding -> LayerNormalization (Y only) -> Linear -> logits [batch, T, V]."""
    b = Builder(seed)
    emb = b.op("Gather", [b.param("embed.weight", (vocab, width), std=0.5), "input_ids"], axis=0)
    logits = b.linear(b.layer_norm(emb, "ln", width), "head", width, vocab)
    return b.save(path, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq_len])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq_len, vocab])],
                  {logits: "logits"})



def batchnorm_classifier(path, features: int = 4, hidden: int = 6, classes: int = 3, training_mode: bool = False,
                         seed: int = 0) -> Path:
    """x -> Linear -> BatchNormalization (inference mode, as an ``eval()`` export writes it) -> Relu -> Linear.

    ``training_mode``: the same graph with BatchNormalization in training mode (batch statistics, 3 outputs), the
    reference for what the engine's training graph computes.
    """
    b = Builder(seed)
    h = b.linear("x", "fc1", features, hidden)
    stats = [b.param("bn.weight", (hidden,), value=1 + 0.2 * b.rng.standard_normal(hidden)),
             b.param("bn.bias", (hidden,), std=0.1),
             b.param("bn.running_mean", (hidden,), std=0.1),
             b.param("bn.running_var", (hidden,), value=1 + 0.1 * b.rng.random(hidden))]
    if training_mode:
        h = b.op("BatchNormalization", [h, *stats], num_outputs=3, training_mode=1)[0]
    else:
        h = b.op("BatchNormalization", [h, *stats])
    logits = b.linear(b.op("Relu", [h]), "fc2", hidden, classes)
    return b.save(path, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], {logits: "logits"})
