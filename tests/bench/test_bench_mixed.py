"""bench/bench_mixed.py's bf16 variants configure the graphs their names promise (CPU build: configure only)."""

from __future__ import annotations

import collections

import onnx
from onnx import TensorProto, shape_inference

from bench import bench_mixed


def _half_ops(run_dir) -> dict:
    model = shape_inference.infer_shapes(onnx.load(str(run_dir / "artifacts" / "training_model.onnx")))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.value_info, *model.graph.output]}
    found = collections.Counter()
    for node in model.graph.node:
        if node.op_type in ("Gelu", "GeluGrad", "Erf", "Softmax", "SoftmaxGrad_13"):
            found[(node.op_type, TensorProto.DataType.Name(types.get(node.output[0], 0)))] += 1
    return dict(found)


def test_bf16_variants_fuse_the_gelu_in_the_type_they_name_and_move_softmax(tmp_path):
    names = "bf16,bf16-nofuse,bf16-gelu32,bf16-softmax16-gelu32"
    bench_mixed.main(["prepare", str(tmp_path), "--precisions", names, "--shape", "tiny", "--device", "cuda"])
    plain, nofuse, gelu32, softmax16 = (_half_ops(tmp_path / name) for name in names.split(","))
    assert plain == {("Gelu", "BFLOAT16"): 2, ("GeluGrad", "BFLOAT16"): 2, ("Softmax", "BFLOAT16"): 2,
                     ("SoftmaxGrad_13", "BFLOAT16"): 2}  # bf16 on GPUs: the engine's fused GELU and Softmax in bf16
    assert nofuse == {("Erf", "BFLOAT16"): 2, ("Softmax", "BFLOAT16"): 2, ("SoftmaxGrad_13", "BFLOAT16"): 2}
    assert gelu32 == {("Gelu", "FLOAT"): 2, ("GeluGrad", "FLOAT"): 2, ("Softmax", "BFLOAT16"): 2,
                      ("SoftmaxGrad_13", "BFLOAT16"): 2}
    assert softmax16 == {("Gelu", "FLOAT"): 2, ("GeluGrad", "FLOAT"): 2, ("Softmax", "BFLOAT16"): 2,
                         ("SoftmaxGrad_13", "BFLOAT16"): 2}


def test_variant_suffixes_combine_config_sections_and_the_packed_switch():
    base, settings = bench_mixed.variant("fp16-allreduce32-packed")
    assert base == "fp16"
    assert settings["distributed"] == {"allreduce_dtype": "float32"}
    assert settings["env"] == {"ORTFLOW_PACKED_ALLREDUCE": "1"}


def test_markov_tokens_follow_the_fixed_chain_on_every_rank():
    import numpy as np

    vocab = 64
    successors = np.random.default_rng(0).integers(0, vocab, (vocab, bench_mixed.MARKOV_P.size))
    for rank in (0, 1):  # each rank draws its own sequences from the same chain
        tokens = bench_mixed._markov(np.random.default_rng(rank), vocab, 8, 33)
        for prev, nxt in zip(tokens[:, :-1].ravel(), tokens[:, 1:].ravel(), strict=True):
            assert nxt in successors[prev]
    a = bench_mixed._markov(np.random.default_rng(0), vocab, 8, 33)
    b = bench_mixed._markov(np.random.default_rng(1), vocab, 8, 33)
    assert not np.array_equal(a, b)


def test_bf16_computes_the_softmax_in_bf16_and_the_smx32_variant_keeps_it_fp32(tmp_path):
    from ortflow.graph.precision.autocast import DEFAULT_FP32_OPS

    base, settings = bench_mixed.variant("bf16-smx32")
    section = bench_mixed._precision(base, settings["precision"])
    assert section["use_bfloat16"] and section["fp32_ops"] == list(DEFAULT_FP32_OPS)
    names = "bf16,bf16-smx32"
    bench_mixed.main(["prepare", str(tmp_path), "--precisions", names, "--shape", "tiny", "--device", "cuda"])
    plain, smx32 = (_half_ops(tmp_path / name) for name in names.split(","))
    assert smx32[("Softmax", "FLOAT")] == 2
    assert plain == {("Gelu", "BFLOAT16"): 2, ("GeluGrad", "BFLOAT16"): 2, ("Softmax", "BFLOAT16"): 2,
                     ("SoftmaxGrad_13", "BFLOAT16"): 2}
