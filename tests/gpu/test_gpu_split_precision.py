"""Mixed precision on a split model: pipeline stages and tensor-parallel ranks on 2 GPUs, in fp16 (loss scaling) and
bf16. Needs the GPU engine, CuPy and 2 CUDA GPUs (skipped otherwise).

Each stage or piece is its own autocast graph, fp32 at its edges, so what crosses between GPUs stays fp32; in fp16
the last stage's (or each tensor-parallel rank's last piece's) loss is multiplied by the scale, every stage's
gradients arrive that much larger, and the scale is divided out of the average. Equality is what data parallelism's
mixed precision is held to (tests/gpu/test_gpu_mixed_precision.py, on the same small GPT and data): the mean loss of
every window of 20 updates within 3% (fp16) and 5% (bf16) of the fp32 run on one GPU, and the logged gradient norm
(the loss scale divided out exactly once, on every stage) within 0.8-1.25x of fp32's. A scale that is never divided
out, or divided out twice, moves the norm by the scale itself (2**16 at the start).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gpu_mixed_precision import HERE, _digests, _make, _progress, _run, fp32_curve, two_gpus

pytestmark = [pytest.mark.gpu, two_gpus]
__all__ = ["fp32_curve"]  # the one-GPU fp32 reference, a fixture of the data-parallel tests

SPLITS = {"pp2": {"pipeline_parallel_size": 2}, "tp2": {"horizontal_parallel_size": 2}}
TOLERANCE = {"fp16": 0.03, "bf16": 0.05}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_a_split_model_in_half_precision_follows_the_fp32_loss_curve(fp32_curve, layout, precision):
    root, reference = fp32_curve
    log = _run(_make(root, f"{layout}-{precision}", precision, ranks=2, distributed=SPLITS[layout]), 2)
    where = "pipeline stage 1/2" if layout == "pp2" else "tensor-parallel"
    assert where in log, log[-3000:]
    curve = _progress(log)
    steps = sorted(reference)
    assert sorted(curve) == steps == list(range(1, 201))
    ref, got = np.array([reference[s]["loss"] for s in steps]), np.array([curve[s]["loss"] for s in steps])
    assert np.isfinite(got).all()
    windows = np.abs(got.reshape(10, 20).mean(1) - ref.reshape(10, 20).mean(1)) / ref.reshape(10, 20).mean(1)
    print(f"{layout} {precision}: window relative differences {np.round(windows, 4).tolist()}")
    assert windows.max() < TOLERANCE[precision], windows
    norms = np.array([curve[s]["grad_norm"] for s in steps[100:]]) / [reference[s]["grad_norm"] for s in steps[100:]]
    print(f"{layout} {precision}: median gradient norm / fp32's {float(np.median(norms)):.3f}")
    assert 0.8 < float(np.median(norms)) < 1.25, np.median(norms)
    if precision == "fp16":
        assert curve[200]["loss_scale"] >= 1.0 and "skipped_updates" in curve[200]
    else:
        assert "loss_scale" not in curve[200]


def test_an_overflow_in_the_last_stage_skips_that_update_on_both_stages_and_halves_the_scale(tmp_path):
    """The injected scale (2**100 at update 10, tests/gpu/overflow_rank.py) overflows the last stage's fp16
    backward; its inf gradients reach stage 0 through the pipeline, the global norm is inf on both ranks, and both skip
    the update and halve the scale (the digests are each stage's own parameters)."""
    cfg = _make(tmp_path, "overflow", "fp16", ranks=2, steps=30, checkpoint={"period": 1},
                distributed=SPLITS["pp2"],
                precision={"loss_scale_growth_interval": 8, "initial_loss_scale": 2.0**10})
    log = _run(cfg, 2, str(HERE / "overflow_rank.py"), "10")
    assert "pipeline stage 1/2" in log, log[-3000:]
    seen, progress = _digests(log), _progress(log)
    for rank in (0, 1):
        assert seen[(rank, 10)] == seen[(rank, 9)], rank  # update 10 skipped on this stage: parameters unchanged
        assert all(seen[(rank, s)] != seen[(rank, s - 1)] for s in (*range(2, 10), *range(11, 31))), rank
    assert seen[(0, 30)] != seen[(1, 30)]  # the two ranks hold different stages
    scale = {s: progress[s]["loss_scale"] for s in progress}
    assert scale[9] == pytest.approx(2.0**11, rel=1e-3) and progress[9]["skipped_updates"] == 0
    assert scale[10] == pytest.approx(2.0**10, rel=1e-3) and progress[10]["skipped_updates"] == 1
    assert progress[30]["skipped_updates"] == 1
    losses = [progress[s]["loss"] for s in range(11, 31)]
    assert np.isfinite(losses).all() and losses[-1] < progress[1]["loss"]
