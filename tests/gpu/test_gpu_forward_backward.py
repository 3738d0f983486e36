"""The engine's separate forward and backward calls on a GPU (``ortflow.engine.ForwardBackward`` with ``cuda:0``)
against its training call on the same GPU: the fact CUDA pipeline stages and tensor pieces keep their activations
with (as CPU ranks do: tests/trainer/test_kept_activations.py), and ``KeptActivations`` as they run it, on a stream
the rank owns. Skipped without a GPU and the GPU engine.

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


def test_kept_activations_on_a_user_stream_sum_the_training_call_gradients_into_the_device_buffers(tmp_path):
    """``KeptActivations`` on a GPU, as a CUDA stage runs it: the gradient graph's session on the rank's own stream
    (the CUDA provider's user compute stream), both micro-batches in flight before either backward, the gradients
    copied and added with CuPy on that stream into a second training module's device gradient buffers. Against the
    training call's sums (same tolerance as above; the test prints whether they are bitwise equal: expected with
    deterministic compute)."""
    from types import SimpleNamespace

    import cupy
    import onnx

    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import api
    from ortflow.trainer.comm.engine_buffers import DeviceBuffers
    from ortflow.trainer.comm.nccl import EngineStream
    from ortflow.trainer.parallel.kept_activations import KeptActivations
    from ortflow.trainer.startup import session_options
    from tests.trainer.exports_runs import gpt2_run

    cfg = gpt2_run(tmp_path, "dp", distributed={"num_ranks": 1})
    folder = cfg.artifacts_dir
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    batches = [loader.batch(0, i) for i in range(2)]

    def module():
        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        made = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cuda",
                          session_options=session_options(1, True))
        made.train()
        return state, made

    state, trained = module()
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    for batch in batches:
        trained(*(batch[n] for n in trained.input_names()))
    expected = [np.array(state.parameters[n].grad) for n in trainable]  # host copies on CUDA

    kept_state, _ = module()  # its own device gradient buffers, summed into by the kept calls
    cupy.cuda.Device(0).use()
    stream = EngineStream(cupy, 0)
    buffers = DeviceBuffers(SimpleNamespace(engine_stream=lambda: stream), 0)
    sends = (onnx.load(str(folder / "eval_model.onnx")).graph.output[0].name,)  # the loss: fed its gradient 1
    kept = KeptActivations(folder / "eval_model.onnx", kept_state, trainable, (), sends, session_options(1, True),
                           buffers=buffers)
    losses = [kept.forward(batch)[0] for batch in batches]
    assert kept.in_flight() == 2 and all(isinstance(loss, np.ndarray) for loss in losses)
    for _ in batches:
        assert kept.backward([np.ones((), np.float32)]) == []
    sums = [np.array(kept_state.parameters[n].grad) for n in trainable]
    bitwise = all(a.tobytes() == b.tobytes() for a, b in zip(sums, expected, strict=True))
    print(f"kept activations on the rank's stream: bitwise equal: {bitwise}")
    for name, mine, theirs in zip(trainable, sums, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-5, err_msg=name)
    kept.reset()  # an update: the next micro-batch's gradients replace the sums
    for batch in batches:
        kept.forward(batch)
        kept.backward([np.ones((), np.float32)])
    again = [np.array(kept_state.parameters[n].grad) for n in trainable]
    # Not added to the first sums (that would double them). Equal to ~1e-5, not bitwise: the engine's CUDA gradient
    # of the embedding's Gather adds rows in the order its threads reach them (2 of 32,768 entries differed, H200).
    for name, mine, first in zip(trainable, again, sums, strict=True):
        np.testing.assert_allclose(mine, first, rtol=1e-4, atol=1e-7, err_msg=name)
