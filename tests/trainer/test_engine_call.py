"""``ortflow.engine.call_module``: a training-API Module's training and eval calls on OrtValues, outputs written into
tensors the caller allocated (how tensor-parallel CUDA ranks keep activations on the GPU; here on the CPU build, where
the same binding runs)."""

from __future__ import annotations

import numpy as np

from ortflow.engine import OrtValue, api, call_module
from tests.support.runs import make_run


def _module(cfg):
    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    module = api.Module(str(cfg.artifacts_dir / "training_model.onnx"), state, str(cfg.artifacts_dir /
                                                                                  "eval_model.onnx"))
    return state, module


def _grads(state) -> dict[str, np.ndarray]:
    return {name: np.array(p.grad, copy=True) for name, p in state.parameters if p.requires_grad}


def test_outputs_land_in_the_tensors_the_caller_allocated_with_the_bits_of_the_numpy_call(tmp_path):
    cfg = make_run(tmp_path, "call")
    rng = np.random.default_rng(0)
    feeds = {"features": rng.normal(size=(4, 8)).astype(np.float32), "labels": np.array([0, 1, 2, 1])}
    state, module = _module(cfg)
    names = module.input_names()
    module.train()
    loss = np.asarray(module(*(feeds[n] for n in names)))
    grads = _grads(state)
    module.eval()
    logits = np.asarray(module(*(feeds[n] for n in module.input_names())))

    state2, module2 = _module(cfg)
    inputs = [OrtValue.ortvalue_from_numpy(feeds[n]) for n in names]
    mine = OrtValue.ortvalue_from_shape_and_type(list(loss.shape), np.float32)
    address = mine.data_ptr()
    (out,) = call_module(module2, True, inputs, [mine])
    assert out.data_ptr() == address  # written where the caller allocated it
    assert out.numpy().tobytes() == loss.tobytes()
    for name, grad in _grads(state2).items():
        assert grad.tobytes() == grads[name].tobytes(), name

    module2.eval()
    eval_inputs = [OrtValue.ortvalue_from_numpy(feeds[n]) for n in module2.input_names()]
    (fresh,) = call_module(module2, False, eval_inputs, [])  # nothing allocated: the engine's own host tensor
    assert fresh.device_name() == "cpu"
    assert fresh.numpy().tobytes() == logits.tobytes()
