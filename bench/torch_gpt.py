"""The benchmark's GPT, defined once in PyTorch and exported to ONNX so that ortflow and PyTorch DDP train literally
the same architecture from the same initial weights.

It mirrors ``ortflow.examples.gpt`` op for op: token + position embeddings, pre-LayerNorm blocks with causal
self-attention (Q, K, V from three MatMuls, never a Split) and an erf-GELU MLP, a final LayerNorm and an LM head;
``input_ids`` int64 [B, T] -> ``logits`` float32 [B*T, V]. Linear weights are stored [in, out] and applied as
``x @ W + b`` so that the export is a plain MatMul + Add on the parameter itself (names survive the export).

:func:`export_onnx` uses the legacy TorchScript exporter and then makes the graph trainable by the engine
(docs/engine.md): every LayerNormalization declares its mean and inv_std outputs, and every initializer that
is not a parameter (the causal mask) becomes a Constant node, because the engine trains every float initializer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OPSET = 17  # LayerNormalization exists from 17; <= 21 as the engine requires
IR_VERSION = 8


@dataclass(frozen=True)
class GPTShape:
    """The model's size."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4

    def num_params(self) -> int:
        """Trainable parameters."""
        d, v, t = self.d_model, self.vocab_size, self.seq_len
        per_layer = 4 * d + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + self.num_layers * per_layer + 2 * d + d * v

    def train_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token: 6 x (matmul parameters) + 6 x attention (QK^T and PV)."""
        d, v, t, n = self.d_model, self.vocab_size, self.seq_len, self.num_layers
        matmul_params = n * 12 * d * d + d * v  # embeddings are gathers, not matmuls
        attention = n * 2 * 2 * t * d  # QK^T and PV: 2 FLOPs per MAC, T keys per query, d wide (full, unmasked)
        return 6.0 * matmul_params + 3.0 * attention

    def as_dict(self) -> dict:
        return asdict(self)


class Linear(nn.Module):
    """``x @ W + b`` with W stored [in, out], as ortflow's ONNX example does."""

    def __init__(self, fan_in: int, fan_out: int, std: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_in, fan_out) * std)
        self.bias = nn.Parameter(torch.zeros(fan_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        return y + self.bias if self.bias is not None else y


class Block(nn.Module):
    def __init__(self, s: GPTShape, proj_std: float):
        super().__init__()
        d = s.d_model
        self.s = s
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.q, self.k, self.v = (Linear(d, d, 0.02) for _ in range(3))
        self.proj = Linear(d, d, proj_std)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.fc = Linear(d, 4 * d, 0.02)
        self.mlp_proj = Linear(4 * d, d, proj_std)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.s
        t, h, dh = s.seq_len, s.num_heads, s.d_model // s.num_heads
        y = self.ln_1(x)
        q = self.q(y).reshape(-1, t, h, dh).transpose(1, 2)
        k = self.k(y).reshape(-1, t, h, dh).permute(0, 2, 3, 1)
        v = self.v(y).reshape(-1, t, h, dh).transpose(1, 2)
        scores = torch.matmul(q, k) * (1.0 / math.sqrt(dh)) + mask
        att = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(-1, t, s.d_model)
        x = x + self.proj(att)
        y = self.fc(self.ln_2(x))
        y = y * ((torch.erf(y * (1.0 / math.sqrt(2.0))) + 1.0) * 0.5)
        return x + self.mlp_proj(y)


class GPT(nn.Module):
    """Pre-LayerNorm GPT decoder; ``forward(input_ids [B, T]) -> logits [B*T, V]``."""

    def __init__(self, s: GPTShape, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.s = s
        proj_std = 0.02 / math.sqrt(2 * s.num_layers)
        self.wte = nn.Parameter(torch.randn(s.vocab_size, s.d_model) * 0.02)
        self.wpe = nn.Parameter(torch.randn(s.seq_len, s.d_model) * 0.02)
        self.h = nn.ModuleList(Block(s, proj_std) for _ in range(s.num_layers))
        self.ln_f = nn.LayerNorm(s.d_model, eps=1e-5)
        self.lm_head = Linear(s.d_model, s.vocab_size, 0.02, bias=False)
        self.register_buffer("causal_mask", torch.triu(torch.full((s.seq_len, s.seq_len), -1e9), diagonal=1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.wte) + self.wpe
        for block in self.h:
            x = block(x, self.causal_mask)
        return self.lm_head(self.ln_f(x)).reshape(-1, self.s.vocab_size)


def export_onnx(model: GPT, path: Path | str) -> Path:
    """Export ``model`` (its current weights) to an ONNX file the engine can train.

    Args:
        model: The PyTorch model.
        path: Where to write the ``.onnx`` file.

    Returns:
        The path written.
    """
    import onnx
    from onnx import helper

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, model.s.seq_len, dtype=torch.int64)
    torch.onnx.export(
        model, (example,), str(path), dynamo=False, opset_version=OPSET, input_names=["input_ids"],
        output_names=["logits"], dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "tokens"}},
        do_constant_folding=False,  # folding would replace parameters by anonymous folded copies
        # TRAINING: in EVAL mode the exporter merges parameters of equal value (all the zero biases) into one.
        training=torch.onnx.TrainingMode.TRAINING,
    )
    proto = onnx.load(str(path))
    graph = proto.graph
    params = {name for name, _ in model.named_parameters()}
    constants = []
    for init in list(graph.initializer):
        if init.name not in params:  # a buffer (the causal mask): a Constant, so the engine does not train it
            constants.append(helper.make_node("Constant", [], [init.name], value=init))
            graph.initializer.remove(init)
    for i, node in enumerate(graph.node):
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            base = node.name or f"layernorm_{i}"
            node.output.extend([f"{base}.mean", f"{base}.inv_std"])
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    missing = params - {init.name for init in graph.initializer}
    if missing:
        raise RuntimeError(f"parameters lost in the export (renamed or folded): {sorted(missing)[:5]}")
    proto.ir_version = IR_VERSION
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    return path
