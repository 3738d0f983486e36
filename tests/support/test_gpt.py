"""The configurable GPT builder: its options change the graph as documented, and its presets stay the models the
tests were written against, bit for bit."""

from __future__ import annotations

import hashlib
from collections import Counter

import onnx
import pytest

from tests.support.gpt import gemm_tied_gpt, gpt, gpt2_style, torch_gpt

# sha256 of each preset's file at its defaults, as the separate builders wrote them before they became presets of
# one builder (onnx 1.17.0): a change here changes the models of every test that uses the preset.
PRESETS = {
    "gpt2_style": (gpt2_style, {}, "e96ec8dbd456238e822a039f6425fb02a6b2dd4b17667f61dd5920cffe8edede"),
    "torch_gpt": (torch_gpt, {}, "e85c1574fdc824ca733cfb3d017201d5e37783e0d8e76968b0af62431188db6a"),
    "gemm_tied_gpt": (gemm_tied_gpt, {}, "ec6b01288b3b898175dcff4159a72cd5d3269c324be8c55e3fcf5146bedf98c8"),
    "gemm_untied_gpt": (gemm_tied_gpt, {"tied": False},
                        "1e90b81fe9f292e2402a66bff33d399277c6a7f9df06011c1564fd97a3c6a599"),
}  # fmt: skip
SMALL = {"layers": 2, "width": 8, "heads": 2, "vocab": 11, "seq": 4, "batch": 2}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_write_the_same_bytes_as_before(tmp_path, name):
    build, kwargs, digest = PRESETS[name]
    assert hashlib.sha256(build(tmp_path / "m.onnx", **kwargs).read_bytes()).hexdigest() == digest


def ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_gemm_puts_the_mlp_on_flattened_tokens(tmp_path):
    matmul, gemm = ops(gpt(tmp_path / "a.onnx", **SMALL)), ops(gpt(tmp_path / "b.onnx", **SMALL, mlp="gemm"))
    assert gemm["Gemm"] == 2 * SMALL["layers"] and matmul["Gemm"] == 0
    assert matmul["MatMul"] - gemm["MatMul"] == 2 * SMALL["layers"]


def test_tied_head_reads_the_token_table_and_untied_has_its_own(tmp_path):
    tied = onnx.load(str(gpt(tmp_path / "t.onnx", **SMALL, tied=True)))
    untied = onnx.load(str(gpt(tmp_path / "u.onnx", **SMALL)))
    readers = [n.op_type for n in tied.graph.node if "transformer.wte.weight" in n.input]
    assert sorted(readers) == ["Gather", "Transpose"]
    assert "lm_head.weight" in {t.name for t in untied.graph.initializer}
    assert "lm_head.weight" not in {t.name for t in tied.graph.initializer}


def test_sizes_each_reads_a_shape_per_dimension_and_flat_logits_flattens(tmp_path):
    tuple_, each = ops(gpt(tmp_path / "a.onnx", **SMALL)), ops(gpt(tmp_path / "b.onnx", **SMALL, sizes="each"))
    assert each["Shape"] == 2 * tuple_["Shape"]  # four reshaped tensors per block, two dims each
    flat = onnx.load(str(gpt(tmp_path / "f.onnx", **SMALL, flat_logits=True)))
    dims = [d.dim_value for d in flat.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [SMALL["batch"] * SMALL["seq"], SMALL["vocab"]]


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mlp 'conv'"):
        gpt(tmp_path / "x.onnx", **SMALL, mlp="conv")
    with pytest.raises(ValueError, match="fixed"):
        gpt(tmp_path / "x.onnx", **{**SMALL, "batch": "batch"}, flat_logits=True)
