"""Write a Llama-architecture ONNX model of any size with random weights, the weights in one external data file.

The graph has the shape of a TorchScript export of Hugging Face ``LlamaForCausalLM`` (tests/fixtures/exports/
llama.onnx): token embedding, per layer RMSNorm -> attention with rotary position embeddings and grouped key/value
heads -> residual -> RMSNorm -> SwiGLU MLP -> residual, a final RMSNorm and an untied LM head; weights stored
``[out, in]`` and transposed in the graph, as torch exports them. One input ``input_ids [batch, seq]`` (int64), one
output ``logits [batch, seq, vocab]``. No torch is needed: the graph is built with ``onnx.helper`` and the weights are
written tensor by tensor into ``<name>.data`` (one tensor in memory at a time), so a model of any size is written in
the memory of its largest tensor.

    python tools/make_large_llama.py OUT.onnx --size 1b        # ~1.1B parameters, ~4.4 GB of fp32 weights
    python tools/make_large_llama.py OUT.onnx --size 600m      # ~0.60B parameters, ~2.4 GB: past the 2 GB limit
    python tools/make_large_llama.py OUT.onnx --d-model 256 --layers 2 --heads 4 --kv-heads 2 --ffn 512 --vocab 1000
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

#: Offsets of tensors in the data file are multiples of this (page-aligned, so the engine can map them).
ALIGN = 65536
OPSET = 17


@dataclass(frozen=True)
class LlamaShape:
    """The model's hyper-parameters (Hugging Face ``LlamaConfig`` names in the comments)."""

    d_model: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    ffn: int  # intermediate_size
    vocab: int  # vocab_size
    rope_theta: float = 10000.0
    eps: float = 1e-5  # rms_norm_eps

    def __post_init__(self):
        if self.d_model % self.heads or self.heads % self.kv_heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"heads {self.heads} must divide d_model {self.d_model} into an even head size, and "
                             f"kv_heads {self.kv_heads} must divide heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def weights(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name (as Hugging Face names it) and shape, in the order they are written."""
        d, kv = self.d_model, self.kv_heads * self.head_dim
        found = [("model.embed_tokens.weight", (self.vocab, d))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            found += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (d, d)),
                      (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                      (p + "self_attn.o_proj.weight", (d, d)), (p + "post_attention_layernorm.weight", (d,)),
                      (p + "mlp.gate_proj.weight", (self.ffn, d)), (p + "mlp.up_proj.weight", (self.ffn, d)),
                      (p + "mlp.down_proj.weight", (d, self.ffn))]
        return found + [("model.norm.weight", (d,)), ("lm_head.weight", (self.vocab, d))]

    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.weights())


PRESETS = {
    "1b": LlamaShape(d_model=2048, layers=22, heads=32, kv_heads=8, ffn=5632, vocab=32000),
    "600m": LlamaShape(d_model=1536, layers=20, heads=12, kv_heads=4, ffn=4096, vocab=32000),
    "tiny": LlamaShape(d_model=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512),
}


class _Graph:
    """Nodes and constants of the graph being built, with unique names."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], prefix: str, **attrs) -> str:
        self._count += 1
        out = f"/{prefix}/{op_type}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def const(self, name: str, value) -> str:
        """A Constant node, as torch exports fixed values (float initializers would count as parameters)."""
        tensor = onnx.numpy_helper.from_array(np.asarray(value), name)
        self.nodes.append(helper.make_node("Constant", [], [name], name=f"/{name}", value=tensor))
        return name


def _rms_norm(g: _Graph, x: str, weight: str, prefix: str) -> str:
    square = g.op("Pow", [x, "const.two"], prefix)
    mean = g.op("ReduceMean", [square], prefix, axes=[-1], keepdims=1)
    root = g.op("Sqrt", [g.op("Add", [mean, "const.eps"], prefix)], prefix)
    normed = g.op("Mul", [x, g.op("Div", ["const.one", root], prefix)], prefix)
    return g.op("Mul", [weight, normed], prefix)


def _linear(g: _Graph, x: str, weight: str, prefix: str) -> str:
    return g.op("MatMul", [x, g.op("Transpose", [weight], prefix, perm=[1, 0])], prefix)


def _heads(g: _Graph, x: str, shape: str, prefix: str) -> str:
    """[B, T, H*hd] -> [B, H, T, hd]."""
    return g.op("Transpose", [g.op("Reshape", [x, shape], prefix)], prefix, perm=[0, 2, 1, 3])


def _rope(g: _Graph, x: str, cos: str, sin: str, prefix: str) -> str:
    first = g.op("Slice", [x, "const.zero", "const.half", "const.axis3"], prefix)
    second = g.op("Slice", [x, "const.half", "const.big", "const.axis3"], prefix)
    rotated = g.op("Concat", [g.op("Neg", [second], prefix), first], prefix, axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], prefix), g.op("Mul", [rotated, sin], prefix)], prefix)


def _repeat_kv(g: _Graph, x: str, shape: LlamaShape, prefix: str) -> str:
    """[B, KV, T, hd] -> [B, H, T, hd]: each key/value head serves heads / kv_heads query heads."""
    if shape.heads == shape.kv_heads:
        return x
    wide = g.op("Expand", [g.op("Unsqueeze", [x, "const.axis2"], prefix), "const.repeat"], prefix)
    return g.op("Reshape", [wide, "const.all_heads"], prefix)


def _attention(g: _Graph, x: str, s: LlamaShape, p: str, rope: tuple[str, str], mask: str) -> str:
    prefix = p.replace(".", "/") + "self_attn"
    q = _rope(g, _heads(g, _linear(g, x, p + "self_attn.q_proj.weight", prefix), "const.q_shape", prefix), *rope,
              prefix)
    k = _rope(g, _heads(g, _linear(g, x, p + "self_attn.k_proj.weight", prefix), "const.kv_shape", prefix), *rope,
              prefix)
    v = _heads(g, _linear(g, x, p + "self_attn.v_proj.weight", prefix), "const.kv_shape", prefix)
    k, v = _repeat_kv(g, k, s, prefix), _repeat_kv(g, v, s, prefix)
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], prefix, perm=[0, 1, 3, 2])], prefix),
                          "const.scale"], prefix)
    probs = g.op("Softmax", [g.op("Add", [scores, mask], prefix)], prefix, axis=-1)
    merged = g.op("Transpose", [g.op("MatMul", [probs, v], prefix)], prefix, perm=[0, 2, 1, 3])
    return _linear(g, g.op("Reshape", [merged, "const.d_shape"], prefix), p + "self_attn.o_proj.weight", prefix)


def _mlp(g: _Graph, x: str, p: str) -> str:
    prefix = p.replace(".", "/") + "mlp"
    gate = _linear(g, x, p + "mlp.gate_proj.weight", prefix)
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], prefix)], prefix)
    up = _linear(g, x, p + "mlp.up_proj.weight", prefix)
    return _linear(g, g.op("Mul", [silu, up], prefix), p + "mlp.down_proj.weight", prefix)


def _positions(g: _Graph, s: LlamaShape) -> tuple[str, str, str]:
    """Rotary cos/sin [T, hd] and the causal mask [T, T], from the sequence length of the input."""
    seq = g.op("Gather", [g.op("Shape", ["input_ids"], "rotary_emb"), "const.one_i"], "rotary_emb", axis=0)
    pos = g.op("Range", ["const.zero_s", seq, "const.one_s"], "rotary_emb")
    inv_freq = 1.0 / (s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float32) / s.head_dim))
    g.const("const.inv_freq", inv_freq.astype(np.float32).reshape(1, -1))
    pos_f = g.op("Cast", [g.op("Unsqueeze", [pos, "const.axis1"], "rotary_emb")], "rotary_emb", to=TensorProto.FLOAT)
    freqs = g.op("MatMul", [pos_f, "const.inv_freq"], "rotary_emb")
    emb = g.op("Concat", [freqs, freqs], "rotary_emb", axis=-1)
    cos, sin = g.op("Cos", [emb], "rotary_emb"), g.op("Sin", [emb], "rotary_emb")
    later = g.op("Greater", [g.op("Unsqueeze", [pos, "const.axis0"], "mask"),
                             g.op("Unsqueeze", [pos, "const.axis1"], "mask")], "mask")
    mask = g.op("Where", [later, "const.neg_inf", "const.zero_f"], "mask")
    return cos, sin, mask


def _constants(g: _Graph, s: LlamaShape) -> None:
    hd = s.head_dim
    for name, value in {"const.two": np.float32(2), "const.one": np.float32(1), "const.eps": np.float32(s.eps),
                        "const.scale": np.float32(1 / np.sqrt(hd)), "const.zero_f": np.float32(0),
                        "const.neg_inf": np.float32(np.finfo(np.float32).min),
                        "const.zero": np.array([0], np.int64), "const.half": np.array([hd // 2], np.int64),
                        "const.big": np.array([hd], np.int64), "const.axis3": np.array([3], np.int64),
                        "const.axis2": np.array([2], np.int64), "const.axis1": np.array([1], np.int64),
                        "const.axis0": np.array([0], np.int64), "const.one_i": np.array(1, np.int64),
                        "const.zero_s": np.array(0, np.int64), "const.one_s": np.array(1, np.int64),
                        "const.repeat": np.array([1, 1, s.heads // s.kv_heads, 1, 1], np.int64),
                        "const.all_heads": np.array([0, s.heads, -1, hd], np.int64),
                        "const.q_shape": np.array([0, 0, s.heads, hd], np.int64),
                        "const.kv_shape": np.array([0, 0, s.kv_heads, hd], np.int64),
                        "const.d_shape": np.array([0, 0, s.d_model], np.int64)}.items():
        g.const(name, value)


def build_graph(s: LlamaShape) -> onnx.ModelProto:
    """The model without its weights (initializers are added by :func:`write_model`)."""
    g = _Graph()
    _constants(g, s)
    cos, sin, mask = _positions(g, s)
    x = g.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embed_tokens")
    for i in range(s.layers):
        p = f"model.layers.{i}."
        x = g.op("Add", [x, _attention(g, _rms_norm(g, x, p + "input_layernorm.weight", p), s, p, (cos, sin), mask)],
                 p)
        x = g.op("Add", [x, _mlp(g, _rms_norm(g, x, p + "post_attention_layernorm.weight", p), p)], p)
    x = _rms_norm(g, x, "model.norm.weight", "norm")
    g.nodes.append(helper.make_node("MatMul", [x, g.op("Transpose", ["lm_head.weight"], "lm_head", perm=[1, 0])],
                                    ["logits"], name="/lm_head/MatMul"))
    graph = helper.make_graph(
        g.nodes, "llama",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", s.vocab])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="make_large_llama")
    model.ir_version = 8
    return model


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:  # RMSNorm weights start at one, as the torch model initialises them
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32, copy=False)


def write_model(path: Path, shape: LlamaShape, seed: int = 0) -> dict:
    """Write ``path`` and ``path.name + '.data'`` beside it; returns a summary (parameters, bytes, files).

    Each weight is drawn, written at the next aligned offset of the data file and dropped before the next one, and
    its initializer records only where it lies.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_graph(shape)
    data_name = path.name + ".data"
    rng = np.random.default_rng(seed)
    offset = 0
    with open(path.parent / data_name, "wb") as data:
        for name, dims in shape.weights():
            values = _values(name, dims, rng)
            offset = -(-offset // ALIGN) * ALIGN
            data.seek(offset)
            data.write(values.tobytes())
            init = model.graph.initializer.add()
            init.name, init.data_type = name, TensorProto.FLOAT
            init.dims.extend(dims)
            init.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(values.nbytes))):
                init.external_data.add(key=key, value=value)
            offset += values.nbytes
            del values
    onnx.save(model, str(path))
    return {"model": str(path), "data": str(path.parent / data_name), "num_parameters": shape.num_parameters(),
            "data_bytes": offset, "shape": asdict(shape)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the .onnx file to write (its weights go to OUT.data beside it)")
    parser.add_argument("--size", choices=sorted(PRESETS), help="a preset shape; the options below override it")
    for flag, field in (("--d-model", "d_model"), ("--layers", "layers"), ("--heads", "heads"),
                        ("--kv-heads", "kv_heads"), ("--ffn", "ffn"), ("--vocab", "vocab")):
        parser.add_argument(flag, dest=field, type=int, help=f"the model's {field}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    given = {k: getattr(args, k) for k in ("d_model", "layers", "heads", "kv_heads", "ffn", "vocab")
             if getattr(args, k) is not None}
    if args.size is None and len(given) < 6:
        parser.error("give --size or all of --d-model --layers --heads --kv-heads --ffn --vocab")
    try:
        shape = LlamaShape(**{**(asdict(PRESETS[args.size]) if args.size else {}), **given})
    except ValueError as err:
        parser.error(str(err))
    print(json.dumps(write_model(args.out, shape, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
