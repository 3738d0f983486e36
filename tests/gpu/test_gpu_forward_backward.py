"""The engine's separate forward and backward calls on a GPU (``ortflow.engine.ForwardBackward`` with ``cuda:0``)
against its training call on the same GPU: the fact a CUDA pipeline stage or tensor piece would keep its activations
with (CPU ranks do: tests/trainer/test_kept_activations.py). Skipped without a GPU and the GPU engine.

Parameters enter as the engine's own device tensors (no copy), the gradients come back on the GPU. Tolerance: both
paths run the same kernels on the same shapes with deterministic compute, so they may agree bit for bit; the bound
allows TF32 rounding (the CUDA provider's matmuls), rtol 1e-3 / atol 1e-5 on gradients of order 1e-2. The test
prints whether they are bitwise equal and the time of each path.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.gpu.test_gpu_training import _ready

REASON = _ready(gpus=1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_separate_forward_and_backward_on_the_gpu_give_the_training_call_gradients(tmp_path):
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import ForwardBackward, api
    from ortflow.trainer.startup import session_options
    from tests.trainer.exports_runs import gpt2_run

    cfg = gpt2_run(tmp_path, "dp", distributed={"num_ranks": 1})
    folder = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cuda",
                        session_options=session_options(1, True))
    module.train()
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    batches = [loader.batch(0, i) for i in range(2)]
    started = time.perf_counter()
    for batch in batches:
        module(*(batch[n] for n in module.input_names()))
    call_s = time.perf_counter() - started
    expected = [np.array(state.parameters[n].grad) for n in trainable]  # host copies on CUDA

    engine = ForwardBackward((folder / "eval_model.onnx").read_bytes(), [n for n, _ in state.parameters], trainable,
                             [], session_options(1, True), ["CUDAExecutionProvider", "CPUExecutionProvider"],
                             device="cuda:0")
    params = {n: state._state.get_parameter(n).data for n, _ in state.parameters}  # device tensors, no copy
    assert all(v.device_name().lower() == "cuda" for v in params.values())  # the C tensors say "Cuda"
    sums = None
    started = time.perf_counter()
    for batch in batches:
        feeds = [params[n] if n in params else engine.ortvalue(np.ascontiguousarray(batch[n]))
                 for n in engine.feed_names]
        _, held = engine.forward(feeds)
        grads = engine.backward(held, [np.ones((), np.float32)])
        assert all(g.device_name().lower() == "cuda" for g in grads)
        host = [g.numpy() for g in grads]
        sums = host if sums is None else [s + g for s, g in zip(sums, host, strict=True)]
    split_s = time.perf_counter() - started
    bitwise = all(a.tobytes() == b.tobytes() for a, b in zip(sums, expected, strict=True))
    print(f"training call {call_s:.4f} s, forward+backward {split_s:.4f} s (first calls), bitwise equal: {bitwise}")
    for name, mine, theirs in zip(trainable, sums, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-5, err_msg=name)
