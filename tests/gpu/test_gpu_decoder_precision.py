"""The Hugging Face decoder exports in fp16 and bf16 on one GPU: 60 updates through the real trainer under mpiexec,
against the same 60 updates in fp32; and split over two GPUs (pp 2 in fp16, tp 2 in bf16) against one GPU in that
precision. The Llama exports of all three exporters (RoPE, RMSNorm, SwiGLU, grouped-query attention), and one export
per other family from torch's default exporter (dynamo): Phi-3 (fused query/key/value and gate/up projections of
unequal parts), Gemma (the embedding tied to the LM head and scaled, `1 + weight` norms, GeGLU, torch's padding_idx
masked; its `optimize=False` export, the default one being refused for its folded norm weights), GPT-NeoX (a per-head
fused query/key/value, partial RoPE, attention with batch and heads merged), Qwen2 (query/key/value biases) and the
multi-query Llama (its key/value projections kept whole on every tensor-parallel rank). Needs the GPU engine, CuPy
and one CUDA GPU; the splits two (skipped otherwise).

What autocast keeps in fp32 here (docs/gpu.md): RoPE's Cos and Sin in bf16 (no bf16 type in their schema
at the exports' opsets), Pow, Sqrt, Reciprocal and Neg in bf16 (fp16 CUDA kernels only), a SiLU's Sigmoid and Mul in
bf16 (the engine fuses them into QuickGelu, without a bf16 kernel), and the default list (ReduceMean of RMSNorm,
Softmax, the loss) in both. Each run must start (a node without a CUDA kernel stops the rank at session start), stay
finite, and follow fp32: the mean loss of every window of 20 updates within 3% (fp16) and 5% (bf16) of fp32's, the
bounds of tests/gpu/test_gpu_mixed_precision.py (activations rounded to 11 or 8 significant bits, the trajectories
then separating chaotically; the fp32 baseline itself runs its matmuls in TF32). fp16's losses are compared with
fp32's after as many applied updates: the dynamic loss scale starts at 2^16 and skips each update whose gradients
overflow it, which it does 2-3 times in the first updates of the Llama, Phi-3 and Qwen2 exports (none on Gemma and
GPT-NeoX). Measured on an H200: aligned so, the fp16 windows differ from fp32's by at most 0.51% (Qwen2), bf16's by
at most 0.03%; step by step the skipped updates put the first windows up to 3.1% apart.

Run: ``.venv/bin/python -m pytest -v -s tests/gpu/test_gpu_decoder_precision.py``; each test prints its windows.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ortflow import cuda_libs
from tests.gpu.test_gpu_mixed_precision import _mpiexec, _progress
from tests.trainer.exports_runs import LLAMA_EXPORTS

#: One export per other decoder family (dynamo; Gemma's optimize=False).
FAMILIES = ["phi3-dynamo.onnx", "gemma-dynamo-noopt.onnx", "neox-dynamo.onnx", "qwen2-dynamo.onnx",
            "llama-mqa-dynamo.onnx"]  # fmt: skip

UPDATES = 60
WINDOW = 20
TOLERANCE = {"fp16": 0.03, "bf16": 0.05}
PRECISION = {"fp32": {}, "fp16": {"use_mixed_precision": True},
             "bf16": {"use_mixed_precision": True, "use_bfloat16": True}}


def _why_not() -> str | None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "the GPU engine (onnxruntime-training) is not installed"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    count, why = cuda_libs.gpu_count()
    return None if count else (why or "no GPU")


WHY = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"needs 1 GPU ({WHY})")]


#: The split layouts on 2 GPUs (the model cut into two stages at the automatic cut, or split over two ranks).
SPLITS = {"pp2": {"pipeline_parallel_size": 2}, "tp2": {"horizontal_parallel_size": 2}}
_ONE_GPU: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}


def _train(root: Path, export: str, kind: str, layout: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The losses of ``UPDATES`` updates of one run on one GPU (or two, split by ``layout``), in order, and the number
    of updates fp16's loss scaling skipped before each (0 without loss scaling)."""
    from tests.trainer.exports_runs import llama_run

    ranks = 2 if layout else 1
    cfg = llama_run(root, f"{export.removesuffix('.onnx')}-{kind}{'-' + layout if layout else ''}", export=export,
                    precision=PRECISION[kind],
                    distributed={"num_ranks": ranks, "device": "cuda", "use_nccl": True, **SPLITS.get(layout, {})},
                    train={"batch_size": 16, "num_train_steps": UPDATES, "gradient_accumulation_steps": 1,
                           "evaluation_period": 0},
                    checkpoint={"period": 1000, "max_num_checkpoints": 1})
    out = subprocess.run([*_mpiexec(ranks), "-m", "ortflow.trainer", str(cfg.output_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    progress = _progress(out.stdout)
    assert sorted(progress) == list(range(1, UPDATES + 1)), out.stdout[-2000:]
    losses = np.array([progress[step]["loss"] for step in sorted(progress)])
    skipped = np.array([progress[step].get("skipped_updates", 0) for step in sorted(progress)], dtype=np.int64)
    return losses, np.concatenate([[0], skipped[:-1]])


@pytest.fixture(scope="module", params=[*LLAMA_EXPORTS, *FAMILIES])
def fp32_losses(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder")
    losses, _ = _train(root, request.param, "fp32")
    assert np.isfinite(losses).all()
    assert losses[-WINDOW:].mean() < losses[:WINDOW].mean() - 0.3, losses  # the reference learns
    return root, request.param, losses


def _one_gpu(root: Path, export: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The one-GPU run of ``kind`` on ``export``, trained once per session (both tests read it)."""
    if (export, kind) not in _ONE_GPU:
        _ONE_GPU[export, kind] = _train(root, export, kind)
    return _ONE_GPU[export, kind]


def _windows(got: np.ndarray, ref: np.ndarray, label: str) -> np.ndarray:
    assert np.isfinite(got).all(), got
    means = [x.reshape(-1, WINDOW).mean(1) for x in (got, ref)]
    windows = np.abs(means[0] - means[1]) / means[1]
    print(f"{label}: reference window means {np.round(means[1], 4).tolist()}, run "
          f"{np.round(means[0], 4).tolist()}, relative differences {np.round(windows, 4).tolist()}")
    return windows


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_decoder_export_in_half_precision_follows_the_fp32_losses(fp32_losses, kind):
    root, export, ref = fp32_losses
    losses, skipped = _one_gpu(root, export, kind)
    # an update fp16's loss scaling skips (the scale starts high and halves on each overflow) leaves the weights as they
    # were: each loss is compared with fp32's after as many applied updates
    print(f"{export} {kind}: updates skipped by the loss scale {int(skipped[-1])} before the last")
    windows = _windows(losses, ref[np.arange(UPDATES) - skipped], f"{export} {kind} against fp32, by applied updates")
    assert windows.max() < TOLERANCE[kind], windows


@pytest.mark.skipif(cuda_libs.gpu_count()[0] < 2, reason="a split over 2 GPUs needs 2 GPUs")
@pytest.mark.parametrize(("layout", "kind"), [("pp2", "fp16"), ("tp2", "bf16")])
def test_decoder_export_split_over_two_gpus_in_half_precision_follows_one_gpu_in_that_precision(
    fp32_losses, layout, kind
):
    """The stages (or tensor-parallel ranks) autocast each alone, the loss scale divided out of every stage's
    gradients: the same bound against the one-GPU run of the same precision as that run has against fp32."""
    root, export, _ = fp32_losses
    windows = _windows(_train(root, export, kind, layout)[0], _one_gpu(root, export, kind)[0],
                       f"{export} {kind} {layout} against one GPU")
    assert windows.max() < TOLERANCE[kind], windows
