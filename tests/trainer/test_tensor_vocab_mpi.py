"""Tensor parallelism for real on a torch-export-shaped GPT with Gemm MLPs and a tied embedding / LM head split by
vocabulary (``mpiexec -n 2``); kill-and-resume at tp 2 x dp 2 is in test_tensor_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tp import tp_file
from tests.support.parallel_runs import SEQ, gpt_run, initial_parameters, newest
from tests.support.runs import run_ranks
from tests.trainer.test_tensor_mpi import ATOL, LR

pytestmark = pytest.mark.mpi


def gemm_run(root, name, **sections):
    """A run on :func:`tests.support.gpt.gemm_tied_gpt` (1 layer, d_model 32, 4 heads, byte vocabulary 256)."""
    from tests.support.gpt import gemm_tied_gpt

    model = root / "gemm_tied.onnx"
    if not model.exists():
        gemm_tied_gpt(model, layers=1, width=32, heads=4, vocab=256, seq=SEQ, batch=2)
    return gpt_run(root, name, model_path=model, **sections)


def test_gemm_mlp_and_tied_vocabulary_split_train_to_the_unsplit_parameters(tmp_path):
    opt = {"name": "sgd", "learning_rate": LR["sgd"]}
    train = {"num_train_steps": 6, "evaluation_period": 0}
    whole = gemm_run(tmp_path, "tp1", distributed={"num_ranks": 1}, optimizer=opt, train=train)
    split = gemm_run(tmp_path, "tp2", distributed={"num_ranks": 2, "horizontal_parallel_size": 2}, optimizer=opt,
                     train=train)
    out1, out2 = run_ranks(whole), run_ranks(split, timeout=300)
    assert out1.returncode == 0, out1.stdout
    assert out2.returncode == 0, out2.stdout
    assert "vocabulary split of ['transformer.wte.weight'] (axis 0) in the LM head" in out2.stdout + \
        (split.artifacts_dir / "tensor" / "tensor.json").read_text()
    p1, p2 = read_params(newest(whole)), read_params(newest(split))  # the split one's slices merged
    initial = initial_parameters(whole)
    worst = {n: float(np.abs(p1[n] - p2[n]).max()) for n in p1}
    # The bound per entry: ATOL plus 2 ulps of the entry (an absolute bound alone refuses one ulp of an entry >= 1).
    over = {n: float((np.abs(p1[n] - p2[n]) - ATOL["sgd"] - 2 * np.spacing(np.abs(p1[n]))).max()) for n in p1}
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"Gemm MLP + tied vocabulary split tp 2, sgd: max |param diff| vs tp 1: {max(worst.values())} "
          f"({max(worst, key=worst.get)}); largest move {moved}")
    # SGD passes the few-ulp rounding differences of the split sums (docs/layouts.md) through lr = 1e-2, so
    # weights differ by about an ulp of their own size: measured 6.0e-8 (an ulp in [0.5, 1)) and 1.19e-7 (one ulp of
    # a LayerNorm weight in [1, 2), which the absolute 1e-7 alone refused in a CI run). A wrong split (a bias added
    # twice, a wrong slice, a missing sum) moves weights by ~lr |g|, over 1e4 times that.
    assert max(over.values()) <= 0, {n: v for n, v in over.items() if v > 0}
    assert moved > 1e4 * max(worst.values())
    for name in ("transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.bias"):
        assert np.abs(p1[name] - initial[name]).max() > 1e-5, name  # the split layers trained
    with_files = newest(split)
    import h5py

    with h5py.File(with_files / tp_file("params", 1, 2), "r") as f:  # rank 1's slices: [out, in] on their axes
        shapes = {str(ds.attrs["name"]): ds.shape for ds in f["parameters"].values()}
    assert shapes["transformer.wte.weight"] == (128, 32)  # rows 128:256 of the vocabulary
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (64, 32) and shapes["transformer.h.0.mlp.c_proj.weight"] == (
        32, 64)
    assert shapes["transformer.h.0.mlp.c_proj.bias"] == (32,)  # whole: added once after the sum
    import onnx

    from ortflow.export.model import export_model

    result = export_model(split.output_dir, tmp_path / "model.onnx", config=split)  # one unsplit, verified model
    assert max(result.verification.max_abs_diff.values()) <= 1e-5
    exported = onnx.load(str(tmp_path / "model.onnx"))
    dims = exported.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims][1:] == [SEQ, 256] and len(dims) == 3  # [B, T, V] (export frees the batch)
    table = next(t for t in exported.graph.initializer if t.name == "transformer.wte.weight")
    assert list(table.dims) == [256, 32]  # merged whole, read by the Gather and the tied head

