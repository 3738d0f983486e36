"""A pipeline rank drops the buffers of completed sends instead of holding every sent tensor until the step ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import MPIEXEC


@pytest.mark.mpi
def test_completed_sends_release_their_buffers_at_two_ranks():
    script = str(Path(__file__).with_name("send_release_rank.py"))
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("send release ok") == 2
    print(out.stdout)


def test_a_middle_stage_training_model_returns_no_copy_of_what_it_sent(tmp_path):
    """The forward pass has sent the tensors already; as training outputs the engine would copy them out and keep them
    through the backward pass. Its calls still return the VJP loss (and, from stage 1 on, the input gradients)."""
    import numpy as np
    import onnx

    from ortflow.artifacts_folder import GRAD_IN_SUFFIX, read_stages_record, stage_dir
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options
    from tests.trainer.test_pipeline_mpi import torchlike_run

    cfg = torchlike_run(tmp_path, "pp3", distributed={"num_ranks": 3, "pipeline_parallel_size": 3})
    record = read_stages_record(cfg.artifacts_dir)
    for info in record["stages"][:-1]:
        folder = stage_dir(cfg.artifacts_dir, info["index"])
        train = onnx.load(str(folder / "training_model.onnx"), load_external_data=False).graph
        evaluation = onnx.load(str(folder / "eval_model.onnx"), load_external_data=False).graph
        assert not set(info["sends"]) & {o.name for o in train.output}, info["sends"]
        assert [o.name for o in evaluation.output] == info["sends"]  # the forward pass still gives them
        state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        # plain options: stage_session_options registers a process-wide arena, which another test may have done
        module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                            device="cpu", session_options=session_options(1))
        feeds = {}
        for i in train.input:
            if i.name in state.parameters or "accumulation" in i.name or i.name == "lazy_reset_grad":
                continue
            # Stages inherit the whole model's symbolic batch: any consistent size runs (2 here).
            dims = [d.dim_value if d.dim_value > 0 else 2 for d in i.type.tensor_type.shape.dim]
            elem = i.type.tensor_type.elem_type
            feeds[i.name] = (np.ones(dims, np.int64) if elem == onnx.TensorProto.INT64
                             else np.random.default_rng(0).standard_normal(dims).astype(np.float32))
        module.train()
        outputs = module(*(feeds[n] for n in module.input_names()))
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        assert len(outputs) == 1 + len(info["receives"])  # the VJP loss, then one gradient per received tensor
        assert np.isfinite(float(outputs[0]))
        for name, grad in zip(info["receives"], outputs[1:], strict=True):
            assert grad.shape == feeds[name].shape
        assert all(n + GRAD_IN_SUFFIX in feeds for n in info["sends"])
