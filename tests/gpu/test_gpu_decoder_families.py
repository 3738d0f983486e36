"""The other decoder families' exports in fp16 and bf16 on GPUs, with the runs and bounds of
tests/gpu/test_gpu_llama_precision.py (60 updates through the real trainer under mpiexec against the same 60 in fp32;
every window of 20 updates within 3% for fp16, 5% for bf16): Phi-3 (fused query/key/value and gate/up projections of
unequal parts), Gemma (the embedding tied to the LM head and scaled, `1 + weight` norms, GeGLU), GPT-NeoX (a per-head
fused query/key/value, partial RoPE, attention with batch and heads merged), Qwen2 (query/key/value biases) and the
multi-query Llama (its key/value projections kept whole on every tensor-parallel rank). One export per family from
torch's default exporter (dynamo); Gemma's `optimize=False` export, the default one being refused (folded norm
weights). Needs the GPU engine, CuPy and one CUDA GPU; the splits two (skipped otherwise).

Run: ``.venv/bin/python -m pytest -v -s tests/gpu/test_gpu_decoder_families.py``; each test prints its windows.
"""

from __future__ import annotations

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.gpu.test_gpu_llama_precision import TOLERANCE, WHY, WINDOW, _one_gpu, _train, _windows

FAMILIES = ["phi3-dynamo.onnx", "gemma-dynamo-noopt.onnx", "neox-dynamo.onnx", "qwen2-dynamo.onnx",
            "llama-mqa-dynamo.onnx"]  # fmt: skip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"needs 1 GPU ({WHY})")]


@pytest.fixture(scope="module", params=FAMILIES)
def fp32_losses(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    losses = _train(root, request.param, "fp32")
    assert np.isfinite(losses).all()
    assert losses[-WINDOW:].mean() < losses[:WINDOW].mean() - 0.3, losses  # the reference learns
    return root, request.param, losses


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_decoder_family_in_half_precision_follows_the_fp32_losses(fp32_losses, kind):
    root, export, ref = fp32_losses
    windows = _windows(_one_gpu(root, export, kind), ref, f"{export} {kind} against fp32")
    assert windows.max() < TOLERANCE[kind], windows


@pytest.mark.skipif(cuda_libs.gpu_count()[0] < 2, reason="a split over 2 GPUs needs 2 GPUs")
@pytest.mark.parametrize(("layout", "kind"), [("pp2", "fp16"), ("tp2", "bf16")])
def test_decoder_family_split_over_two_gpus_in_half_precision_follows_one_gpu_in_that_precision(
    fp32_losses, layout, kind
):
    """pp 2 at the automatic cut (Gemma's tied table on both stages), tp 2 split as on CPU ranks (Phi-3 by its fused
    parts, GPT-NeoX by whole heads through the merged axis, the multi-query key/value projections whole)."""
    root, export, _ = fp32_losses
    windows = _windows(_train(root, export, kind, layout), _one_gpu(root, export, kind),
                       f"{export} {kind} {layout} against one GPU")  # fmt: skip
    assert windows.max() < TOLERANCE[kind], windows
